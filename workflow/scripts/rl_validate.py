"""Snakemake wrapper: one RL iteration's checkpoint on the validation tasks (stage=rl_val; forked from
the run's warm starter when it is ready: kpipe.infra.launch.job_function)."""

from kpipe.evaluate.kernelbench import validation_job
from kpipe.infra.launch import job_function

job = snakemake  # noqa: F821 (injected by Snakemake)

job_function(
    job,
    validation_job,
    job.input.tasks,
    job.output[0],
    job.params.cache,
    job.input.model,
    job.params.settings,
    job.params.rl,
    run=job.params.run,
    iteration=job.params.iteration,
    gym=job.params.gym,
)
