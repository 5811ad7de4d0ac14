"""Snakemake wrapper: (re)build results/kpipe.duckdb as views over the Parquet tables."""

from pathlib import Path

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.data.db import build_db

    db_path = Path(job.output[0])
    counts = build_db(db_path.parent, db_path, Path(job.input.views))
    print(f"built {db_path}: Parquet files per table {counts}")
