"""Rule ingest_tasks -> kpipe.data.ingest.ingest_tasks_job: the evaluation tasks from the vendored KernelBench sets."""

from kpipe.data.ingest import ingest_tasks_job
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, ingest_tasks_job, job.params.kernelbench, job.output[0])
