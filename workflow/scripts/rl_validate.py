"""Snakemake wrapper: one RL iteration's checkpoint on the validation tasks (stage=rl_val)."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.evaluate.kernelbench import validation_job

    validation_job(
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
