"""Rule ingest_queries -> kpipe.data.ingest.ingest_queries_job: one training-query source in the queries schema."""

from kpipe.data.ingest import ingest_queries_job
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, ingest_queries_job, job.params.source, job.output[0])
