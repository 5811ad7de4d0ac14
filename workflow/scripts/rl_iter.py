"""Rule rl_iter -> kpipe.train.jobs.rl_job: this process becomes `kpipe launch --gpus N -- train rl ...`
(one process per GPU, srun over a multi-node job's nodes; the launch takes the GPU lease and
writes the rule's log, so there is no snakemake_job here)."""

from kpipe.train.jobs import rl_job

job = snakemake  # noqa: F821 (injected by Snakemake)

rl_job(job.input.queries, job.input.model, job.output.model, job.output.trajectories, job.output.metrics,
       job.params.scratch, run=job.wildcards.run, iteration=int(job.wildcards.iter),
       init_state=job.params.init_state, state_out=job.params.state, drop_init_state=job.params.drop_init_state,
       settings=job.params.settings, gym=job.params.gym, gpus=int(job.resources.gpu), log=job.log[0],
       reference_model=job.input.reference, gpu_slots=int(job.resources.gpu_slots),
       slots_per_gpu=job.config["gpu"]["slots_per_gpu"])
