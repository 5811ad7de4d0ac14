"""Snakemake wrapper: every workflow/sql/<name>.sql table as results/tables/<name>.md and .csv."""

from pathlib import Path

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.report.tables import build_tables

    out_dir = Path(job.output[0]).parent
    sql_dir = Path(job.params.sql_dir)  # the checkout's SQL (the inputs are its rerun triggers)
    written = build_tables(Path(job.input.db), out_dir, sql_dir, n_boot=job.params.n_boot,
                           report_turn=job.params.report_turn, own_models=job.params.own_models,
                           checkpoints=list(job.input.checkpoints))
    for name, path in written.items():
        print(f"{name}: {path}")
