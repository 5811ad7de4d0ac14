"""Rule rl_iter -> kpipe.train.jobs.rl_job: `kpipe train rl ...` in one process per GPU (kpipe launch;
srun over a multi-node job's nodes), or one process forked from the run's warm starter or run here."""

from kpipe.infra.jobs import run_job
from kpipe.train.jobs import rl_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, rl_job, job.input.queries, job.input.model, job.output.model, job.output.trajectories,
        job.output.metrics, job.params.scratch, run=job.wildcards.run, iteration=int(job.wildcards.iter),
        init_state=job.params.init_state, state_out=job.params.state, drop_init_state=job.params.drop_init_state,
        settings=job.params.settings, gym=job.params.gym, reference_model=job.input.reference)
