"""Rule sft -> kpipe.train.sft.sft_job: supervised fine-tuning, in one process per GPU of the rule (kpipe
launch, its settings in one file beside the log) or in this one."""

import json

from kpipe.infra.jobs import run_job
from kpipe.train.sft import sft_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, sft_job, trajectories=list(job.input.trajectories), work_dir=job.params.work,
        settings=json.loads(job.params.settings), model_out=job.output.model, summary_out=job.output.summary,
        metrics_out=job.output.metrics)
