"""The policy side of an RL step: π_train's log-probs of the sampled tokens (left padding, the
rollout's exact prompt render) and the update, `update_policy(batch, model, optimizer, ...)`: PPO-clip
optimizer steps over micro-batches whose losses are weighted so that accumulation over micro-batches
and processes gives the one-big-batch gradient. Another optimizer or log-prob implementation plugs in
here: the loop (`kpipe.train.rl`) calls `policy_log_probs` and `update_policy` and nothing else of it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from kpipe.train import algos
from kpipe.train.batching import max_over_processes, plan_micro_batches
from kpipe.train.trainer_memory import effective_chunk_tokens, model_token_logprobs_and_entropy
from kpipe.train.rl_batch import StepBatch, TokenSample, TrainItem, response_mask, right_aligned
from kpipe.train.rl_config import RLConfig


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


def response_log_probs(model: Any, samples: Sequence[TokenSample], pad_id: int, device: torch.device,
                       temperature: float, chunk_tokens: int = 0,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(token) of each response token under the sampling distribution softmax(logits / T), as the
    rollout engine recorded it, and (`with_entropy`) the entropy of each token's distribution, without a
    gradient: [batch, R] each, right-aligned, R the longest response.

    `chunk_tokens` 0: the model's own logits of the last R+1 positions only (vocabularies are big);
    N: the decoder's hidden states through the LM head in chunks of N tokens
    (`kpipe.train.trainer_memory`: no [tokens, vocab] tensor, the entropy comes free). Under FSDP2 the
    model's own logits always (`effective_chunk_tokens`)."""
    width = max(len(s.response_ids) for s in samples)
    batch = {k: v.to(device) for k, v in left_padded(samples, pad_id).items()}
    tokens = batch["input_ids"][:, -width:]
    if chunk_tokens:
        logp, entropy = model_token_logprobs_and_entropy(model, batch, slice(-(width + 1), -1), tokens, chunk_tokens,
                                                         temperature)
        return logp, entropy.detach() if with_entropy else None
    logits = model(**batch, logits_to_keep=width + 1, use_cache=False).logits[:, :-1, :]
    logp = algos.log_probs_from_logits(logits.float() / temperature, tokens)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        return logp, algos.entropy_from_logits(logits.detach().float() / temperature)


def filler_sample(pad_id: int) -> TokenSample:
    """A one-token sample for the forward passes a process runs only to keep pace with the others."""
    return TokenSample([pad_id], [pad_id])


@torch.no_grad()
def policy_log_probs(model: Any, samples: Sequence[TokenSample], temperature: float, token_budget: int,
                     pad_id: int, device: torch.device, progress: bool = False,
                     pass_count: Callable[[int], int] | None = None, chunk_tokens: int = 0) -> list[torch.Tensor]:
    """π_train log-probs of every sample's response tokens (1-D CPU tensors), in micro-batches
    (`chunk_tokens`: as `response_log_probs`).

    `pass_count(n)` turns this process's n forward passes into the number to run: a sharded model
    needs every process to run as many as the busiest (`max_over_processes`); the extra passes
    run on a filler and are discarded.
    """
    out: list[torch.Tensor] = [torch.zeros(0)] * len(samples)
    todo = [i for i, s in enumerate(samples) if s.response_ids]
    groups = plan_micro_batches([samples[i].length for i in todo], token_budget)
    passes = pass_count(len(groups)) if pass_count is not None else len(groups)
    chunk_tokens = effective_chunk_tokens(model, chunk_tokens)
    for k in tqdm(range(passes), desc="π_train log-probs", disable=not progress, leave=False):
        if k >= len(groups):
            response_log_probs(model, [filler_sample(pad_id)], pad_id, device, temperature, chunk_tokens)
            continue
        group = groups[k]
        batch = [samples[todo[g]] for g in group]
        logp = response_log_probs(model, batch, pad_id, device, temperature, chunk_tokens)[0].cpu()
        for g, sample, row_logp in zip(group, batch, logp, strict=True):
            out[todo[g]] = row_logp[logp.shape[1] - len(sample.response_ids):]
    return out


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


def update_policy(batch: StepBatch, model: Any, optimizer: Any, accelerator: Any, cfg: RLConfig,
                  generator: torch.Generator, progress: bool = False) -> dict[str, float]:
    """The update phase: optimizer steps on the batch's kept rows (`ppo_clip_steps`); returns its metrics."""
    return ppo_clip_steps(accelerator, model, optimizer, batch.train_items(), cfg, batch.pad_id, generator, progress)


