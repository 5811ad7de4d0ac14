"""Supervised fine-tuning on cold-start trajectories, readable top to bottom.

One optimizer step = one global batch of `batch_size` samples. Which samples form the batch
of step `s` is a pure function of (seed, s), so a resumed run sees exactly the data an
uninterrupted one would. Each process takes a share of the batch and runs it as
length-grouped, padded micro-batches of at most `micro_batch_tokens` padded tokens; the loss
is the sum of token losses divided by the number of labelled tokens in the whole global
batch, so gradient accumulation and any number of processes give the same gradient as one
big batch (token-mean, not mean-of-micro-batch-means).

Runs on the CPU (fp32), one GPU (bf16 autocast over fp32 master weights) or many GPUs with
FSDP/DDP when started through ``accelerate launch --config_file ...``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kpipe.infra.jobs import launched, since_job_started
from kpipe.infra.provenance import SFT_CODE, code_version, hub_weights_identity, library_versions, restart_key
from kpipe.train.checkpoint import (
    export_hf,
    latest_checkpoint,
    load_training_state,
    remove_checkpoints,
    save_checkpoint,
)
from kpipe.train.batching import (
    PRECISIONS,
    accepted_types,
    batch_indices,
    max_over_processes,
    plan_micro_batches,
    resolve_precision,
    steps_per_epoch,
)
from kpipe.train.trainer_memory import effective_chunk_tokens, model_token_logprobs_and_entropy
from kpipe.train.metrics_log import MetricsLog
from kpipe.train.trainer_memory import (
    OPTIMIZER_OFFLOADS,
    prepare_model_and_optimizer,
    read_offload_setting,
    resolve_memory_plan,
    trainer_gpu_bytes,
    weights_dtype,
)
from kpipe.train.samples import IGNORE_INDEX, OUTCOME_FILTERS, OVERLONG, UNITS, Sample, SampleReport, build_samples

log = logging.getLogger(__name__)

SCHEDULES = ("cosine", "constant")


@dataclass
class SFTConfig:
    """SFT hyper-parameters; `PRESETS` holds the paper's, the released code's and the offline default."""

    base_model: str = ""  # hub id or local path of a causal LM
    run: str = "sft"
    epochs: float = 4.0
    max_steps: int | None = None  # cap on optimizer steps; None = as many as `epochs` take
    lr: float = 1e-6
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of `lr`
    schedule: str = "cosine"
    warmup_ratio: float = 0.1  # fraction of all steps spent warming up linearly
    batch_size: int = 256  # samples per optimizer step, over all processes
    micro_batch_tokens: int = 16384  # padded tokens per forward pass per process
    max_length: int = 32768
    overlong: str = "drop"  # drop | truncate
    keep: str = "all"  # outcome filter: all | passed_turns | passed_trajectories
    unit: str = "turn"  # turn | trajectory (see kpipe.train.samples)
    max_turn: int | None = None  # train on turns 1..max_turn only; None = every turn
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still logged)
    seed: int = 0
    gradient_checkpointing: bool = False
    mixed_precision: str = "auto"  # auto = bf16 on GPU, fp32 on CPU (or the accelerate config's)
    attn_implementation: str = "sdpa"
    compile: bool = False  # torch.compile the repeated decoder blocks (regional compilation)
    chat_template: str | None = None  # "chatml": impose ChatML on a base tokenizer that has no template
    # the 8B on one GPU (issue 63, docs/training.md): the loss's log-probs through the LM head in chunks of this many
    # tokens, no [tokens, vocab] logits (0: the model's own logits; FSDP2 always uses those); where AdamW's
    # state lives: off | auto | fp32 | bf16 (kpipe.train.trainer_memory)
    logprob_chunk_tokens: int = 0
    optimizer_offload: str = "off"
    save_every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    keep_last: int = 2
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        for item in fields(self):
            value, expected = getattr(self, item.name), accepted_types(item.type)
            if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
                raise ValueError(f"SFTConfig: {item.name} must be {item.type}, got {value!r}")
        checks = [
            (self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}"),
            (self.mixed_precision in PRECISIONS, f"mixed_precision must be one of {PRECISIONS}"),
            (self.overlong in OVERLONG, f"overlong must be one of {OVERLONG}"),
            (self.keep in OUTCOME_FILTERS, f"keep must be one of {OUTCOME_FILTERS}"),
            (self.unit in UNITS, f"unit must be one of {UNITS}"),
            (self.chat_template in (None, "chatml"), "chat_template must be null or 'chatml'"),
            (self.batch_size >= 1 and self.micro_batch_tokens >= 1, "batch_size and micro_batch_tokens must be >= 1"),
            (self.epochs > 0 and self.lr > 0, "epochs and lr must be positive"),
            (0 <= self.warmup_ratio < 1 and 0 <= self.min_lr_ratio <= 1, "warmup_ratio in [0, 1), min_lr_ratio in [0, 1]"),
            (self.keep_last >= 1, "keep_last must be >= 1"),
            (self.optimizer_offload in OPTIMIZER_OFFLOADS, f"optimizer_offload must be one of {OPTIMIZER_OFFLOADS}"),
            (self.logprob_chunk_tokens >= 0, "logprob_chunk_tokens must be >= 0 (0: the model's own logits)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SFTConfig: {message}")

    @classmethod
    def from_dict(cls, values: dict[str, Any], preset: str | None = None) -> SFTConfig:
        """A config from a preset overridden by `values`; unknown keys are an error.

        The preset comes from the `preset` argument or a ``preset`` key in `values` (as in config YAML).
        """
        values = read_offload_setting(dict(values))  # a bare YAML `off` is false
        preset = values.pop("preset", None) or preset
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"SFTConfig: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        base = PRESETS[preset] if preset else cls()
        known = set(asdict(base))
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"SFTConfig: unknown key(s) {sorted(unknown)}")
        return replace(base, **values)


PRESETS: dict[str, SFTConfig] = {
    # Paper §6.1: Qwen3-8B-Base, lr 1e-6, batch 256, 4 epochs, "8K 5-turn trajectories": a sample is a
    # whole trajectory, loss on its assistant turns (the released code trains so too; the RL sentence
    # "each turn becomes a training sample" is about RL, not SFT).
    # Not stated there, taken from verl's SFT trainer defaults (the authors' stack): AdamW betas
    # (0.9, 0.95), weight decay 0.01, 10% warm-up, cosine to 0, grad clip 1.0. Max length: the
    # paper's 32,768-token context.
    "paper": SFTConfig(base_model="Qwen/Qwen3-8B-Base", lr=1e-6, batch_size=256, epochs=4, max_length=32768,
                       unit="trajectory", notes="Dr. Kernel paper §6.1"),
    # Released code (hkust-nlp/KernelGYM recipe on verl): lr 2e-5, batch 64, 4 epochs, max length
    # 18,432, loss on every assistant turn of the whole conversation.
    "code": SFTConfig(base_model="Qwen/Qwen3-8B-Base", lr=2e-5, batch_size=64, epochs=4, max_length=18432,
                      unit="trajectory", notes="released KernelGYM/verl SFT recipe"),
    # Offline default: the tiny local model on a CPU; lr high enough that the loss visibly falls
    # within a few epochs over a handful of trajectories.
    "offline": SFTConfig(lr=1e-3, batch_size=8, epochs=3, max_length=8192, micro_batch_tokens=8192,
                         warmup_ratio=0.1, min_lr_ratio=0.1, save_every=10, notes="tiny model, CPU"),
}


@dataclass
class SFTResult:
    model_dir: Path
    steps: int
    resumed_from: int | None
    samples: SampleReport
    final_loss: float | None


# ---------------------------------------------------------------- pure helpers (tested directly)


def total_steps(cfg: SFTConfig, n_samples: int) -> int:
    """Optimizer steps of the whole run: `epochs` passes (a partial last batch counts), capped by max_steps."""
    steps = math.ceil(cfg.epochs * steps_per_epoch(n_samples, cfg.batch_size))
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then cosine or constant."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def shard_for_process(indices: Sequence[int], lengths: Sequence[int], rank: int, world: int) -> list[int]:
    """This process's share of a global batch: length-sorted round robin, so token loads stay balanced."""
    by_length = sorted(indices, key=lambda i: -lengths[i])
    return by_length[rank::world]


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels tensors of a micro-batch."""
    width = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        labels[row, :n] = torch.tensor(sample.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def predicted_tokens(samples: Sequence[Sample]) -> int:
    """Tokens that carry a loss after the causal shift (a label at position 0 predicts nothing)."""
    return sum(sum(label != IGNORE_INDEX for label in s.labels[1:]) for s in samples)


def sft_restart_key(cfg: SFTConfig, samples: Sequence[Sample]) -> dict[str, str]:
    """What a checkpoint must match to be resumed: the settings, the tokenised data, kpipe's SFT
    code, the base model's weights and the library versions (kpipe.infra.provenance)."""
    resume_irrelevant = {"save_every", "keep_last", "notes"}
    settings = {k: v for k, v in asdict(cfg).items() if k not in resume_irrelevant}
    data = hashlib.sha256()
    for sample in samples:
        data.update(sample.key.encode())
        data.update(np.asarray(sample.input_ids, dtype=np.int64).tobytes())
        data.update(np.asarray(sample.labels, dtype=np.int64).tobytes())
    return restart_key(settings=settings, data=data.hexdigest(), code=code_version(*SFT_CODE),
                       weights=hub_weights_identity(cfg.base_model), libraries=library_versions())


