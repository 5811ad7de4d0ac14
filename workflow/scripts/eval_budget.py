"""Snakemake wrapper: Kevin's test-time budget splits of one model, level and shard."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.evaluate.kernelbench import budget_job

    budget_job(
        job.input.tasks,
        job.output[0],
        job.params.cache,
        job.params.model,
        job.params.settings,
        level=int(job.wildcards.level),
        shard=int(job.wildcards.shard),
        num_shards=job.params.num_shards,
        run=job.params.run,
        gym=job.params.gym,
        checkpoint=job.input.checkpoint or None,
    )
