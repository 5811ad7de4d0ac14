"""Snakemake wrapper: the RL checkpoint an evaluation with `checkpoint: best_val` reads, chosen by validation."""

from kpipe.infra.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.evaluate.kernelbench import selection_job

    selection_job(list(job.input), job.params.checkpoints, job.output[0], run=job.wildcards.run,
                  turn=job.params.turn)
