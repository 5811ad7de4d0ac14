"""One RL step's rollouts as one batch, and what each phase of the step adds to it (cf. verl's
``DataProto``): the rows and their tokens when built, then returns (Eq. 2), π_train's log-probs and
MRS's ratio (Eq. 6), the filters' masks (TritonForge's group buffer, the released code's regression
and zero-variance masks, MRS, PRS Eq. 9) and each row's rejection reason, the advantages (TRLOO Eq. 5,
GRPO Eq. 3, ...), and the update's metrics. The math is `kpipe.train.algos`; the loop that runs the
phases in order, each under its timer, is `kpipe.train.rl`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kpipe.llm.hf_engine import plain_chat_prompt
from kpipe.train import algos
from kpipe.train.rl_config import RLConfig

log = logging.getLogger(__name__)

EMPTY = "empty_response"  # no generated tokens (the engine failed): nothing to train on
# `rejected_by` names the first that drops a row; TritonForge's buffer runs first, as it does upstream of its trainer
FILTER_ORDER = ("buffer_item", "buffer_group", "regression", "zero_variance", "mrs", "prs")
RowKey = tuple[str, int, int]  # (task_id, sample, turn): names a row of a step on every process


def prompt_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt exactly as the rollout engines render it (chat template, generation prompt)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return plain_chat_prompt(messages)


@dataclass
class TokenSample:
    """One turn as the trainer sees it: prompt ids + the sampled response ids."""

    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def token_samples(rows: Sequence[dict[str, Any]], tokenizer: Any) -> list[TokenSample]:
    """Trainer inputs of rows with a response (rows without one get an empty response)."""
    samples = []
    for row in rows:
        text = prompt_text(tokenizer, list(row["prompt_messages"]))
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        samples.append(TokenSample(prompt_ids, list(row.get("response_token_ids") or [])))
    return samples


def row_key(row: Mapping[str, Any]) -> RowKey:
    return (row["task_id"], int(row["sample"]), int(row["turn"]))


@dataclass
class TrainItem:
    """One kept row as the update takes it."""

    key: RowKey
    sample: TokenSample
    advantage: float
    old_logp: torch.Tensor  # π_train before the update (PPO's old policy)
    ref_logp: torch.Tensor | None = None  # the reference policy's (rl.kl_coef > 0)


@dataclass
class StepBatch:
    """This process's rollouts of one step, one entry per row (a turn of a trajectory). Built from the
    rows (`of_rows`); each phase fills its fields, in the loop's order."""

    rows: list[dict[str, Any]]  # the `trajectories` rows; `annotate` writes the training columns
    samples: list[TokenSample]
    pad_id: int
    rewards: torch.Tensor  # the turns' rewards (KernelGym's judgement through `rl.reward`), float64
    has_tokens: torch.Tensor  # bool: the engine generated something
    rollout_logp: list[list[float]]  # the generating policy's log-probs, one per response token
    # returns phase
    returns: torch.Tensor | None = None  # reward-to-go over the trajectory's later turns (Eq. 2)
    # log-probs phase
    train_logp: list[torch.Tensor] = field(default_factory=list)  # π_train before the update
    ref_logp: list[torch.Tensor | None] = field(default_factory=list)  # the KL term's reference policy
    mrs_keep: torch.Tensor | None = None  # MRS (Eq. 6), computed whether or not the filter is on
    log_w: torch.Tensor | None = None  # log geometric-mean ratio π_train / π_rollout (0 for empty rows)
    # filters phase
    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # every enabled filter's keep mask
    reasons: list[str | None] = field(default_factory=list)  # None: kept; else the first filter that drops it
    kept: torch.Tensor | None = None
    # advantages phase
    advantages: torch.Tensor | None = None
    # update phase
    update: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_rows(cls, rows: list[dict[str, Any]], tokenizer: Any) -> StepBatch:
        samples = token_samples(rows, tokenizer)
        rollout_logp = [list(row.get("response_logprobs") or []) for row in rows]
        for row, sample, logp in zip(rows, samples, rollout_logp, strict=True):
            if len(logp) != len(sample.response_ids):
                raise ValueError(f"{row['task_id']} sample {row['sample']} turn {row['turn']}: "
                                 f"{len(logp)} rollout log-probs for {len(sample.response_ids)} tokens")
        return cls(rows=rows, samples=samples, pad_id=tokenizer.pad_token_id,
                   rewards=torch.tensor([float(row["reward"]) for row in rows], dtype=torch.float64),
                   has_tokens=torch.tensor([bool(s.response_ids) for s in samples], dtype=torch.bool),
                   rollout_logp=rollout_logp)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def prompt_ids(self) -> list[str]:
        return [row["task_id"] for row in self.rows]

    @property
    def trajectory_ids(self) -> list[tuple[str, int]]:
        return [(row["task_id"], int(row["sample"])) for row in self.rows]

    @property
    def turns(self) -> list[int]:
        return [row["turn"] for row in self.rows]

    def column(self, name: str) -> list[Any]:
        """A column of the rows (KernelGym's `status`, `pr`, `correct`, `hacked`; None where absent)."""
        return [row.get(name) for row in self.rows]

    def train_items(self) -> list[TrainItem]:
        """The kept rows, as the update takes them."""
        return [TrainItem(row_key(self.rows[i]), self.samples[i], float(self.advantages[i]), self.train_logp[i],
                          self.ref_logp[i]) for i in range(len(self)) if self.kept[i]]

    def annotate(self) -> None:
        """Fill the training columns of the `trajectories` rows in place."""
        for row, ret, adv, reason in zip(self.rows, self.returns.tolist(), self.advantages.tolist(), self.reasons,
                                         strict=True):
            row.update(return_to_go=ret, advantage=adv, kept=reason is None, rejected_by=reason)