def ppo_clip_steps(accelerator: Any, model: Any, optimizer: Any, items: Sequence[TrainItem], cfg: RLConfig,
                   pad_id: int, generator: torch.Generator, progress: bool = False) -> dict[str, float]:
    """PPO-clip optimizer steps on this process's `items`: `ppo_epochs` passes over `mini_batches`
    mini-batches each, the same steps one process would take on every process's items.

    Mini-batches are drawn from all processes' items, ordered by key and shuffled with `generator`
    (in the same state on every process), so they do not depend on which process holds a row.
    Each micro-batch's loss is weighted by its share of its global mini-batch and multiplied by
    the process count, since DDP/FSDP average gradients over processes. Every process runs as many
    forward passes as the busiest; its extra ones run on a filler with weight 0.

    A step whose gradient norm is not finite is not taken (``skipped_steps``; its grad_norm, NaN, is in the
    mean). Returns the means over optimizer steps of loss, grad_norm, clip fractions, approx KL (and the KL to the
    reference policy with `kl_coef`), the
    token-mean entropy of the policy on the trained tokens during the first epoch, and the number
    of trained rows and their tokens, context and answer (all over every process: what the update's passes read).
    """
    device, world = accelerator.device, accelerator.num_processes
    gathered = gather_object([(item.key, len(item.sample.response_ids), item.sample.length) for item in items])
    units = {key: response for key, response, _ in gathered}
    keys, mine = sorted(units), {item.key: item for item in items}
    filler = TrainItem(("", -1, -1), filler_sample(pad_id), 0.0, torch.zeros(1), torch.zeros(1))
    stats: dict[str, list[float]] = {}
    skipped, optimizer_s = 0, 0.0
    entropy = {"sum": 0.0, "tokens": 0.0}
    chunk_tokens = effective_chunk_tokens(model, cfg.logprob_chunk_tokens)
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
                        logp, token_entropy = response_log_probs(model, samples, pad_id, device, cfg.temperature,
                                                                 chunk_tokens, with_entropy=epoch == 0 and real)
                    width = logp.shape[1]
                    mask = response_mask(lengths, width).to(device)
                    old = right_aligned([item.old_logp.tolist() for item in micro], width).to(device)
                    advantages = torch.tensor([item.advantage for item in micro], dtype=logp.dtype, device=device)
                    loss, loss_stats = algos.ppo_clip_policy_loss(logp, old, advantages, mask, cfg.eps_low,
                                                                  cfg.eps_high, cfg.dual_clip, cfg.loss_agg)
                    if cfg.kl_coef > 0:
                        ref = right_aligned([item.ref_logp.tolist() for item in micro], width).to(device)
                        kl = algos.kl_loss(logp, ref, mask, cfg.kl_estimator, cfg.loss_agg)
                        loss = loss + cfg.kl_coef * kl
                        loss_stats["kl"] = kl.item()
                    accelerator.backward(loss * weight * world)
                for name, value in {"loss": loss.item(), **loss_stats}.items():
                    step_totals[name] = step_totals.get(name, 0.0) + value * weight
                if token_entropy is not None:
                    entropy["sum"] += float((token_entropy * mask).sum())
                    entropy["tokens"] += float(mask.sum())
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
            if math.isfinite(float(grad_norm)):  # the global norm: every process decides alike
                started = time.perf_counter()  # the step's own phase (issue 63): an offloaded AdamW streams its state
                optimizer.step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                optimizer_s += time.perf_counter() - started
            else:  # a NaN/inf gradient would make every weight NaN (seen once on an H200, bf16): drop the step
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            step_totals = summed_over_processes(accelerator, step_totals)
            for name, value in {**step_totals, "grad_norm": float(grad_norm)}.items():
                stats.setdefault(name, []).append(value)
            bar.update(1)
    bar.close()
    out = {name: float(np.mean(values)) for name, values in stats.items()}
    out.update(optimizer_steps=float(len(stats.get("loss", [])) - skipped), skipped_steps=float(skipped),
               optimizer_s=optimizer_s,
               trained_rows=float(len(keys)), trained_row_tokens=float(sum(length for _, _, length in gathered)))
    if keys:
        entropy = summed_over_processes(accelerator, entropy)
        out["entropy"] = entropy["sum"] / max(1.0, entropy["tokens"])
    return out


def token_totals(train_logp: Sequence[torch.Tensor],
                 rollout_logp: Sequence[Sequence[float]]) -> dict[str, tuple[float, float]]:
    """(sum, count) behind the rollout-engine and trainer perplexities over the same tokens (Figure 7:
    exp of the mean negative log-prob, `{engine}_nll`) and the mean response length, of rows with tokens."""
    tokens = float(sum(len(x) for x in train_logp))
    return {"train_nll": (-sum(float(x.double().sum()) for x in train_logp), tokens),
            "rollout_nll": (-math.fsum(math.fsum(x) for x in rollout_logp), tokens),
            "response_tokens_mean": (tokens, float(len(train_logp)))}

