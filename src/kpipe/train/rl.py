"""Multi-turn RL iterations (paper §4–5): rollouts → rewards → returns → advantages → filters →
PPO-clip update → checkpoint, as one resumable unit of work per Snakemake job.

One iteration runs `steps_per_iteration` steps. A step:

1. picks `prompts_per_step` training queries (a pure function of seed and global step) and runs
   `rollouts_per_prompt` multi-turn episodes each through the one agent loop
   (`kpipe.agent.run_episodes`), the policy generating with per-token log-probabilities and
   KernelGym judging every turn (per-turn reward, Eq. 1 / Eq. 8);
2. computes reward-to-go returns per trajectory (Eq. 2) and recomputes π_train on the very
   same tokens (the old log-probs of PPO, and the numerator of MRS's ratio, Eq. 6);
3. applies the switchable filters — TritonForge's group buffer, MRS (Eq. 6), PRS (Eq. 9), the
   released code's zero-variance and regression masks — each counted in the metrics;
4. computes advantages over (prompt, turn) groups of the kept rows (TRLOO, Eq. 5, by default; on the
   buffer's normalised returns when `rl.buffer` is set);
5. takes PPO-clip token-level optimizer steps (dual clip, seq-mean-token-sum, grad clipping).

Every turn becomes a `trajectories` row (stage "rl") with its reward, return, advantage and
whether (and by which filter) it was dropped; every step logs `train_metrics` rows.

Resumable: each step's rollouts are saved in a scratch directory before training on them, and
with several steps per iteration each finished step leaves a checkpoint there, so a killed job
redoes only unfinished work. Final outputs are written once, atomically, at the end; a
fingerprint (config, run, iteration, input checkpoint, tasks) guards the scratch directory.

Several processes (``kpipe launch --gpus N -- train rl ...``: one per GPU, FSDP2) run the same
step data-parallel: each takes an equal share of the step's prompts, generates and evaluates
their rollouts itself (on a full-weight copy of the policy and its own GPU), and computes
returns, filters and advantages locally — the (prompt, turn) groups never straddle processes.
The update is the one a single process would take on all the rows: mini-batches are drawn from
every process's rows, each loss is normalised by global counts, DDP/FSDP average the gradients.
Rank 0 writes the gathered rows and metrics; checkpoints go through accelerate.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from kpipe.data import metrics as kmetrics
from kpipe.agent.evaluator import CachedEvaluator, Evaluator
from kpipe.agent.history import make_policy
from kpipe.agent.loop import GENERATION_ERROR, AgentTask, Sampling, run_episodes
from kpipe.data.io import read_table, write_table
from kpipe.llm.extract import FORMAT_ERROR
from kpipe.llm.hf_engine import plain_chat_prompt
from kpipe.llm.types import ChatRequest, Completion, Engine, ResultCallback
from kpipe.train import algos
from kpipe.train.checkpoint import export_hf, latest_checkpoint, save_checkpoint
from kpipe.train.metrics_log import MetricsLog
from kpipe.train.rl_config import RLConfig
from kpipe.train.sft import batch_indices, max_over_processes, plan_micro_batches, resolve_precision

log = logging.getLogger(__name__)

STAGE = "rl"
EMPTY = "empty_response"  # no generated tokens (the engine failed): nothing to train on
# `rejected_by` names the first that drops a row; TritonForge's buffer runs first, as it does upstream of its trainer
FILTER_ORDER = ("buffer_item", "buffer_group", "regression", "zero_variance", "mrs", "prs")
FAST_PS = (1.0, 1.2)
NOT_EVALUATED = (FORMAT_ERROR, GENERATION_ERROR)  # turns KernelGym never saw


# --------------------------------------------------------------------------- inputs and outputs


@dataclass(frozen=True)
class IterationResult:
    model_dir: Path
    steps: int
    resumed_steps: int  # steps whose work a previous (killed) attempt had already finished
    rows: int
    mean_reward: float


def directory_identity(path: str | os.PathLike | None) -> str:
    """Names, sizes and modification times of the files under `path`: changes when it is rewritten."""
    digest = hashlib.sha256()
    if path is None or not Path(path).is_dir():
        return "none"
    path = Path(path)
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def iteration_fingerprint(cfg: RLConfig, run: str, iteration: int, init_identity: str,
                          tasks: Sequence[AgentTask], protocol_json: str) -> str:
    """What the scratch work of an iteration depends on; a mismatch means start the iteration over."""
    digest = hashlib.sha256(json.dumps([cfg.fingerprint(), run, iteration, init_identity, protocol_json]).encode())
    for task in tasks:
        digest.update(task.task_id.encode())
        digest.update(task.reference_src.encode())
    return digest.hexdigest()[:16]


def prepare_scratch(scratch: Path, fingerprint: str) -> bool:
    """Keep `scratch` if it belongs to this fingerprint (returns True), else clear it for a fresh start."""
    marker = scratch / "fingerprint.json"
    if marker.exists() and json.loads(marker.read_text()).get("fingerprint") == fingerprint:
        return True
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    marker.write_text(json.dumps({"fingerprint": fingerprint}))
    return False


def step_tasks(tasks: Sequence[AgentTask], prompts_per_step: int, seed: int, global_step: int) -> list[AgentTask]:
    """The prompts of one global step: consecutive slices of a fresh permutation per epoch."""
    return [tasks[i] for i in batch_indices(len(tasks), min(prompts_per_step, len(tasks)), seed, global_step)]


def step_seed(seed: int, global_step: int) -> int:
    """Sampling seed of one step: every step draws new rollouts, a rerun draws the same ones."""
    return int(hashlib.sha256(f"rl:{seed}:{global_step}".encode()).hexdigest()[:8], 16)


def check_processes(cfg: RLConfig, n_prompts: int, processes: int) -> None:
    """What several processes cannot run, as one-line errors before any work: every process gets
    the same number of prompts; vLLM rollouts stay in one process (not verified data-parallel)."""
    if processes > 1 and cfg.engine == "vllm":
        raise ValueError(f"RL: engine 'vllm' runs in one process, not {processes}: set rl.gpus to 1, "
                         "or use engine 'hf' for data-parallel rollouts on several GPUs")
    if n_prompts % processes:
        raise ValueError(f"RL: {n_prompts} prompts per step cannot be split evenly over {processes} processes; "
                         "make rl.prompts_per_step (and the number of training prompts) a multiple of rl.gpus")


def process_tasks(tasks: Sequence[AgentTask], rank: int, processes: int) -> list[AgentTask]:
    """The prompts of one process: every `processes`-th from `rank`, each with all its rollouts, so
    the (prompt, turn) groups of the advantages never straddle processes."""
    return list(tasks[rank::processes])


# --------------------------------------------------------------------------- timing wrappers


class TimedEngine:
    """An engine that adds up the wall time of its `generate` calls (the step's generation time)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = engine.model
        self.seconds = 0.0

    def generate(self, requests: list[ChatRequest], on_result: ResultCallback | None = None) -> list[Completion]:
        started = time.perf_counter()
        try:
            return self.engine.generate(requests, on_result)
        finally:
            self.seconds += time.perf_counter() - started


class TimedEvaluator:
    """An evaluator that adds up the wall time of its `evaluate_many` calls."""

    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator
        self.seconds = 0.0

    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[Any]:
        started = time.perf_counter()
        try:
            return self.evaluator.evaluate_many(jobs)
        finally:
            self.seconds += time.perf_counter() - started


# --------------------------------------------------------------------------- token sequences and log-probs


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


def left_padded(samples: Sequence[TokenSample], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and position_ids, left-padded so every response ends at the right edge.

    Position ids count real tokens only, as `generate` does with left padding, so the trainer's
    log-probs are those of the same computation the rollout did.
    """
    width = max(s.length for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids = sample.prompt_ids + sample.response_ids
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


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


def response_logits(model: Any, samples: Sequence[TokenSample], pad_id: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits predicting each response token ([batch, R, vocab], right-aligned, R = longest response)
    and the response token ids; only the last R+1 positions' logits are computed (vocabularies are big)."""
    width = max(len(s.response_ids) for s in samples)
    batch = {k: v.to(device) for k, v in left_padded(samples, pad_id).items()}
    output = model(**batch, logits_to_keep=width + 1, use_cache=False)
    return output.logits[:, :-1, :], batch["input_ids"][:, -width:]


def sequence_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(token) under the sampling distribution softmax(logits / T), as the rollout engine recorded it."""
    return algos.log_probs_from_logits(logits.float() / temperature, tokens)


def filler_sample(pad_id: int) -> TokenSample:
    """A one-token sample for the forward passes a process runs only to keep pace with the others."""
    return TokenSample([pad_id], [pad_id])


@torch.no_grad()
def policy_log_probs(model: Any, samples: Sequence[TokenSample], temperature: float, token_budget: int,
                     pad_id: int, device: torch.device, progress: bool = False,
                     pass_count: Callable[[int], int] | None = None) -> list[torch.Tensor]:
    """π_train log-probs of every sample's response tokens (1-D CPU tensors), in micro-batches.

    `pass_count(n)` turns this process's n forward passes into the number to run: a sharded model
    needs every process to run as many as the busiest (`max_over_processes`); the extra passes
    run on a filler and are discarded.
    """
    out: list[torch.Tensor] = [torch.zeros(0)] * len(samples)
    todo = [i for i, s in enumerate(samples) if s.response_ids]
    groups = plan_micro_batches([samples[i].length for i in todo], token_budget)
    passes = pass_count(len(groups)) if pass_count is not None else len(groups)
    for k in tqdm(range(passes), desc="π_train log-probs", disable=not progress, leave=False):
        if k >= len(groups):
            response_logits(model, [filler_sample(pad_id)], pad_id, device)
            continue
        group = groups[k]
        batch = [samples[todo[g]] for g in group]
        logits, tokens = response_logits(model, batch, pad_id, device)
        logp = sequence_log_probs(logits, tokens, temperature).cpu()
        for g, sample, row_logp in zip(group, batch, logp, strict=True):
            out[todo[g]] = row_logp[logp.shape[1] - len(sample.response_ids):]
    return out


# --------------------------------------------------------------------------- returns, filters, advantages


def trajectory_keys(rows: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(row["task_id"], int(row["sample"])) for row in rows]


def row_returns(rows: Sequence[dict[str, Any]], cfg: RLConfig) -> torch.Tensor:
    """Eq. 2 per row: reward-to-go over the later turns of its own trajectory."""
    rewards = torch.tensor([float(row["reward"]) for row in rows], dtype=torch.float64)
    return algos.returns_by_trajectory(rewards, trajectory_keys(rows), [row["turn"] for row in rows], cfg.gamma,
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


def filter_masks(rows: Sequence[dict[str, Any]], cfg: RLConfig, mrs_keep: torch.Tensor,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The keep mask of every enabled filter (True = keep), computed independently of each other."""
    rewards = torch.tensor([float(row["reward"]) for row in rows], dtype=torch.float64)
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
            masks["prs"] = algos.prs_hard_keep(pr, correct, hacked, cfg.prs_tau)
        else:
            probability = algos.prs_keep_probability(pr, correct, hacked, cfg.prs_tau, cfg.prs_softness)
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
    """Advantages over (prompt, turn) groups of the valid rows (Eq. 3 / Eq. 5), or trajectory RLOO."""
    prompts = [row["task_id"] for row in rows]
    if cfg.advantage == "rloo_trajectory":
        rewards = torch.tensor([float(row["reward"]) for row in rows], dtype=torch.float64)
        return algos.rloo_trajectory_advantages(rewards, prompts, trajectory_keys(rows), valid, cfg.singleton)
    keys = algos.prompt_turn_keys(prompts, [row["turn"] for row in rows])
    if cfg.advantage == "trloo":
        return algos.trloo_advantages(returns, keys, valid, cfg.singleton)
    return algos.advantage_fn(cfg.advantage)(returns, keys, valid)


# --------------------------------------------------------------------------- the policy update


RowKey = tuple[str, int, int]  # (task_id, sample, turn): names a row of a step on every process


def row_key(row: Mapping[str, Any]) -> RowKey:
    return (row["task_id"], int(row["sample"]), int(row["turn"]))


@dataclass
class TrainItem:
    key: RowKey
    sample: TokenSample
    advantage: float
    old_logp: torch.Tensor  # π_train before the update (PPO's old policy)


def loss_units(agg_mode: str, response_lengths: Sequence[int]) -> int:
    """What a mini-batch's loss is a mean over: its response tokens (token-mean) or its sequences."""
    return sum(response_lengths) if agg_mode == "token-mean" else len(response_lengths)


def micro_batch_weight(agg_mode: str, micro_lengths: Sequence[int], mini_units: int) -> float:
    """Share of one micro-batch (its response lengths) in its mini-batch's loss, the mini-batch
    counted over every process (`mini_units`, from `loss_units`), so gradient accumulation and any
    number of processes give the gradient of one big batch."""
    return loss_units(agg_mode, micro_lengths) / mini_units


def summed_over_processes(accelerator: Any, values: Mapping[str, float]) -> dict[str, float]:
    """Each value added up over all processes (every process passes the same names)."""
    names = sorted(values)
    local = torch.tensor([float(values[name]) for name in names], dtype=torch.float64, device=accelerator.device)
    return dict(zip(names, accelerator.reduce(local, "sum").tolist(), strict=True))


def global_means(accelerator: Any, totals: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """sum / count of each metric over every process's rows, so N processes report what one
    process would on the same rows; a metric that counts nothing anywhere is left out."""
    sums = summed_over_processes(accelerator, {name: total for name, (total, _) in totals.items()})
    counts = summed_over_processes(accelerator, {name: count for name, (_, count) in totals.items()})
    return {name: sums[name] / counts[name] for name in totals if counts[name]}


def update_policy(accelerator: Any, model: Any, optimizer: Any, items: Sequence[TrainItem], cfg: RLConfig,
                  pad_id: int, generator: torch.Generator, progress: bool = False) -> dict[str, float]:
    """PPO-clip optimizer steps on this process's `items`: `ppo_epochs` passes over `mini_batches`
    mini-batches each, the same steps one process would take on every process's items.

    Mini-batches are drawn from all processes' items, ordered by key and shuffled with `generator`
    (in the same state on every process), so they do not depend on which process holds a row.
    Each micro-batch's loss is weighted by its share of its global mini-batch and multiplied by
    the process count, since DDP/FSDP average gradients over processes. Every process runs as many
    forward passes as the busiest; its extra ones run on a filler with weight 0.

    Returns the means over optimizer steps of loss, grad_norm, clip fractions and approx KL, the
    token-mean entropy of the policy on the trained tokens during the first epoch, and the number
    of trained rows (all over every process).
    """
    device, world = accelerator.device, accelerator.num_processes
    units = dict(gather_object([(item.key, len(item.sample.response_ids)) for item in items]))
    keys, mine = sorted(units), {item.key: item for item in items}
    filler = TrainItem(("", -1, -1), filler_sample(pad_id), 0.0, torch.zeros(1))
    stats: dict[str, list[float]] = {}
    entropy = {"sum": 0.0, "tokens": 0.0}
    bar = tqdm(total=cfg.ppo_epochs * min(cfg.mini_batches, len(keys)), desc="update", unit="step",
               disable=not progress, leave=False)  # the job log's progress line during the update
    for epoch in range(cfg.ppo_epochs if keys else 0):
        order = torch.randperm(len(keys), generator=generator).tolist()
        for positions in np.array_split(np.array(order), min(cfg.mini_batches, len(keys))):
            mini_keys = [keys[i] for i in positions]
            mini_units = loss_units(cfg.loss_agg, [units[key] for key in mini_keys])
            local = [mine[key] for key in mini_keys if key in mine]
            groups = plan_micro_batches([item.sample.length for item in local], cfg.micro_batch_tokens)
            n_micro = max_over_processes(accelerator, len(groups))
            step_totals: dict[str, float] = {}
            for k in range(n_micro):
                real = k < len(groups)
                micro = [local[g] for g in groups[k]] if real else [filler]
                samples = [item.sample for item in micro]
                lengths = [len(s.response_ids) for s in samples]
                weight = micro_batch_weight(cfg.loss_agg, lengths, mini_units) if real else 0.0
                # gradients are synchronised once per mini-batch, on its last micro-batch
                sync = contextlib.nullcontext() if k == n_micro - 1 else accelerator.no_sync(model)
                with sync:
                    with accelerator.autocast():
                        logits, tokens = response_logits(model, samples, pad_id, device)
                    logp = sequence_log_probs(logits, tokens, cfg.temperature)
                    width = logp.shape[1]
                    mask = response_mask(lengths, width).to(device)
                    old = right_aligned([item.old_logp.tolist() for item in micro], width).to(device)
                    advantages = torch.tensor([item.advantage for item in micro], dtype=logp.dtype, device=device)
                    loss, loss_stats = algos.ppo_clip_policy_loss(logp, old, advantages, mask, cfg.eps_low,
                                                                  cfg.eps_high, cfg.dual_clip, cfg.loss_agg)
                    accelerator.backward(loss * weight * world)
                for name, value in {"loss": loss.item(), **loss_stats}.items():
                    step_totals[name] = step_totals.get(name, 0.0) + value * weight
                if epoch == 0 and real:
                    with torch.no_grad():
                        token_entropy = algos.entropy_from_logits(logits.detach().float() / cfg.temperature)
                        entropy["sum"] += float((token_entropy * mask).sum())
                        entropy["tokens"] += float(mask.sum())
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_totals = summed_over_processes(accelerator, step_totals)
            for name, value in {**step_totals, "grad_norm": float(grad_norm)}.items():
                stats.setdefault(name, []).append(value)
            bar.update(1)
    bar.close()
    out = {name: float(np.mean(values)) for name, values in stats.items()}
    out.update(optimizer_steps=float(len(stats.get("loss", []))), trained_rows=float(len(keys)))
    if keys:
        entropy = summed_over_processes(accelerator, entropy)
        out["entropy"] = entropy["sum"] / max(1.0, entropy["tokens"])
    return out


# --------------------------------------------------------------------------- metrics of a step


def rollout_metrics(rows: Sequence[dict[str, Any]], max_turns: int) -> dict[str, float]:
    """Reward statistics, hacking ratio and Fast@p of the rollouts (Fast@p at the last turn and best-of-history)."""
    rewards = np.array([float(row["reward"]) for row in rows])
    values = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
              "correct_frac": kmetrics.correct_rate([r["correct"] for r in rows], [r["hacked"] for r in rows]),
              "turns_mean": float(np.mean([r["turn"] for r in rows]))}
    evaluated = [r["hacked"] for r in rows if r["status"] not in NOT_EVALUATED]
    if evaluated:  # Appendix C: the share of evaluated kernels flagged as hacks
        values["hacking_ratio"] = kmetrics.hacking_ratio(evaluated)
    for turn in range(1, max_turns + 1):
        at_turn = rewards[[row["turn"] == turn for row in rows]]
        if len(at_turn):
            values[f"reward_mean_turn{turn}"] = float(at_turn.mean())
    frame = [{k: row[k] for k in ("task_id", "sample", "turn", "correct", "hacked", "speedup_eager")} for row in rows]
    by_turn = kmetrics.fast_p_by_turn(pd.DataFrame(frame), FAST_PS)
    history = kmetrics.fast_p_by_turn(pd.DataFrame(frame), FAST_PS, history=True)
    for p in FAST_PS:
        values[f"fast@{p:g}"] = float(by_turn[f"fast@{p:g}"].iloc[-1])
        values[f"fast@{p:g}_best_of_history"] = float(history[f"fast@{p:g}"].iloc[-1])
    return values


def token_totals(train_logp: Sequence[torch.Tensor],
                 rollout_logp: Sequence[Sequence[float]]) -> dict[str, tuple[float, float]]:
    """(sum, count) behind the rollout-engine and trainer perplexities over the same tokens (Figure 7:
    exp of the mean negative log-prob, `{engine}_nll`) and the mean response length, of rows with tokens."""
    tokens = float(sum(len(x) for x in train_logp))
    return {"train_nll": (-sum(float(x.double().sum()) for x in train_logp), tokens),
            "rollout_nll": (-math.fsum(math.fsum(x) for x in rollout_logp), tokens),
            "response_tokens_mean": (tokens, float(len(train_logp)))}


# --------------------------------------------------------------------------- model, engines, evaluators


def load_policy(model_dir: Path, cfg: RLConfig) -> tuple[Any, Any]:
    """The policy in fp32 (master weights; bf16 autocast on GPU) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def gym_protocol(cfg: RLConfig, base: Mapping[str, Any] | None) -> Any:
    """The KernelGym protocol of the run: the `gym` section plus what the RL settings imply
    (no hack checks for the "w/o hacking check" ablation; profiling whenever PR is used), and
    only the eager baseline: every reward uses the eager speedup, and timing the reference under
    torch.compile would triple the cost of each rollout's evaluation."""
    from kpipe.gym import Protocol

    values = {**dict(base or {}), "baseline": "eager"}
    if not cfg.hacking_check:
        values.update(hacking_check=False, ghost_replay=False)
    if cfg.use_pr or cfg.prs:
        values["profile"] = True
    return Protocol.from_dict(values)


def copy_full_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy the trainer's weights into the rollout copy, one tensor at a time. FSDP2-sharded
    tensors are all-gathered first (every process must call this), so the peak memory is one
    full tensor beyond the copy."""
    from torch.distributed.tensor import DTensor

    target_state = target.state_dict()
    with torch.no_grad():
        for name, value in source.state_dict().items():
            target_state[name].copy_(value.full_tensor() if isinstance(value, DTensor) else value)


def _load_weights_on_vllm_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    # get_model(): the bare model under a CUDA-graph wrapper, in both the V1 and V2 model runners
    worker.model_runner.get_model().load_weights(weights=weights)


def push_weights_to_vllm(engine: Any, model: Any) -> None:
    """Copy the trainer's weights into an in-process vLLM engine (vLLM 0.33, V1 engine; read in its
    source, not run: tests/test_vllm_api.py).

    Needs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before the
    engine is built), so `collective_rpc` calls the function on the worker object directly and
    the tensors are handed over without serialisation; `load_weights` takes HF parameter names.
    The prefix cache holds KV of the old weights, so it is reset.
    """
    weights = [(name, tensor.detach()) for name, tensor in model.state_dict().items()]
    engine.llm.collective_rpc(_load_weights_on_vllm_worker, args=(weights,))
    engine.llm.reset_prefix_cache()


def make_engine(cfg: RLConfig, model: Any, tokenizer: Any, model_dir: Path, name: str, progress: bool) -> Any:
    """The rollout engine: HF generate on the live policy, or an in-process vLLM engine."""
    if cfg.engine == "hf":
        from kpipe.llm.hf_engine import HFEngine

        return HFEngine(model, tokenizer, name=name, batch_size=cfg.generation_batch_size, seed=cfg.seed,
                        progress=progress)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kpipe.llm.vllm_engine import VLLMEngine

    return VLLMEngine(str(model_dir), name=name, seed=cfg.seed, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                      logprobs_mode="processed_logprobs", max_model_len=cfg.max_context_tokens)


# --------------------------------------------------------------------------- one step, one iteration


def annotate_rows(rows: list[dict[str, Any]], returns: torch.Tensor, advantages: torch.Tensor,
                  reasons: Sequence[str | None]) -> None:
    """Fill the training columns of the `trajectories` rows in place."""
    for row, ret, adv, reason in zip(rows, returns.tolist(), advantages.tolist(), reasons, strict=True):
        row.update(return_to_go=ret, advantage=adv, kept=reason is None, rejected_by=reason)


def train_on_rollouts(rows: list[dict[str, Any]], cfg: RLConfig, accelerator: Any, model: Any, optimizer: Any,
                      tokenizer: Any, filter_generator: torch.Generator, shuffle_generator: torch.Generator,
                      progress: bool) -> dict[str, float]:
    """Steps 2–5 of the module docstring on this process's rollouts; annotates `rows` and returns the
    step's metrics over every process's rows. `filter_generator` draws PRS's coin flips,
    `shuffle_generator` the mini-batches (the same state on every process)."""
    samples = token_samples(rows, tokenizer)
    has_tokens = torch.tensor([bool(s.response_ids) for s in samples], dtype=torch.bool)
    pad_id = tokenizer.pad_token_id
    model.eval()
    with accelerator.autocast():  # the same precision as the update: PPO's ratio starts at 1
        train_logp = policy_log_probs(model, samples, cfg.temperature, cfg.micro_batch_tokens, pad_id,
                                      accelerator.device, progress, partial(max_over_processes, accelerator))
    model.train()
    rollout_logp = [list(row.get("response_logprobs") or []) for row in rows]
    for row, sample, logp in zip(rows, samples, rollout_logp, strict=True):
        if len(logp) != len(sample.response_ids):
            raise ValueError(f"{row['task_id']} sample {row['sample']} turn {row['turn']}: "
                             f"{len(logp)} rollout log-probs for {len(sample.response_ids)} tokens")
    mrs_keep, log_w = mismatch_keep(train_logp, rollout_logp, cfg)
    returns = row_returns(rows, cfg)
    masks = buffer_masks(rows, returns, cfg) | filter_masks(rows, cfg, mrs_keep, filter_generator)
    reasons = rejection_reasons(has_tokens, masks)
    kept = torch.tensor([reason is None for reason in reasons])
    valid = has_tokens if cfg.baseline_includes_rejected else kept
    advantages = row_advantages(rows, buffer_values(rows, returns, masks, cfg), valid, cfg)
    annotate_rows(rows, returns, advantages, reasons)

    items = [TrainItem(row_key(rows[i]), samples[i], float(advantages[i]), train_logp[i])
             for i in range(len(rows)) if kept[i]]
    values = update_policy(accelerator, model, optimizer, items, cfg, pad_id, shuffle_generator, progress)
    with_tokens = float(has_tokens.sum())
    totals = {f"kept_frac_{name}": (float((mask & has_tokens).sum()), with_tokens) for name, mask in masks.items()}
    totals.update(kept_frac=(float(kept.sum()), len(rows)), return_mean=(float(returns.sum()), len(rows)),
                  advantage_abs_mean=(float(advantages[kept].abs().sum()), float(kept.sum())),
                  mismatch_abs_log_w=(float(log_w[has_tokens].abs().sum()), with_tokens))
    totals.update(token_totals([train_logp[i] for i in range(len(rows)) if has_tokens[i]],
                               [rollout_logp[i] for i in range(len(rows)) if has_tokens[i]]))
    means = global_means(accelerator, totals)
    values.update({name: means.get(name, 0.0) for name in totals if not name.endswith("_nll")})
    values.update({f"{engine}_ppl": algos.perplexity(means[f"{engine}_nll"]) for engine in ("rollout", "train")
                   if f"{engine}_nll" in means})
    return values


def rollout_rows(tasks: Sequence[AgentTask], engine: Any, evaluator: Any, cfg: RLConfig, *, run: str, iteration: int,
                 global_step: int, progress: bool) -> list[dict[str, Any]]:
    """The rollouts of one step: n episodes per prompt through the shared multi-turn loop."""
    sampling = Sampling(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, logprobs=True)
    return run_episodes(
        tasks, engine, evaluator, make_policy(cfg.history, cfg.history_window), n_samples=cfg.rollouts_per_prompt,
        max_turns=cfg.max_turns, sampling=sampling,
        reward_fn=algos.turn_reward(cfg.reward, cfg.use_pr, cfg.baseline, cfg.speedup_cap),
        run=run, stage=STAGE, iteration=iteration, seed=step_seed(cfg.seed, global_step),
        max_context_tokens=cfg.max_context_tokens, progress=progress,
    )


def run_iteration(
    cfg: RLConfig,
    tasks: Sequence[AgentTask],
    init_model: str | os.PathLike,
    model_out: str | os.PathLike,
    trajectories_path: str | os.PathLike,
    metrics_path: str | os.PathLike,
    scratch: str | os.PathLike,
    *,
    run: str,
    iteration: int,
    init_state: str | os.PathLike | None = None,
    state_out: str | os.PathLike | None = None,
    gym: Mapping[str, Any] | None = None,
    evaluator: Evaluator | None = None,
    progress: bool = True,
) -> IterationResult:
    """RL iteration `iteration` of `run`, starting from the HF model `init_model`.

    `init_model` is the previous iteration's model (iteration 0: the SFT model); `init_state`
    the previous iteration's optimizer state, so Adam's moments carry over (missing: a fresh
    optimizer, with a warning after iteration 0). Writes the HF model to `model_out`, the
    optimizer state to `state_out`, the rollouts to `trajectories_path` and the step metrics
    to `metrics_path`. `gym` is the `gym` config section (backend, workers, cache, protocol);
    `evaluator` replaces the backend it names (tests, an evaluator shared across iterations).
    """
    from accelerate import Accelerator

    from kpipe.agent.evaluator import open_evaluator

    if not tasks:
        raise ValueError("RL needs at least one training task")
    gym = dict(gym or {})
    protocol = gym_protocol(cfg, gym.get("protocol"))
    gym["protocol"] = protocol.to_dict()
    init_state = Path(init_state) if init_state is not None and Path(init_state).is_dir() else None
    if init_state is None and iteration > 0:
        log.warning("RL iteration %d of %s starts with a fresh optimizer: no state from iteration %d",
                    iteration, run, iteration - 1)
    identity = directory_identity(init_model) + directory_identity(init_state)
    fingerprint = iteration_fingerprint(cfg, run, iteration, identity, tasks, protocol.to_json())
    accelerator = Accelerator(mixed_precision=resolve_precision(cfg.mixed_precision))
    check_processes(cfg, min(cfg.prompts_per_step, len(tasks)), accelerator.num_processes)
    trainer = IterationTrainer(accelerator, cfg, Path(init_model), init_state, Path(scratch), fingerprint, run,
                               iteration, progress)
    with contextlib.ExitStack() as stack:
        if evaluator is None:
            # one reference run per task saves minutes on a CPU; on a GPU each candidate is timed next to it
            reuse = not torch.cuda.is_available()
            evaluator = stack.enter_context(open_evaluator(gym, reuse_reference=reuse, progress=trainer.progress,
                                                           gpus=trainer.evaluation_gpus()))
        cached = CachedEvaluator(evaluator, trainer.scratch / f"evals-{trainer.accelerator.process_index}.jsonl",
                                 protocol.to_json())
        resumed_steps = trainer.start_step
        for step in range(trainer.start_step, cfg.steps_per_iteration):
            trainer.step(step, tasks, cached)
    return trainer.finish(Path(model_out), state_out, trajectories_path, metrics_path, resumed_steps)


class IterationTrainer:
    """The state of one iteration in one process: accelerator, policy, optimizer, rollout engine and
    metrics log. With several processes, rollouts run on `rollout_model`, a full-weight copy of the
    policy refreshed before every step: generation through the sharded policy would need every
    process to run the same number of forward passes, which the processes' episodes do not."""

    def __init__(self, accelerator: Any, cfg: RLConfig, init_model: Path, init_state: Path | None, scratch: Path,
                 fingerprint: str, run: str, iteration: int, progress: bool) -> None:
        from accelerate.utils import set_seed

        self.accelerator, processes = accelerator, accelerator.num_processes
        self.cfg, self.scratch, self.fingerprint = cfg, scratch, fingerprint
        self.run, self.iteration = run, iteration
        self.progress = progress and self.accelerator.is_main_process
        with self.accelerator.main_process_first():  # rank 0 clears a stale scratch before the others look
            resumed = prepare_scratch(scratch, fingerprint)
        set_seed(cfg.seed + iteration)
        model, self.tokenizer = load_policy(init_model, cfg)
        # bf16 under bf16 autocast (what vLLM would sample from too): half the memory of an fp32 copy,
        # and no autocast cache of its casts held through the rollouts
        rollout_dtype = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else torch.float32
        self.rollout_model = (copy.deepcopy(model).to(self.accelerator.device, dtype=rollout_dtype).eval()
                              if processes > 1 else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                      fused=torch.cuda.is_available())
        # together: FSDP2 rebuilds the parameters, and the optimizer must hold the new ones
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        checkpoint = latest_checkpoint(scratch / "checkpoints")
        self.start_step = checkpoint.step if checkpoint is not None else 0
        if checkpoint is not None:
            self.accelerator.load_state(str(checkpoint.state_dir))
        elif init_state is not None:
            self.accelerator.load_state(str(init_state))
        self.metrics = MetricsLog(scratch / "metrics.parquet", run=run, stage=STAGE, iteration=iteration)
        self.metrics.resume(iteration * cfg.steps_per_iteration + self.start_step)
        if self.accelerator.is_main_process:
            log.info("RL %s iteration %d on %d process(es) (%s)", run, iteration, processes,
                     self.accelerator.distributed_type)
            if resumed:
                log.info("resuming RL iteration %d of %s at step %d (scratch %s)", iteration, run, self.start_step,
                         scratch)
        policy = self.rollout_model if self.rollout_model is not None else self.accelerator.unwrap_model(self.model)
        # the engine in the rows' model label: figures name where rollouts came from (views.sql provenance)
        self.raw_engine = make_engine(cfg, policy, self.tokenizer, init_model,
                                      f"{run}/rl-iter{iteration}/{cfg.engine}", self.progress)
        self.engine = TimedEngine(self.raw_engine)
        self.filter_generator, self.shuffle_generator = torch.Generator(), torch.Generator()

    def evaluation_gpus(self) -> list[str] | None:
        """With several processes on GPUs each process evaluates on its own GPU; None: the
        evaluator's default (every visible GPU, or CPU workers)."""
        from kpipe.infra.gpu import visible_gpus

        gpus = visible_gpus()
        if self.accelerator.num_processes == 1 or not gpus:
            return None
        return [gpus[self.accelerator.local_process_index]]

    def step(self, step: int, tasks: Sequence[AgentTask], evaluator: Evaluator) -> dict[str, float]:
        """This process's rollouts (or their saved copy), training on them, metrics; a checkpoint
        unless it is the last step."""
        cfg, accelerator = self.cfg, self.accelerator
        global_step = self.iteration * cfg.steps_per_iteration + step
        if self.rollout_model is not None:
            copy_full_weights(accelerator.unwrap_model(self.model), self.rollout_model)
        if cfg.engine == "vllm" and step > 0:
            push_weights_to_vllm(self.raw_engine, accelerator.unwrap_model(self.model))
        timed = TimedEvaluator(evaluator)
        self.engine.seconds = 0.0
        started = time.perf_counter()
        my_tasks = process_tasks(step_tasks(tasks, cfg.prompts_per_step, cfg.seed, global_step),
                                 accelerator.process_index, accelerator.num_processes)
        rollouts_path = self.scratch / f"rollouts-{step:04d}.parquet"
        if rollouts_path.exists():
            mine = {task.task_id for task in my_tasks}
            rows = [row for row in read_table(rollouts_path, "trajectories").to_pylist() if row["task_id"] in mine]
        else:
            self.model.eval()
            with accelerator.autocast():  # HF rollouts in the trainer's precision: less mismatch for MRS
                rows = rollout_rows(my_tasks, self.engine, timed, cfg, run=self.run, iteration=self.iteration,
                                    global_step=global_step, progress=self.progress)
            all_rows = gather_object(rows)
            if accelerator.is_main_process:
                write_table(all_rows, rollouts_path, "trajectories")
        rollout_s = time.perf_counter() - started
        # PRS's coin flips: a stream per process (rank 0's is the one-process stream); mini-batches: one for all
        self.filter_generator.manual_seed(step_seed(cfg.seed + 1, global_step) + accelerator.process_index)
        self.shuffle_generator.manual_seed(step_seed(cfg.seed + 2, global_step))
        values = train_on_rollouts(rows, cfg, accelerator, self.model, self.optimizer, self.tokenizer,
                                   self.filter_generator, self.shuffle_generator, self.progress)
        if torch.cuda.is_available():
            # hand the update's cached blocks back: the next rollouts' evaluation children share this GPU
            torch.cuda.empty_cache()
        all_rows = gather_object(rows)
        values.update(rollout_metrics(all_rows, cfg.max_turns))
        # times are this process's (the step ends in collectives, so step_s is everyone's)
        values.update(gen_s=self.engine.seconds, eval_s=timed.seconds, rollout_s=rollout_s,
                      train_s=time.perf_counter() - started - rollout_s, step_s=time.perf_counter() - started,
                      lr=cfg.lr, rows=float(len(all_rows)))
        self.metrics.log(global_step + 1, values)
        if accelerator.is_main_process:
            write_table(all_rows, self.scratch / f"step-{step:04d}.parquet", "trajectories")
            log.info("RL %s iteration %d step %d: reward %.3f, kept %.2f, grad norm %.3g", self.run, self.iteration,
                     step, values["reward_mean"], values["kept_frac"], values.get("grad_norm", 0.0))
        if step + 1 < cfg.steps_per_iteration:
            if accelerator.is_main_process:
                self.metrics.flush()
            save_checkpoint(accelerator, self.model, self.tokenizer, self.scratch / "checkpoints", step + 1,
                            self.fingerprint, keep_last=1)
        return values

    def finish(self, model_out: Path, state_out: str | os.PathLike | None, trajectories_path: str | os.PathLike,
               metrics_path: str | os.PathLike, resumed_steps: int) -> IterationResult:
        """Write the iteration's outputs (each atomically, the model and state via a rename; files by
        rank 0), drop the scratch."""
        accelerator = self.accelerator
        replace_dir(accelerator, model_out, lambda tmp: export_hf(accelerator, self.model, self.tokenizer, tmp))
        if state_out is not None:
            replace_dir(accelerator, Path(state_out), lambda tmp: accelerator.save_state(str(tmp)))
        rows = []
        for step in range(self.cfg.steps_per_iteration):
            rows.extend(read_table(self.scratch / f"step-{step:04d}.parquet", "trajectories").to_pylist())
        accelerator.wait_for_everyone()  # everyone has read the scratch
        if accelerator.is_main_process:
            write_table(rows, trajectories_path, "trajectories")
            write_table(self.metrics.rows, metrics_path, "train_metrics")
            shutil.rmtree(self.scratch, ignore_errors=True)
        accelerator.wait_for_everyone()
        mean_reward = float(np.mean([row["reward"] for row in rows])) if rows else math.nan
        return IterationResult(model_out, self.cfg.steps_per_iteration, resumed_steps, len(rows), mean_reward)


def replace_dir(accelerator: Any, target: Path, write: Callable[[Path], Any]) -> Path:
    """Write a directory next to `target` with `write(tmp)` (every process calls it: sharded
    states are written by all) and let rank 0 rename it into place."""
    tmp = target.parent / f".tmp-{target.name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    write(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    accelerator.wait_for_everyone()
    return target


def training_tasks(queries_path: str | os.PathLike, max_prompts: int | None = None) -> list[AgentTask]:
    """RL prompts: the non-contaminated training queries, ordered by id (the first `max_prompts`)."""
    rows = [r for r in read_table(queries_path, "queries").to_pylist() if not r["contaminated"]]
    rows.sort(key=lambda r: r["query_id"])
    return [AgentTask(r["query_id"], r["reference_src"]) for r in rows[:max_prompts]]


def drop_optimizer_state(path: str | os.PathLike) -> None:
    """Delete an iteration's optimizer state once the next iteration has its own (Adam's
    moments are twice the model in fp32: one per iteration would fill any disk)."""
    shutil.rmtree(path, ignore_errors=True)
