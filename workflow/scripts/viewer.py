"""Snakemake wrapper: the static trajectory viewer (results/viewer/index.html) from the database."""

from pathlib import Path

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.report.viewer import build_viewer

    counts = build_viewer(Path(job.input.db), Path(job.output[0]), workers=job.threads)
    print(f"{job.output[0]}/index.html: {counts['trajectories']} trajectories, {counts['turns']} turns, "
          f"{counts['files']} data file(s)")
