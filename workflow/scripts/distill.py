"""Snakemake wrapper: distill one shard of queries into cold-start trajectories."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.agent.distill import distill_job

    distill_job(
        job.input.queries,
        job.output[0],
        job.params.cache,
        job.params.distill,
        shard=int(job.wildcards.shard),
        num_shards=job.params.num_shards,
        run=job.params.run,
        gym=job.params.gym,
    )
