"""Rule ingest_queries -> kpipe.data.ingest.ingest_queries_job: one training-query source in the queries schema."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.data.ingest import ingest_queries_job

    ingest_queries_job(job.params.source, job.output[0])
