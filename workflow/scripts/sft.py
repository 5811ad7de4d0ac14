"""Rule sft -> kpipe.train.jobs.sft_job: this process becomes `kpipe launch --gpus N -- train sft ...`
(one process per GPU, srun over a multi-node job's nodes; the launch takes the GPU lease and
writes the rule's log, so there is no snakemake_job here)."""

from kpipe.train.jobs import sft_job

job = snakemake  # noqa: F821 (injected by Snakemake)

sft_job(job.input.trajectories, job.params.work, job.params.settings, job.output.model, job.output.summary,
        job.output.metrics, gpus=int(job.resources.gpu), log=job.log[0],
        gpu_slots=int(job.resources.gpu_slots), slots_per_gpu=job.config["gpu"]["slots_per_gpu"])
