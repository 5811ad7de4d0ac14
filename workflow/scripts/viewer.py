"""Rule viewer -> kpipe.report.viewer.build_viewer: the static trajectory viewer (results/viewer/index.html)
from the database."""

from pathlib import Path

from kpipe.infra.jobs import run_job
from kpipe.report.viewer import build_viewer

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, build_viewer, Path(job.input.db), Path(job.output[0]), workers=job.threads)
