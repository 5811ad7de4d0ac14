"""Rule decontaminate -> kpipe.data.ingest.decontaminate_job: drop or flag training queries that
(nearly) duplicate an evaluation task."""

from kpipe.data.ingest import decontaminate_job
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, decontaminate_job, job.input.tasks, job.input.queries, job.output.queries, job.output.counts,
        job.params.decontamination)
