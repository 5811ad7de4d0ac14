"""Rule tables -> kpipe.report.tables.build_tables: every workflow/sql/<name>.sql table as
results/tables/<name>.md and .csv."""

from pathlib import Path

from kpipe.infra.jobs import run_job
from kpipe.report.tables import build_tables

job = snakemake  # noqa: F821 (injected by Snakemake)

# the checkout's SQL (sql_dir; the inputs are its rerun triggers)
run_job(job, build_tables, Path(job.input.db), Path(job.output[0]).parent, Path(job.params.sql_dir),
        n_boot=job.params.n_boot, report_turn=job.params.report_turn, own_models=job.params.own_models,
        checkpoints=list(job.input.checkpoints))
