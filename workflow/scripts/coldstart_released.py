"""Rule coldstart_released -> kpipe.agent.distill.coldstart_released_job: the released cold-start
trajectories as this run's coldstart stage."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.agent.distill import coldstart_released_job

    coldstart_released_job(job.input[0], job.output[0], run=job.params.run)
