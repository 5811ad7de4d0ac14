"""Snakemake wrapper: one RL iteration (kpipe.train.rl.run_iteration)."""

from kpipe.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    from kpipe.train.rl import drop_optimizer_state, run_iteration, training_tasks
    from kpipe.train.rl_config import RLConfig

    cfg = RLConfig.from_dict(job.params.rl)
    result = run_iteration(
        cfg, training_tasks(job.input.queries, cfg.max_prompts), job.input.model, job.output.model,
        job.output.trajectories, job.output.metrics, job.params.scratch, run=job.params.run,
        iteration=job.params.iteration, init_state=job.params.init_state, state_out=job.params.state,
        gym=job.params.gym,
    )
    if not job.params.keep_optimizer_states and job.params.init_state:
        drop_optimizer_state(job.params.init_state)  # the next iteration needs only this one's
    print(f"RL {job.params.run} iteration {job.params.iteration}: {result.rows} turns, "
          f"mean reward {result.mean_reward:.3f}, {result.resumed_steps} step(s) resumed -> {result.model_dir}")
