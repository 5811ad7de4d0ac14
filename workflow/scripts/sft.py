"""Snakemake wrapper: supervised fine-tuning on the cold-start trajectories."""

from kpipe.jobs import snakemake_job

with snakemake_job(snakemake) as job:  # noqa: F821 (injected by Snakemake)
    import shutil
    from pathlib import Path

    from kpipe.train.samples import load_trajectory_rows
    from kpipe.train.sft import SFTConfig, train_sft

    settings = {k: v for k, v in job.params.sft.items() if k != "gpus"}
    # the locally built tiny model is an input; a hub id or external path is a param
    base_model = job.input.base[0] if job.input.base else job.params.base_model
    cfg = SFTConfig.from_dict({**settings, "base_model": base_model, "run": job.params.run})
    work = Path(job.params.work)
    result = train_sft(cfg, load_trajectory_rows(job.input.trajectories), work, job.output.metrics)
    shutil.copytree(result.model_dir, job.output.model, dirs_exist_ok=True)
    shutil.copy(work / "sft_summary.json", job.output.summary)
    print(f"SFT {cfg.run}: {result.steps} steps, final loss {result.final_loss} -> {job.output.model}")
