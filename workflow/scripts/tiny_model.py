"""Rule tiny_model -> kpipe.train.tiny_model.tiny_model_job: the random-weight tiny policy and its tokenizer."""

from kpipe.infra.jobs import run_job
from kpipe.train.tiny_model import tiny_model_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, tiny_model_job, job.output[0], size=job.wildcards.size, seed=int(job.wildcards.seed), **job.params.tokenizer)
