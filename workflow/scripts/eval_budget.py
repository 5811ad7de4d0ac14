"""Rule eval_budget -> kpipe.evaluate.kernelbench.budget_job: Kevin's test-time budget splits of one
model, level and shard."""

from kpipe.evaluate.kernelbench import budget_job
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, budget_job, job.input.tasks, job.output[0], job.params.cache, job.params.model, job.params.settings,
        level=int(job.wildcards.level), shard=int(job.wildcards.shard), num_shards=job.params.num_shards,
        run=job.params.run, gym=job.params.gym, checkpoint=job.input.checkpoint or None)
