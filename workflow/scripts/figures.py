"""Snakemake wrapper: the paper's figures (4-8) as results/figures/*.png."""

from pathlib import Path

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.report.figures import build_figures

    sql_dir = Path(job.params.sql_dir)  # the checkout's SQL (the inputs are its rerun triggers)
    figures = build_figures(Path(job.input.db), Path(job.output[0]).parent, sql_dir, job.params.n_boot)
    for name, path in figures.items():
        print(f"{name}: {path}")
