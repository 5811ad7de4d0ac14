"""Rule rl_validate -> kpipe.evaluate.kernelbench.validation_job: one RL iteration's checkpoint on the
validation tasks (stage=rl_val)."""

from kpipe.evaluate.kernelbench import validation_job
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, validation_job, job.input.tasks, job.output[0], job.params.cache, job.input.model, job.params.settings,
        job.params.rl, run=job.params.run, iteration=job.params.iteration, gym=job.params.gym)
