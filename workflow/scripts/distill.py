"""Rule distill -> kpipe.agent.distill.distill_job: distill one shard of queries into cold-start trajectories."""

from kpipe.agent.distill import distill_job
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, distill_job, job.input.queries, job.output[0], job.params.cache, job.params.distill,
        shard=int(job.wildcards.shard), num_shards=job.params.num_shards, run=job.params.run, gym=job.params.gym)
