"""Rule figures -> kpipe.report.figures.build_figures: the paper's figures (4-8) as results/figures/*.png."""

from pathlib import Path

from kpipe.infra.jobs import run_job
from kpipe.report.figures import build_figures

job = snakemake  # noqa: F821 (injected by Snakemake)

# the checkout's SQL (sql_dir; the inputs are its rerun triggers)
run_job(job, build_figures, Path(job.input.db), Path(job.output[0]).parent, Path(job.params.sql_dir), job.params.n_boot)
