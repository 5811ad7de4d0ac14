"""The jobs of the training rules, `sft` and `rl_iter`: each returns its ``kpipe train sft|rl``
command line (the options of :mod:`kpipe.train.cli`), which :func:`kpipe.infra.jobs.run_job` runs
in one process per GPU of the rule (:func:`kpipe.infra.jobs.launched`): ``kpipe launch`` (FSDP2
from two GPUs, ``srun`` over the nodes of a multi-node SLURM job), or one process (a CPU, one GPU)
forked from the run's warm starter or in the job's own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kpipe.infra.jobs import launched

PathLike = str | os.PathLike


def _settings(settings: Mapping[str, Any] | str) -> str:
    return settings if isinstance(settings, str) else json.dumps(dict(settings), sort_keys=True)


@launched
def sft_job(trajectories: Sequence[PathLike], work_dir: PathLike, settings: Mapping[str, Any] | str,
            model_out: PathLike, summary_out: PathLike, metrics_out: PathLike) -> list[str]:
    """Rule `sft`, supervised fine-tuning on the cold-start trajectories (``kpipe.train.sft.train_sft``):
    ``train sft ...``, checkpoints and the metrics so far in `work_dir` (a rerun resumes from them),
    the finished model, summary and metrics copied to the rule's outputs."""
    args = ["train", "sft"]
    for path in trajectories:
        args += ["--trajectories", str(path)]
    return [*args, "--out", str(work_dir), "--metrics", f"{work_dir}/train_metrics.parquet",
            "--settings", _settings(settings), "--model-out", str(model_out), "--summary-out", str(summary_out),
            "--metrics-out", str(metrics_out)]


@launched
def rl_job(queries: PathLike, init_model: PathLike, model_out: PathLike, trajectories: PathLike, metrics: PathLike,
           scratch: PathLike, *, run: str, iteration: int, init_state: PathLike | None, state_out: PathLike,
           drop_init_state: bool, settings: Mapping[str, Any] | str, gym: Mapping[str, Any] | str,
           reference_model: PathLike | None = None) -> list[str]:
    """Rule `rl_iter`, one RL iteration (``kpipe.train.rl.run_iteration``): ``train rl ...`` from
    `init_model` (and the previous iteration's optimizer state `init_state`, none for iteration 0),
    partial work in `scratch`; `reference_model`: the KL term's reference policy."""
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