# ---------------------------------------------------------------- model, tokenizer, accelerator


def load_tokenizer(cfg: SFTConfig) -> Any:
    from transformers import AutoTokenizer

    from kpipe.train.tiny_model import CHATML_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    if cfg.chat_template == "chatml":
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(cfg: SFTConfig, dtype: torch.dtype = torch.float32) -> Any:
    """The base model in fp32 (master weights; autocast gives bf16 compute on GPU), or bf16 where the
    memory plan keeps the fp32 master on the host."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=dtype,
                                                 attn_implementation=cfg.attn_implementation)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:
        compile_blocks(model)
    return model


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each repeated decoder block in place; returns how many.

    Regional compilation: the blocks share one compiled graph (seconds, not minutes), the
    top-level HF code stays eager, `dynamic` avoids a recompile per sequence length, and
    in-place ``Module.compile`` keeps the state-dict keys, so checkpoints stay plain HF.
    """
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"compile: no repeated blocks found in {type(model).__name__} (no _no_split_modules)")
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions whose next token carries a label in some row of the micro-batch: the only
    positions whose logits the loss reads."""
    return (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero().squeeze(1)


def micro_batch_loss(model: Any, batch: dict[str, torch.Tensor], global_label_tokens: int,
                     world: int, chunk_tokens: int = 0) -> torch.Tensor:
    """Sum of this micro-batch's token losses over the global batch's labelled tokens: the causal
    LM loss of transformers (next-token cross entropy in fp32, summed, over `global_label_tokens`),
    with logits computed only at ``labelled_positions`` (``logits_to_keep``). The vocabulary
    projection is most of a tiny model's work and much of a big model's memory, and a prompt's
    positions need none.

    `chunk_tokens` N: the same loss from the decoder's hidden states through the LM head in chunks of N
    tokens (`kpipe.train.trainer_memory`), no [tokens, vocab] logits.

    Multiplied by `world` because DDP/FSDP average gradients over processes.
    """
    labels = batch["labels"]
    positions = labelled_positions(labels)
    inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
    targets = labels[:, positions + 1]
    if chunk_tokens:
        labelled = targets != IGNORE_INDEX
        logp, _ = model_token_logprobs_and_entropy(model, inputs, positions, torch.where(labelled, targets, 0),
                                                   chunk_tokens)
        loss = -(logp * labelled).sum()
    else:
        logits = model(**inputs, logits_to_keep=positions, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / global_label_tokens * world


def train_step(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, samples: Sequence[Sample],
               batch_ids: Sequence[int], micro_batch_tokens: int, grad_clip: float, pad_id: int,
               chunk_tokens: int = 0) -> dict[str, float]:
    """One optimizer step on the global batch `batch_ids`; returns its metrics.

    Every process plans the same global batch and takes its share. All processes must run the
    same number of forward passes (FSDP gathers parameters in each one), so a process with fewer
    micro-batches runs extra ones whose loss is multiplied by zero.
    """
    started = time.perf_counter()
    world, rank = accelerator.num_processes, accelerator.process_index
    lengths = [len(s.input_ids) for s in samples]
    global_label_tokens = predicted_tokens([samples[i] for i in batch_ids])
    mine = shard_for_process(batch_ids, lengths, rank, world)
    plan = [[mine[j] for j in group] for group in plan_micro_batches([lengths[i] for i in mine], micro_batch_tokens)]
    n_micro = max_over_processes(accelerator, len(plan))
    filler = plan[-1] if plan else list(batch_ids[:1])
    chunk_tokens = effective_chunk_tokens(model, chunk_tokens)
    loss_sum = torch.zeros((), device=accelerator.device)
    for k in range(n_micro):
        group, weight = (plan[k], 1.0) if k < len(plan) else (filler, 0.0)
        batch = {name: t.to(accelerator.device, non_blocking=True)
                 for name, t in collate([samples[i] for i in group], pad_id).items()}
        # Gradients are all-reduced only on the last micro-batch of the step.
        sync = contextlib.nullcontext() if k == n_micro - 1 else accelerator.no_sync(model)
        with sync:
            # autocast here too: the chunked path calls the decoder itself, not the prepared model's forward,
            # which is where accelerate puts its autocast (nested for the logits path: no change)
            with accelerator.autocast():
                loss = micro_batch_loss(model, batch, global_label_tokens, world, chunk_tokens) * weight
            accelerator.backward(loss)
        loss_sum += loss.detach() / world
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    loss_value = float(accelerator.reduce(loss_sum, "sum"))  # synchronises: the timing below is honest
    step_tokens = sum(lengths[i] for i in batch_ids)
    elapsed = time.perf_counter() - started
    return {"loss": loss_value, "lr": lr, "grad_norm": float(grad_norm), "tokens": step_tokens,
            "label_tokens": global_label_tokens, "tokens_per_s": step_tokens / elapsed, "step_s": elapsed}


# ---------------------------------------------------------------- the training loop


def train_sft(cfg: SFTConfig, rows: Sequence[dict[str, Any]], out_dir: str | Path, metrics_path: str | Path,
              on_step_end: Callable[[int, dict[str, float]], None] | None = None) -> SFTResult:
    """Fine-tune `cfg.base_model` on trajectory `rows`; resumes an unfinished run's last checkpoint
    in `out_dir` when its restart key (:func:`sft_restart_key`) is this run's.

    Writes checkpoints to ``out_dir/checkpoints``, the final HF model to ``out_dir/model``,
    a summary to ``out_dir/sft_summary.json`` and per-step metrics to `metrics_path`. A finished
    run drops its checkpoints: a rerun (a forced one, or one whose outputs were deleted) trains
    again from step 0 rather than handing back the old model.
    `on_step_end(step, metrics)` is called after every optimizer step (e.g. to stop early).
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if not cfg.base_model:
        raise ValueError("SFTConfig.base_model is empty: give a hub id or a local model path")
    out_dir = Path(out_dir)
    ckpt_root = out_dir / "checkpoints"
    accelerator = Accelerator(mixed_precision=resolve_precision(cfg.mixed_precision))
    set_seed(cfg.seed)

    # --- data
    tokenizer = load_tokenizer(cfg)
    rows = [row for row in rows if cfg.max_turn is None or row["turn"] <= cfg.max_turn]
    samples, report = build_samples(rows, tokenizer, cfg.max_length, cfg.overlong, cfg.keep, cfg.unit)
    if not samples:
        raise ValueError(f"no SFT samples left after filtering: {report.as_dict()}")
    n_steps = total_steps(cfg, len(samples))
    warmup = int(cfg.warmup_ratio * n_steps)
    if accelerator.is_main_process:
        log.info("SFT samples: %s%s", report.as_dict(), since_job_started())

    # --- model, optimizer, schedule
    plan = resolve_memory_plan(cfg.optimizer_offload, cfg.base_model, accelerator.num_processes, trainer_gpu_bytes())
    model = load_model(cfg, weights_dtype(plan))
    key = sft_restart_key(cfg, samples)  # after the load: a hub model's weights are then in the local cache
    # AdamW as verl's SFT trainer, over all parameters, where the memory plan keeps it
    model, optimizer = prepare_model_and_optimizer(accelerator, model, plan, cfg.lr, cfg.betas, cfg.weight_decay,
                                                   cfg.base_model if Path(cfg.base_model).is_dir() else None)
    if accelerator.is_main_process:
        log.info("SFT memory plan %s (%s)", plan.name, plan.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, n_steps, warmup, cfg.schedule, cfg.min_lr_ratio))
    accelerator.register_for_checkpointing(scheduler)

    # --- resume
    metrics = MetricsLog(metrics_path, run=cfg.run, stage="sft")
    start_step, resumed_from = 0, None
    checkpoint = latest_checkpoint(ckpt_root)
    why = checkpoint.mismatch(key) if checkpoint is not None else ""
    if why:
        log.warning("not resuming the checkpoint at step %d in %s: %s; training from step 0",
                    checkpoint.step, ckpt_root, why)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            remove_checkpoints(ckpt_root)
        checkpoint = None
    if checkpoint is not None:
        load_training_state(accelerator, optimizer, checkpoint.state_dir)
        start_step = resumed_from = checkpoint.step
        log.info("resuming SFT at step %d of %d from %s (same restart key)", start_step, n_steps, checkpoint.path)
    elif not why:
        log.info("no unfinished checkpoint in %s: training from step 0", ckpt_root)
    metrics.resume(start_step)

    # --- loop
    model.train()
    progress = tqdm(total=n_steps, initial=start_step, desc=f"sft {cfg.run}", unit="step",
                    disable=not accelerator.is_main_process)
    last_loss = None
    for step in range(start_step, n_steps):
        batch_ids = batch_indices(len(samples), cfg.batch_size, cfg.seed, step)
        values = train_step(accelerator, model, optimizer, scheduler, samples, batch_ids, cfg.micro_batch_tokens,
                            cfg.grad_clip, tokenizer.pad_token_id, cfg.logprob_chunk_tokens)
        values["epoch"] = (step + 1) / steps_per_epoch(len(samples), cfg.batch_size)
        metrics.log(step + 1, values)
        last_loss = values["loss"]
        progress.update(1)
        progress.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{values['tokens_per_s']:.0f}")
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < n_steps:
            # Metrics first: a kill during the save leaves extra rows, which the resume drops.
            if accelerator.is_main_process:
                metrics.flush()
            save_checkpoint(accelerator, model, optimizer, tokenizer, ckpt_root, step + 1, key, cfg.keep_last)
        if on_step_end is not None:
            on_step_end(step + 1, values)
    progress.close()

    # --- HF export, metrics, summary; then the checkpoints go: a finished run is never resumed
    model_dir = export_hf(accelerator, model, tokenizer, out_dir / "model", optimizer=optimizer)
    if accelerator.is_main_process:
        metrics.flush()
        summary = {"config": asdict(cfg), "steps": n_steps, "resumed_from": resumed_from,
                   "samples": report.as_dict(), "final_loss": last_loss, "restart_key": key}
        (out_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        remove_checkpoints(ckpt_root)
    return SFTResult(model_dir, n_steps, resumed_from, report, last_loss)


def publish(source: Path, target: Path, *, move: bool = False) -> None:
    """Copy a finished result of the run directory to a pipeline output. Snakemake deletes the
    outputs of a killed job, so what a rerun resumes from must live in the run directory. `move`:
    what no rerun reads (the finished model) is moved, so the run directory keeps no full copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if move:
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(source, target)
    elif source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True)
    else:
        shutil.copy(source, target)


@launched
def sft_job(*, trajectories: Sequence[str], work_dir: str, settings: Mapping[str, Any], model_out: str,
            summary_out: str, metrics_out: str) -> None:
    """Rule `sft`: fine-tune on the cold-start `trajectories` in each of the job's processes
    (`kpipe.infra.jobs.run_job`), `settings` the SFTConfig values (the `sft` section, the run, the base
    model). Checkpoints and the metrics so far live in `work_dir` (a rerun resumes from them); the
    finished model, summary and metrics are copied to the rule's outputs."""
    from accelerate import PartialState

    from kpipe.train.samples import load_trajectory_rows

    cfg = SFTConfig.from_dict(dict(settings))
    work, metrics = Path(work_dir), Path(work_dir) / "train_metrics.parquet"
    result = train_sft(cfg, load_trajectory_rows([Path(path) for path in trajectories]), work, metrics)
    if not PartialState().is_main_process:
        return
    publish(result.model_dir, Path(model_out), move=True)
    publish(work / "sft_summary.json", Path(summary_out))
    publish(metrics, Path(metrics_out))
    log.info("SFT %s: %d steps (resumed from %s), final loss %.4f, %s", cfg.run, result.steps, result.resumed_from,
             result.final_loss, json.dumps(result.samples.as_dict()))
