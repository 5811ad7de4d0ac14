"""Rule sft -> kpipe.train.jobs.sft_job: `kpipe train sft ...` in one process per GPU (kpipe launch;
srun over a multi-node job's nodes), or one process forked from the run's warm starter or run here."""

from kpipe.infra.jobs import run_job
from kpipe.train.jobs import sft_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, sft_job, list(job.input.trajectories), job.params.work, job.params.settings, job.output.model,
        job.output.summary, job.output.metrics)
