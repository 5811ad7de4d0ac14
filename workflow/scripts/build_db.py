"""Snakemake wrapper: (re)build results/kpipe.duckdb as views over the DAG's Parquet files."""

from pathlib import Path

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.data.db import build_db

    db_path = Path(job.output[0])
    files = {table: list(paths) for table, paths in job.input.items() if table != "views"}  # named by table
    counts = build_db(db_path.parent, db_path, Path(job.input.views), files=files)
    print(f"built {db_path}: Parquet files per table {counts}")
