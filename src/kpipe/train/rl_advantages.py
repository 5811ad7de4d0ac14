"""What each rollout row is worth to the update: reward-to-go returns (Eq. 2), the switchable filters
(TritonForge's group buffer, the released code's regression and zero-variance masks, MRS Eq. 6,
PRS Eq. 9), each row's rejection reason, and advantages over (prompt, turn) groups (TRLOO Eq. 5, GRPO
Eq. 3, ...). The math is in `kpipe.train.algos`; this wires it to `trajectories` rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kpipe.train import algos
from kpipe.train.rl_config import RLConfig
from kpipe.train.rl_update import response_mask, right_aligned

log = logging.getLogger(__name__)

EMPTY = "empty_response"  # no generated tokens (the engine failed): nothing to train on

# `rejected_by` names the first that drops a row; TritonForge's buffer runs first, as it does upstream of its trainer
FILTER_ORDER = ("buffer_item", "buffer_group", "regression", "zero_variance", "mrs", "prs")


def trajectory_keys(rows: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(row["task_id"], int(row["sample"])) for row in rows]


def row_rewards(rows: Sequence[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([float(row["reward"]) for row in rows], dtype=torch.float64)


def row_returns(rows: Sequence[dict[str, Any]], cfg: RLConfig) -> torch.Tensor:
    """Eq. 2 per row: reward-to-go over the later turns of its own trajectory."""
    return algos.returns_by_trajectory(row_rewards(rows), trajectory_keys(rows), [row["turn"] for row in rows],
                                       cfg.gamma, cfg.return_aggregate)


def mismatch_keep(train_logp: Sequence[torch.Tensor], rollout_logp: Sequence[Sequence[float]],
                  cfg: RLConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """MRS (Eq. 6) per row, and each row's log geometric-mean ratio log w (0 for empty rows)."""
    width = max([len(x) for x in train_logp] + [1])
    train = right_aligned([x.tolist() for x in train_logp], width, torch.float64)
    rollout = right_aligned(rollout_logp, width, torch.float64)
    mask = response_mask([len(x) for x in train_logp], width)
    keep = algos.mrs_mask(train, rollout, mask, cfg.mrs_delta, cfg.mrs_token_veto)
    log_w = torch.nan_to_num(algos.log_geometric_mean_ratio(train, rollout, mask), nan=0.0)
    return keep, log_w


def filter_masks(rows: Sequence[dict[str, Any]], cfg: RLConfig, mrs_keep: torch.Tensor,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The keep mask of every enabled filter (True = keep), computed independently of each other."""
    rewards = row_rewards(rows)
    turns = [row["turn"] for row in rows]
    masks: dict[str, torch.Tensor] = {}
    if cfg.regression_filter:
        masks["regression"] = algos.regression_mask(rewards, trajectory_keys(rows), turns)
    if cfg.zero_variance_filter:
        masks["zero_variance"] = algos.zero_variance_group_mask(
            rewards, [row["task_id"] for row in rows], trajectory_keys(rows), turns, cfg.zero_variance_min_std)
    if cfg.mrs:
        masks["mrs"] = mrs_keep
    if cfg.prs:
        pr, correct, hacked = ([row.get(k) for row in rows] for k in ("pr", "correct", "hacked"))
        if cfg.prs_hard:
            masks["prs"] = algos.prs_hard_keep(pr, correct, hacked, cfg.prs_tau, cfg.prs_scope)
        else:
            probability = algos.prs_keep_probability(pr, correct, hacked, cfg.prs_tau, cfg.prs_softness,
                                                     cfg.prs_scope)
            masks["prs"] = algos.bernoulli_keep(probability, generator)
    return masks


def buffer_keys(rows: Sequence[dict[str, Any]]) -> list[tuple[Any, int]]:
    """TritonForge's groups in kpipe: the rollouts of one prompt at one turn (the advantage groups)."""
    return algos.prompt_turn_keys([row["task_id"] for row in rows], [row["turn"] for row in rows])


def buffer_masks(rows: Sequence[dict[str, Any]], returns: torch.Tensor, cfg: RLConfig) -> dict[str, torch.Tensor]:
    """TritonForge's buffer hooks 2 and 3 as keep masks over the rows' returns (its items' rewards):
    `buffer_item`, its per-item filter (as described: the turn's kernel compiled; as released: a return
    in [0, 1]), and `buffer_group` (a complete group with reward diversity and enough items left after
    the filter). Logs hook 1's statistics; no masks without `rl.buffer`."""
    if cfg.buffer == "none":
        return {}
    keys, size = buffer_keys(rows), cfg.rollouts_per_prompt
    log.info("buffer %s: %s", cfg.buffer, algos.tritonforge_group_stats(returns, keys))
    item = (algos.tritonforge_item_mask([row.get("status") for row in rows]) if cfg.buffer == "tritonforge"
            else algos.tritonforge_released_item_mask(returns))
    group = (algos.tritonforge_valid_group_mask(returns, keys, size, cfg.buffer_min_valid_group_ratio)
             & algos.tritonforge_enough_items_mask(item, keys, size, cfg.buffer_min_valid_item_ratio))
    return {"buffer_item": item, "buffer_group": group}


def buffer_values(rows: Sequence[dict[str, Any]], returns: torch.Tensor, masks: dict[str, torch.Tensor],
                  cfg: RLConfig) -> torch.Tensor:
    """What the advantage estimator sees: without a buffer the returns; with one, hooks 4 and 5 (each
    group's returns normalised over the rows both buffer masks keep, padded to `rollouts_per_prompt`).
    The raw returns stay in the rows' `return_to_go` (TritonForge's ``raw_reward``)."""
    if cfg.buffer == "none":
        return returns
    valid = masks["buffer_item"] & masks["buffer_group"]
    return algos.tritonforge_buffer_values(returns, buffer_keys(rows), valid, cfg.rollouts_per_prompt)


def rejection_reasons(has_tokens: torch.Tensor, masks: dict[str, torch.Tensor]) -> list[str | None]:
    """Per row: None if kept, else the first reason in FILTER_ORDER (empty responses first)."""
    reasons: list[str | None] = []
    for row in range(len(has_tokens)):
        if not has_tokens[row]:
            reasons.append(EMPTY)
            continue
        reasons.append(next((name for name in FILTER_ORDER if name in masks and not masks[name][row]), None))
    return reasons


def row_advantages(rows: Sequence[dict[str, Any]], returns: torch.Tensor, valid: torch.Tensor,
                   cfg: RLConfig) -> torch.Tensor:
    """The valid rows' advantages by the estimator `rl.advantage` names (`kpipe.train.algos.ADVANTAGES`):
    over (prompt, turn) groups (Eq. 3 / Eq. 5), trajectory RLOO, or Kevin's per-task normalisation."""
    batch = algos.AdvantageBatch(returns=returns, rewards=row_rewards(rows), prompt_ids=[row["task_id"] for row in rows],
                                 trajectory_ids=trajectory_keys(rows), turns=[row["turn"] for row in rows], valid=valid,
                                 singleton=cfg.singleton)
    return algos.advantage_fn(cfg.advantage)(batch)


def annotate_rows(rows: list[dict[str, Any]], returns: torch.Tensor, advantages: torch.Tensor,
                  reasons: Sequence[str | None]) -> None:
    """Fill the training columns of the `trajectories` rows in place."""
    for row, ret, adv, reason in zip(rows, returns.tolist(), advantages.tolist(), reasons, strict=True):
        row.update(return_to_go=ret, advantage=adv, kept=reason is None, rejected_by=reason)

