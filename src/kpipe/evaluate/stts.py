"""Sequential test-time scaling (paper §6.3, Figure 6): more refinement turns than training
used, through the same loop as evaluation, with one of three history strategies:

- `full`: vanilla extrapolation, the whole history in every prompt (grows linearly with T);
- `top_w`: context management as the paper describes it, the w highest-reward turns
  (w = 4), in their original order;
- `best_window`: what the released code does, the w consecutive turns with the highest
  summed reward.

The reward that ranks the turns is DR. KERNEL's training reward with its PR term (Eq. 8,
`kpipe.agent.loop.profiled_reward`): §6.3 says "the top-w turns with the highest rewards" and the
model it scales was trained on that reward. It is also the STTS rows' `reward`.

One run of T_max turns gives the whole curve: turn T never depends on later turns, so the
Fast@1.2 of turn T (last turn) and of turns 1..T (best of history) are read off the rows
(`workflow/sql/stts_curves.sql`). Rows have stage="stts"; the strategy is part of the model
label, "<model>@<strategy>" (the trajectories schema has no column for it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kpipe.agent.history import make_policy
from kpipe.agent.loop import profiled_reward
from kpipe.evaluate.kernelbench import check_model, checkpoint_iteration, eval_tasks, run_model_shard

STAGE = "stts"
STRATEGIES = ("full", "top_w", "best_window")


def stts_model_label(model: str, strategy: str, w: int) -> str:
    """The `model` column of STTS rows: "<model>@full" or "<model>@<strategy>(w=<w>)"."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown STTS strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return f"{model}@{strategy}" if strategy == "full" else f"{model}@{strategy}(w={w})"


def stts_job(tasks_path: str | os.PathLike, out_path: str | os.PathLike, cache_path: str | os.PathLike,
             entry: Mapping[str, Any], settings: Mapping[str, Any], *, strategy: str, level: int, shard: int = 0,
             num_shards: int = 1, run: str = "default", gym: Mapping[str, Any] | None = None,
             checkpoint: str | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """One STTS shard: `settings` is the `stts` config section (max_turns, window, samples, ...)."""
    check_model(entry)
    w = int(settings.get("window", 4))
    if w < 1:
        raise ValueError(f"stts.window must be >= 1, got {w}")
    tasks = eval_tasks(tasks_path, level, shard, num_shards, settings.get("max_tasks"))
    return run_model_shard(tasks, entry, settings, out_path, cache_path,
                           model_label=stts_model_label(entry["name"], strategy, w), stage=STAGE,
                           policy=make_policy(strategy, w), n_turns=int(settings.get("max_turns", 8)), run=run,
                           gym=gym, checkpoint=checkpoint, progress=progress, iteration=checkpoint_iteration(checkpoint),
                           reward_fn=profiled_reward)
