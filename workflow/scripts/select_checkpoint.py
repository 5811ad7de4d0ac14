"""Rule select_checkpoint -> kpipe.evaluate.kernelbench.selection_job: the RL checkpoint an evaluation
with `checkpoint: best_val` reads, chosen by validation."""

from kpipe.evaluate.kernelbench import selection_job
from kpipe.infra.jobs import run_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, selection_job, list(job.input), job.params.checkpoints, job.output[0], run=job.wildcards.run,
        turn=job.params.turn)
