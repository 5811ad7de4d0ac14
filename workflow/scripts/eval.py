"""Snakemake wrapper: one KernelBench evaluation shard of one model and level (forked from the run's
warm starter when it is ready: kpipe.infra.launch.job_function)."""

from kpipe.evaluate.kernelbench import eval_job
from kpipe.infra.launch import job_function

job = snakemake  # noqa: F821 (injected by Snakemake)

job_function(
    job,
    eval_job,
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
