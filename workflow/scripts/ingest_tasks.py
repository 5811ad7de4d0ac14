"""Rule ingest_tasks -> kpipe.data.ingest.ingest_tasks_job: the evaluation tasks from the vendored KernelBench sets."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.data.ingest import ingest_tasks_job

    ingest_tasks_job(job.params.kernelbench, job.output[0])
