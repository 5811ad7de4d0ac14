"""Rule build_db -> kpipe.data.db.build_db: (re)build results/kpipe.duckdb as views over the DAG's Parquet files."""

from pathlib import Path

from kpipe.data.db import build_db
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

files = {table: list(paths) for table, paths in job.input.items() if table != "views"}  # named by table
run_job(job, build_db, Path(job.output[0]).parent, Path(job.output[0]), Path(job.input.views), files=files)
