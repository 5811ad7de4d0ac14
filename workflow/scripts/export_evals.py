"""Rule export_evals -> kpipe.gym.serve.cache.export_evals: the KernelGym result cache (gym.cache) as
results/evals/gym_cache.parquet."""

from kpipe.gym.serve.cache import export_evals
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, export_evals, job.params.cache, job.output[0])
