"""Rule coldstart_released -> kpipe.agent.distill.coldstart_released_job: the released cold-start
trajectories as this run's coldstart stage."""

from kpipe.agent.distill import coldstart_released_job
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, coldstart_released_job, job.input[0], job.output[0], run=job.params.run)
