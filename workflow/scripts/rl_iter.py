"""Rule rl_iter -> kpipe.train.rl.rl_job: one RL iteration, in one process per GPU of the rule (kpipe launch,
its settings in one file beside the log) or in this one."""

import json

from kpipe.infra.jobs import run_job
from kpipe.train.rl import rl_job

job = snakemake  # noqa: F821 (injected by Snakemake)

run_job(job, rl_job, queries=job.input.queries, init_model=job.input.model, model_out=job.output.model,
        trajectories=job.output.trajectories, metrics=job.output.metrics, scratch=job.params.scratch,
        run=job.wildcards.run, iteration=int(job.wildcards.iter), rl=json.loads(job.params.settings),
        gym=json.loads(job.params.gym), init_state=job.params.init_state or None, state_out=job.params.state or None,
        drop_init_state=job.params.drop_init_state, reference_model=job.input.reference, export=job.params.export)
