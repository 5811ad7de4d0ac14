"""The jobs of the training rules that run under ``kpipe launch``: `sft` and `rl_iter`.

Each builds its ``kpipe train sft|rl`` command line (the options of :mod:`kpipe.train.cli`) and
replaces the Snakemake script's process by ``kpipe launch --gpus N -- <that>``
(:func:`kpipe.infra.launch.exec_launch`): one process per GPU (FSDP2 from two), ``srun`` over the
nodes of a multi-node SLURM job, plain Python on a CPU. The launch takes the GPU lease, so these
scripts do not enter :func:`kpipe.infra.jobs.snakemake_job` (whose lease of the same GPUs the
launch would then wait for); the job's output goes to the rule's log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from kpipe.infra.launch import exec_launch

PathLike = str | os.PathLike


def _settings(settings: Mapping[str, Any] | str) -> str:
    return settings if isinstance(settings, str) else json.dumps(dict(settings), sort_keys=True)


def sft_arguments(trajectories: Sequence[PathLike], work_dir: PathLike, settings: Mapping[str, Any] | str,
                  model_out: PathLike, summary_out: PathLike, metrics_out: PathLike) -> list[str]:
    """``train sft ...``: checkpoints and the metrics so far in `work_dir` (a rerun resumes from
    them), the finished model, summary and metrics copied to the rule's outputs."""
    args = ["train", "sft"]
    for path in trajectories:
        args += ["--trajectories", str(path)]
    return [*args, "--out", str(work_dir), "--metrics", f"{work_dir}/train_metrics.parquet",
            "--settings", _settings(settings), "--model-out", str(model_out), "--summary-out", str(summary_out),
            "--metrics-out", str(metrics_out)]


def sft_job(trajectories: Sequence[PathLike], work_dir: PathLike, settings: Mapping[str, Any] | str,
            model_out: PathLike, summary_out: PathLike, metrics_out: PathLike, *, gpus: int,
            log: PathLike | None = None, gpu_slots: int | None = None, slots_per_gpu: int = 1) -> NoReturn:
    """Rule `sft`: supervised fine-tuning on the cold-start trajectories (``kpipe.train.sft.train_sft``)
    on `gpus` GPUs, leasing `gpu_slots` of `slots_per_gpu` per GPU (default: the GPUs whole); this
    process becomes the launch."""
    exec_launch(gpus, sft_arguments(trajectories, work_dir, settings, model_out, summary_out, metrics_out), log,
                None if gpu_slots is None else (gpu_slots, slots_per_gpu))


def rl_arguments(queries: PathLike, init_model: PathLike, model_out: PathLike, trajectories: PathLike,
                 metrics: PathLike, scratch: PathLike, *, run: str, iteration: int, init_state: PathLike | None,
                 state_out: PathLike, drop_init_state: bool, settings: Mapping[str, Any] | str,
                 gym: Mapping[str, Any] | str, reference_model: PathLike | None = None) -> list[str]:
    """``train rl ...``: one iteration from `init_model` (and the previous iteration's optimizer
    state `init_state`, none for iteration 0), partial work in `scratch`; `reference_model`: the KL
    term's reference policy."""
    args = ["train", "rl", "--queries", str(queries), "--init-model", str(init_model), "--model-out", str(model_out),
            "--trajectories", str(trajectories), "--metrics", str(metrics), "--scratch", str(scratch),
            "--run", run, "--iteration", str(iteration)]
    if init_state:
        args += ["--init-state", str(init_state)]
    args += ["--state-out", str(state_out)]
    if drop_init_state:
        args.append("--drop-init-state")
    if reference_model:
        args += ["--reference-model", str(reference_model)]
    return [*args, "--settings", _settings(settings), "--gym", _settings(gym)]


def rl_job(queries: PathLike, init_model: PathLike, model_out: PathLike, trajectories: PathLike, metrics: PathLike,
           scratch: PathLike, *, run: str, iteration: int, init_state: PathLike | None, state_out: PathLike,
           drop_init_state: bool, settings: Mapping[str, Any] | str, gym: Mapping[str, Any] | str, gpus: int,
           log: PathLike | None = None, reference_model: PathLike | None = None, gpu_slots: int | None = None,
           slots_per_gpu: int = 1) -> NoReturn:
    """Rule `rl_iter`: one RL iteration (``kpipe.train.rl.run_iteration``) on `gpus` GPUs, leasing
    `gpu_slots` of `slots_per_gpu` per GPU (default: the GPUs whole); this process becomes the launch."""
    exec_launch(gpus, rl_arguments(queries, init_model, model_out, trajectories, metrics, scratch, run=run,
                                   iteration=iteration, init_state=init_state, state_out=state_out,
                                   drop_init_state=drop_init_state, settings=settings, gym=gym,
                                   reference_model=reference_model), log,
                None if gpu_slots is None else (gpu_slots, slots_per_gpu))