# ----------------------------------------------------------------------------- what the phases compute


def response_mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    """[rows, width] mask of the response tokens in right-aligned [rows, width] tensors."""
    return torch.arange(width).unsqueeze(0) >= (width - torch.tensor(list(lengths))).unsqueeze(1)


def right_aligned(values: Sequence[Sequence[float]], width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row sequences as a [rows, width] tensor, each row's values at the right end, 0 elsewhere."""
    out = torch.zeros((len(values), width), dtype=dtype)
    for row, sequence in enumerate(values):
        if len(sequence):
            out[row, width - len(sequence):] = torch.as_tensor(list(sequence), dtype=dtype)
    return out


def returns(batch: StepBatch, cfg: RLConfig) -> torch.Tensor:
    """Eq. 2 per row: reward-to-go over the later turns of its own trajectory."""
    return algos.returns_by_trajectory(batch.rewards, batch.trajectory_ids, batch.turns, cfg.gamma,
                                       cfg.return_aggregate)


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


def filter_masks(batch: StepBatch, cfg: RLConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The keep mask of every enabled filter but the buffer's (True = keep), computed independently of
    each other; PRS's coin flips drawn from `generator`."""
    masks: dict[str, torch.Tensor] = {}
    if cfg.regression_filter:
        masks["regression"] = algos.regression_mask(batch.rewards, batch.trajectory_ids, batch.turns)
    if cfg.zero_variance_filter:
        masks["zero_variance"] = algos.zero_variance_group_mask(
            batch.rewards, batch.prompt_ids, batch.trajectory_ids, batch.turns, cfg.zero_variance_min_std)
    if cfg.mrs:
        masks["mrs"] = batch.mrs_keep
    if cfg.prs:
        pr, correct, hacked = (batch.column(name) for name in ("pr", "correct", "hacked"))
        if cfg.prs_hard:
            masks["prs"] = algos.prs_hard_keep(pr, correct, hacked, cfg.prs_tau, cfg.prs_scope)
        else:
            probability = algos.prs_keep_probability(pr, correct, hacked, cfg.prs_tau, cfg.prs_softness,
                                                     cfg.prs_scope)
            masks["prs"] = algos.bernoulli_keep(probability, generator)
    return masks


def buffer_keys(batch: StepBatch) -> list[tuple[Any, int]]:
    """TritonForge's groups in kpipe: the rollouts of one prompt at one turn (the advantage groups)."""
    return algos.prompt_turn_keys(batch.prompt_ids, batch.turns)


def buffer_masks(batch: StepBatch, cfg: RLConfig) -> dict[str, torch.Tensor]:
    """TritonForge's buffer hooks 2 and 3 as keep masks over the rows' returns (its items' rewards):
    `buffer_item`, its per-item filter (as described: the turn's kernel compiled; as released: a return
    in [0, 1]), and `buffer_group` (a complete group with reward diversity and enough items left after
    the filter). Logs hook 1's statistics; no masks without `rl.buffer`."""
    if cfg.buffer == "none":
        return {}
    keys, size = buffer_keys(batch), cfg.rollouts_per_prompt
    log.info("buffer %s: %s", cfg.buffer, algos.tritonforge_group_stats(batch.returns, keys))
    item = (algos.tritonforge_item_mask(batch.column("status")) if cfg.buffer == "tritonforge"
            else algos.tritonforge_released_item_mask(batch.returns))
    group = (algos.tritonforge_valid_group_mask(batch.returns, keys, size, cfg.buffer_min_valid_group_ratio)
             & algos.tritonforge_enough_items_mask(item, keys, size, cfg.buffer_min_valid_item_ratio))
    return {"buffer_item": item, "buffer_group": group}


def buffer_values(batch: StepBatch, cfg: RLConfig) -> torch.Tensor:
    """What the advantage estimator sees: without a buffer the returns; with one, hooks 4 and 5 (each
    group's returns normalised over the rows both buffer masks keep, padded to `rollouts_per_prompt`).
    The raw returns stay in the rows' `return_to_go` (TritonForge's ``raw_reward``)."""
    if cfg.buffer == "none":
        return batch.returns
    valid = batch.masks["buffer_item"] & batch.masks["buffer_group"]
    return algos.tritonforge_buffer_values(batch.returns, buffer_keys(batch), valid, cfg.rollouts_per_prompt)


def rejection_reasons(has_tokens: torch.Tensor, masks: Mapping[str, torch.Tensor]) -> list[str | None]:
    """Per row: None if kept, else the first reason in FILTER_ORDER (empty responses first)."""
    reasons: list[str | None] = []
    for row in range(len(has_tokens)):
        if not has_tokens[row]:
            reasons.append(EMPTY)
            continue
        reasons.append(next((name for name in FILTER_ORDER if name in masks and not masks[name][row]), None))
    return reasons


def advantages(batch: StepBatch, cfg: RLConfig) -> torch.Tensor:
    """The valid rows' advantages by the estimator `rl.advantage` names (`kpipe.train.algos.ADVANTAGES`),
    on the buffer's values when `rl.buffer` is set; valid: the kept rows (or every row with tokens,
    `baseline_includes_rejected`)."""
    valid = batch.has_tokens if cfg.baseline_includes_rejected else batch.kept
    estimator_batch = algos.AdvantageBatch(returns=buffer_values(batch, cfg), rewards=batch.rewards,
                                           prompt_ids=batch.prompt_ids, trajectory_ids=batch.trajectory_ids,
                                           turns=batch.turns, valid=valid, singleton=cfg.singleton)
    return algos.advantage_fn(cfg.advantage)(estimator_batch)
