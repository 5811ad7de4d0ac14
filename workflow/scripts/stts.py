"""Snakemake wrapper: one STTS shard of one model, history strategy and level."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.evaluate.stts import stts_job

    settings = dict(job.params.settings)
    if job.params.window is not None:
        settings["window"] = job.params.window
    stts_job(
        job.input.tasks,
        job.output[0],
        job.params.cache,
        job.params.model,
        settings,
        strategy=job.wildcards.strategy,
        level=int(job.wildcards.level),
        shard=int(job.wildcards.shard),
        num_shards=job.params.num_shards,
        run=job.params.run,
        gym=job.params.gym,
        checkpoint=job.input.checkpoint or None,
    )
