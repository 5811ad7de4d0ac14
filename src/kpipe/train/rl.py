"""Multi-turn RL iterations (paper §4–5): rollouts → rewards → returns → advantages → filters →
PPO-clip update → checkpoint, as one resumable unit of work per Snakemake job.

One iteration runs `steps_per_iteration` steps. A step:

1. picks `prompts_per_step` training queries (a pure function of seed and global step) and runs
   `rollouts_per_prompt` multi-turn episodes each through the one agent loop
   (`kpipe.agent.run_episodes`), the policy generating with per-token log-probabilities and
   KernelGym judging every turn (per-turn reward, Eq. 1 / Eq. 8, `rl.reward` of `algos.REWARDS`);
2. recomputes π_train on the very same tokens (the old log-probs of PPO, and the numerator of MRS's
   ratio, Eq. 6) and computes reward-to-go returns per trajectory (Eq. 2);
3. applies the switchable filters — TritonForge's group buffer, MRS (Eq. 6), PRS (Eq. 9), the
   released code's zero-variance and regression masks — each counted in the metrics;
4. computes advantages over (prompt, turn) groups of the kept rows (TRLOO, Eq. 5, by default, `rl.advantage`
   of `algos.ADVANTAGES`; on the buffer's normalised returns when `rl.buffer` is set);
5. takes PPO-clip token-level optimizer steps (dual clip, seq-mean-token-sum, grad clipping).

Every turn becomes a `trajectories` row (stage "rl") with its reward, return, advantage and
whether (and by which filter) it was dropped; every step logs `train_metrics` rows.

In code, `IterationTrainer.step` says it in order: the rollout engine gets the policy's weights
(`kpipe.train.rollouts`), `RolloutSource` hands the step's rollouts (saved, generated now, or generated
ahead during the step before), with `rl.vllm_sleep` the colocated vLLM engine sleeps until the next push
(phases ``push`` and ``sleep_wake``), they become one `StepBatch` (`kpipe.train.rl_batch`) and
`IterationTrainer.train` runs phases 2–5 on it, each phase adding its fields and running under its
own timer (`<phase>_s` in the metrics); the update is `kpipe.train.rl_update.update_policy(batch, model,
optimizer, ...)`; then the step's metrics and checkpoint. The math is `kpipe.train.algos`, the settings
`kpipe.train.rl_config` (`RLConfig`; `IterationSettings`, the one argument of `run_iteration`).

Asynchronous inference (`rl.async`, paper §6.1): `eval` judges each turn while the engine decodes
the others (in the agent loop; same rows as `off`); `off_policy_1` also generates the next step's
rollouts on a background thread, from a copy of the policy before this step's update, while the
update runs: those rollouts are one step stale (`policy_lag`), their recorded log-probs are the
generating policy's, and MRS compares them with the trainer's recomputed ones as for any rollout.

Resumable: each step's rollouts are saved in a scratch directory before training on them, and
with several steps per iteration each finished step leaves a checkpoint there, so a killed job
redoes only unfinished work. Final outputs are written once, atomically, at the end; a
restart key (settings, tasks, input models and state, code, library versions) guards the scratch
directory. The scratch goes once the outputs are written: a rerun of a finished iteration starts over.

Several processes (`rl.gpus`, ``kpipe launch``: one per GPU, FSDP2) run the same
step data-parallel: each takes an equal share of the step's prompts, generates and evaluates
their rollouts itself (on its own GPU, with a full-weight copy of the policy for HF `generate` or its
own in-process vLLM engine, fed the gathered weights before each step), and computes
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object

from kpipe.agent.evaluator import CachedEvaluator, Evaluator
from kpipe.agent.loop import AgentTask
from kpipe.data.io import read_table, write_table
from kpipe.data.sources import training_queries
from kpipe.infra.jobs import launched, since_job_started
from kpipe.infra.provenance import RL_CODE, code_version, key_changes, library_versions, restart_key, weights_identity
from kpipe.train import algos
from kpipe.train.batching import max_over_processes, resolve_precision
from kpipe.train.checkpoint import (
    check_trainer_init,
    export_hf,
    latest_checkpoint,
    load_training_state,
    save_checkpoint,
    save_training_state,
)
from kpipe.train.metrics_log import MetricsLog
from kpipe.train.trainer_memory import prepare_model_and_optimizer, resolve_memory_plan, trainer_gpu_bytes, weights_dtype
from kpipe.train.rl_batch import (
    StepBatch,
    advantages,
    buffer_masks,
    filter_masks,
    mismatch_keep,
    rejection_reasons,
    returns,
)
from kpipe.train.rl_config import IterationSettings, RLConfig
from kpipe.train.rl_update import global_means, policy_log_probs, token_totals, update_policy
from kpipe.train.rollouts import (
    STAGE,
    RolloutSource,
    TimedEngine,
    TimedEvaluator,
    copy_full_weights,
    feed_vllm,
    make_engine,
    rollout_metrics,
    step_seed,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IterationResult:
    model_dir: Path
    steps: int
    resumed_steps: int  # steps whose work a previous (killed) attempt had already finished
    rows: int
    mean_reward: float


def iteration_key(cfg: RLConfig, run: str, iteration: int, tasks: Sequence[AgentTask], protocol_json: str,
                  init_model: str | os.PathLike, init_state: str | os.PathLike | None,
                  reference_model: str | os.PathLike | None) -> dict[str, str]:
    """The restart key of an iteration's scratch work: its settings, its tasks, the models and state
    it starts from, kpipe's RL code and the library versions (kpipe.infra.provenance); a mismatch
    means start the iteration over."""
    tasks_digest = hashlib.sha256()
    for task in tasks:
        tasks_digest.update(task.task_id.encode())
        tasks_digest.update(task.reference_src.encode())
    return restart_key(settings=[cfg.fingerprint(), run, iteration, protocol_json], data=tasks_digest.hexdigest(),
                       weights=[weights_identity(init_model), weights_identity(init_state),
                                weights_identity(reference_model)],
                       code=code_version(*RL_CODE), libraries=library_versions())


def prepare_scratch(scratch: Path, key: dict[str, str]) -> bool:
    """Keep `scratch` if it holds work of this restart key (returns True), else clear it for a fresh
    start, logging which part of the key changed."""
    marker = scratch / "restart_key.json"
    if marker.exists():
        why = key_changes(json.loads(marker.read_text()), key)
        if not why:
            return True
        log.warning("not resuming the partial work in %s: %s; the iteration starts over", scratch, why)
    elif scratch.exists():
        log.warning("not resuming the partial work in %s: it carries no restart key; the iteration starts over",
                    scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    marker.write_text(json.dumps(key))
    return False


def check_processes(cfg: RLConfig, n_prompts: int, processes: int) -> None:
    """What several processes cannot run, as one-line errors before any work: every process gets
    the same number of prompts."""
    if n_prompts % processes:
        raise ValueError(f"RL: {n_prompts} prompts per step cannot be split evenly over {processes} processes; "
                         "make rl.prompts_per_step (and the number of training prompts) a multiple of rl.gpus")


def load_policy(model_dir: Path, cfg: RLConfig, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The policy in fp32 (master weights; bf16 autocast on GPU), or bf16 where the memory plan keeps the
    fp32 master on the host, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
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


class PhaseTimer:
    """Wall seconds of a step's phases (`with timer("update"): ...`), reported as `<phase>_s` metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        return {f"{phase}_s": seconds for phase, seconds in self.seconds.items()}


def recompute_log_probs(batch: StepBatch, cfg: RLConfig, accelerator: Any, model: Any, progress: bool,
                        reference: Any | None) -> tuple[list[Any], list[Any]]:
    """π_train's log-probabilities of the rollout tokens (PPO's old log-probs, MRS's numerator), and the
    reference policy's for the KL term (None each without one), in the update's precision: PPO's ratio
    starts at 1."""
    samples, pad_id = batch.samples, batch.pad_id
    model.eval()
    with accelerator.autocast():
        train_logp = policy_log_probs(model, samples, cfg.temperature, cfg.micro_batch_tokens, pad_id,
                                      accelerator.device, progress, partial(max_over_processes, accelerator),
                                      cfg.logprob_chunk_tokens)
        # the reference is a whole copy in every process: no collective, so no shared pass count
        ref_logp = (policy_log_probs(reference, samples, cfg.temperature, cfg.micro_batch_tokens, pad_id,
                                     accelerator.device, chunk_tokens=cfg.logprob_chunk_tokens)
                    if reference is not None else [None] * len(samples))
    model.train()
    return train_logp, ref_logp


def filter_metrics(accelerator: Any, batch: StepBatch) -> dict[str, float]:
    """What each filter kept, the returns, advantages and the rollout/trainer mismatch, as means over
    every process's rows."""
    has_tokens, masks, kept, log_w, mrs_keep = batch.has_tokens, batch.masks, batch.kept, batch.log_w, batch.mrs_keep
    train_logp, rollout_logp = batch.train_logp, batch.rollout_logp
    rows = len(kept)
    with_tokens = float(has_tokens.sum())
    totals = {f"kept_frac_{name}": (float((mask & has_tokens).sum()), with_tokens) for name, mask in masks.items()}
    totals.update(kept_frac=(float(kept.sum()), rows), return_mean=(float(batch.returns.sum()), rows),
                  advantage_abs_mean=(float(batch.advantages[kept].abs().sum()), float(kept.sum())),
                  mismatch_abs_log_w=(float(log_w[has_tokens].abs().sum()), with_tokens),
                  # what MRS would keep with `mrs: false` too (Figure 7's mismatch, whatever the filters)
                  mrs_would_keep=(float((mrs_keep & has_tokens).sum()), with_tokens))
    totals.update(token_totals([train_logp[i] for i in range(rows) if has_tokens[i]],
                               [rollout_logp[i] for i in range(rows) if has_tokens[i]]))
    means = global_means(accelerator, totals)
    values = {name: means.get(name, 0.0) for name in totals if not name.endswith("_nll")}
    values.update({f"{engine}_ppl": algos.perplexity(means[f"{engine}_nll"]) for engine in ("rollout", "train")
                   if f"{engine}_nll" in means})
    return values


def run_iteration(settings: IterationSettings, evaluator: Evaluator | None = None) -> IterationResult:
    """RL iteration `settings.iteration` of `settings.run`, from the HF model `settings.init_model`.

    The previous iteration's optimizer state (`init_state`) carries Adam's moments over (missing: a
    fresh optimizer, with a warning after iteration 0). Writes the HF model to `model_out`, the
    optimizer state to `state_out` (None: none), the rollouts to `trajectories` and the step metrics to `metrics`.
    `gym` is the `gym` config section (backend, workers, cache, protocol); `evaluator` replaces the
    backend it names (tests, an evaluator shared across iterations). The reference model is loaded
    only if `kl_coef` > 0.
    """
    from accelerate import Accelerator

    from kpipe.agent.evaluator import open_evaluator, reference_reuse

    cfg = settings.cfg
    if not settings.tasks:
        raise ValueError("RL needs at least one training task")
    protocol = gym_protocol(cfg, settings.gym.get("protocol"))
    init_state = settings.init_state if settings.init_state is not None and Path(settings.init_state).is_dir() else None
    if init_state is None and settings.iteration > 0:
        log.warning("RL iteration %d of %s starts with a fresh optimizer: no state from iteration %d",
                    settings.iteration, settings.run, settings.iteration - 1)
    settings = replace(settings, init_state=init_state, gym={**settings.gym, "protocol": protocol.to_dict()},
                       reference_model=settings.reference_model if cfg.kl_coef > 0 else None)
    key = iteration_key(cfg, settings.run, settings.iteration, settings.tasks, protocol.to_json(), settings.init_model,
                        settings.init_state, settings.reference_model)
    accelerator = Accelerator(mixed_precision=resolve_precision(cfg.mixed_precision))
    check_processes(cfg, min(cfg.prompts_per_step, len(settings.tasks)), accelerator.num_processes)
    trainer = IterationTrainer(accelerator, settings, key)
    with contextlib.ExitStack() as stack:
        if evaluator is None:
            evaluator = stack.enter_context(open_evaluator(settings.gym, reuse_reference=reference_reuse(None),
                                                           progress=trainer.progress,
                                                           gpus=trainer.evaluation_gpus()))
        cached = CachedEvaluator(evaluator, settings.scratch / f"evals-{accelerator.process_index}.jsonl",
                                 protocol.to_json())
        for step in range(trainer.start_step, cfg.steps_per_iteration):
            trainer.step(step, cached)
    return trainer.finish(resumed_steps=trainer.start_step)


class IterationTrainer:
    """The state of one iteration in one process: accelerator, policy, optimizer, rollout source and
    metrics log. With several processes and the HF engine, rollouts run on `rollout_model`, a full-weight copy of the
    policy refreshed before every step: generation through the sharded policy would need every
    process to run the same number of forward passes, which the processes' episodes do not. With
    `async: off_policy_1` (HF engine) too: the next step's rollouts are generated from that copy while
    the update changes the policy's own weights."""

    def __init__(self, accelerator: Any, settings: IterationSettings, key: dict[str, str]) -> None:
        from accelerate.utils import set_seed

        set_up = time.perf_counter()
        cfg, scratch, run, iteration = settings.cfg, settings.scratch, settings.run, settings.iteration
        self.accelerator, processes = accelerator, accelerator.num_processes
        self.settings, self.cfg, self.scratch, self.key = settings, cfg, scratch, key
        self.progress = settings.progress and self.accelerator.is_main_process
        with self.accelerator.main_process_first():  # rank 0 clears a stale scratch before the others look
            resumed = prepare_scratch(scratch, key)
        set_seed(cfg.seed + iteration)
        # the whole job's GPU share: a colocated vLLM engine keeps its part of the GPU throughout, unless it
        # sleeps while the trainer trains (rl.vllm_sleep)
        vllm_share = cfg.vllm_gpu_memory_utilization if cfg.engine == "vllm" and not cfg.vllm_sleep else 0.0
        self.memory_plan = resolve_memory_plan(cfg.optimizer_offload, settings.init_model, processes,
                                               trainer_gpu_bytes(vllm_share))
        check_trainer_init(settings.init_model, weights_dtype(self.memory_plan))
        model, self.tokenizer = load_policy(settings.init_model, cfg, weights_dtype(self.memory_plan))
        # bf16 under bf16 autocast (what vLLM would sample from too): half the memory of an fp32 copy,
        # and no autocast cache of its casts held through the rollouts
        rollout_dtype = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else torch.float32
        # vLLM holds its own copy of the weights (pushed before each step), so only HF generate needs one
        needs_copy = cfg.engine == "hf" and (processes > 1 or cfg.async_mode == "off_policy_1")
        self.rollout_model = (copy.deepcopy(model).to(self.accelerator.device, dtype=rollout_dtype).eval()
                              if needs_copy else None)
        self.reference = None  # the KL term's frozen reference policy, a whole copy in every process
        if cfg.kl_coef > 0:
            if settings.reference_model is None:
                raise ValueError("rl.kl_coef > 0 needs a reference model (the run's SFT checkpoint)")
            self.reference = load_policy(settings.reference_model, cfg)[0].to(self.accelerator.device,
                                                                               dtype=rollout_dtype).eval()
        self.model, self.optimizer = prepare_model_and_optimizer(self.accelerator, model, self.memory_plan, cfg.lr,
                                                                 cfg.betas, cfg.weight_decay, settings.init_model)
        checkpoint = latest_checkpoint(scratch / "checkpoints")
        self.start_step = checkpoint.step if checkpoint is not None else 0
        if checkpoint is not None:
            load_training_state(self.accelerator, self.optimizer, checkpoint.state_dir)
        elif settings.init_state is not None:
            load_training_state(self.accelerator, self.optimizer, settings.init_state)
        self.metrics = MetricsLog(scratch / "metrics.parquet", run=run, stage=STAGE, iteration=iteration)
        self.metrics.resume(settings.global_step(self.start_step))
        if self.accelerator.is_main_process:
            # the job's start-up in two parts: this set-up (policy, optimizer, state), and all before it
            log.info("RL %s iteration %d on %d process(es) (%s)%s, %.1f s of it loading the policy and its state; "
                     "memory plan %s (%s)", run, iteration, processes, self.accelerator.distributed_type,
                     since_job_started(), time.perf_counter() - set_up, self.memory_plan.name,
                     self.memory_plan.optimizer)
            if resumed:
                log.info("resuming RL iteration %d of %s at step %d (scratch %s)", iteration, run, self.start_step,
                         scratch)
        policy = self.rollout_model if self.rollout_model is not None else self.accelerator.unwrap_model(self.model)
        # the engine in the rows' model label: figures name where rollouts came from (views.sql provenance)
        self.raw_engine = make_engine(cfg, policy, self.tokenizer, settings.init_model,
                                      f"{run}/rl-iter{iteration}/{cfg.engine}", self.progress, processes)
        self.engine = TimedEngine(self.raw_engine)
        self.rollouts = RolloutSource(settings, accelerator, self.engine, self.model)
        self.filter_generator, self.shuffle_generator = torch.Generator(), torch.Generator()

    def evaluation_gpus(self) -> list[str] | None:
        """With several processes on GPUs each process evaluates on its own GPU; None: the
        evaluator's default (every visible GPU, or CPU workers)."""
        from kpipe.infra.gpu import visible_gpus

        gpus = visible_gpus()
        if self.accelerator.num_processes == 1 or not gpus:
            return None
        return [gpus[self.accelerator.local_process_index]]

    def step(self, step: int, evaluator: Evaluator) -> dict[str, float]:
        """One step, in order: the rollout engine gets the policy's weights (a sleeping vLLM engine wakes for
        them); this process's rollouts (saved, or generated and judged now); with `vllm_sleep` the engine
        sleeps; the phases on their batch (`train`), with off_policy_1 the next step's rollouts generated
        meanwhile; metrics over every process's rows; the step's rows and a checkpoint in the scratch."""
        timed, timer = TimedEvaluator(evaluator), PhaseTimer()
        self.engine.seconds = 0.0
        started = time.perf_counter()
        self.sync_rollout_weights(step, timer)
        with timer("rollout"):
            rows = self.rollouts.of_step(step, timed)
        if self.cfg.engine == "vllm" and self.cfg.vllm_sleep:
            with timer("sleep_wake"):  # the trainer's log-probs and update get the engine's GPU memory
                self.raw_engine.sleep()
        self.seed_step_generators(step)
        with self.rollouts.ahead(step + 1, timed), timer("train"):
            batch = self.train(StepBatch.of_rows(rows, self.tokenizer), timer)
            values = {**batch.update, **filter_metrics(self.accelerator, batch)}
        release_cached_gpu_memory()
        all_rows = gather_object(batch.rows)
        values.update(self.step_metrics(step, all_rows, timed, timer, time.perf_counter() - started))
        self.save_step(step, all_rows, values)
        return values

    def train(self, batch: StepBatch, timer: PhaseTimer) -> StepBatch:
        """Phases 2–5 of the module docstring on this process's batch, each under its timer, each adding
        its fields to the batch. PRS draws its coin flips from `filter_generator`, the update its
        mini-batches from `shuffle_generator`."""
        cfg = self.cfg
        with timer("log_probs"):
            batch.train_logp, batch.ref_logp = recompute_log_probs(batch, cfg, self.accelerator, self.model,
                                                                   self.progress, self.reference)
            batch.mrs_keep, batch.log_w = mismatch_keep(batch.train_logp, batch.rollout_logp, cfg)
        with timer("returns"):
            batch.returns = returns(batch, cfg)
        with timer("filters"):
            batch.masks = buffer_masks(batch, cfg) | filter_masks(batch, cfg, self.filter_generator)
            batch.reasons = rejection_reasons(batch.has_tokens, batch.masks)
            batch.kept = torch.tensor([reason is None for reason in batch.reasons])
        with timer("advantages"):
            batch.advantages = advantages(batch, cfg)
            batch.annotate()
        with timer("update"):
            batch.update = update_policy(batch, self.model, self.optimizer, self.accelerator, cfg,
                                         self.shuffle_generator, self.progress)
        return batch

    def sync_rollout_weights(self, step: int, timer: PhaseTimer) -> None:
        """Give the rollout engine the policy's current weights (phase ``push``): the HF rollout copy every
        step, vLLM's engine after the first (it loaded the iteration's initial model itself), woken for them
        if it sleeps (phase ``sleep_wake``, `kpipe.train.rollouts.feed_vllm`)."""
        policy = self.accelerator.unwrap_model(self.model)
        if self.rollout_model is not None:
            with timer("push"):
                copy_full_weights(policy, self.rollout_model)
        if self.cfg.engine == "vllm" and step > 0:
            feed_vllm(self.raw_engine, policy, timer)

    def seed_step_generators(self, step: int) -> None:
        """Seed the step's two random streams from the run's seed and global step, so a resumed step
        draws what the first attempt drew: PRS's coin flips, one stream per process (rank 0's is the
        one-process stream), and the mini-batches' shuffle, one stream for all."""
        global_step = self.settings.global_step(step)
        self.filter_generator.manual_seed(step_seed(self.cfg.seed + 1, global_step) + self.accelerator.process_index)
        self.shuffle_generator.manual_seed(step_seed(self.cfg.seed + 2, global_step))

    def step_metrics(self, step: int, all_rows: list[dict[str, Any]], timed: TimedEvaluator, timer: PhaseTimer,
                     step_s: float) -> dict[str, float]:
        """The step's rollout metrics and times. The times are this process's (the step ends in
        collectives, so step_s is everyone's); gen_s and eval_s count whatever generation and evaluation
        ran during the step, overlap_s what running them alongside each other and the update saved
        against one after the other (the weight push and the engine's sleep and wakes, push_s and
        sleep_wake_s, run alone); row_tokens the tokens of every row (context and answer), what the log-probs
        and the update read."""
        values = rollout_metrics(all_rows, self.cfg.max_turns)
        phases = timer.metrics()
        alone = phases.get("push_s", 0.0) + phases.get("sleep_wake_s", 0.0)
        values.update(gen_s=self.engine.seconds, eval_s=timed.seconds, rollout_s=phases.pop("rollout_s"),
                      train_s=phases["train_s"], step_s=step_s,
                      overlap_s=self.engine.seconds + timed.seconds + phases.pop("train_s") + alone - step_s,
                      policy_lag=float(self.rollouts.policy_lag(step)), lr=self.cfg.lr, rows=float(len(all_rows)),
                      row_tokens=float(sum((row.get("prompt_tokens") or 0) + (row.get("completion_tokens") or 0)
                                           for row in all_rows)))
        values.update(phases)  # the train phases' own seconds, push_s and sleep_wake_s
        return values

    def save_step(self, step: int, all_rows: list[dict[str, Any]], values: dict[str, float]) -> None:
        """The step's metrics and rows into the scratch (a failed job keeps them to read, whether or not it resumes
        from them), and a checkpoint unless it is the iteration's last step (finish writes that one's model and
        state) or `step_checkpoints` is off."""
        accelerator = self.accelerator
        self.metrics.log(self.settings.global_step(step) + 1, values)
        if accelerator.is_main_process:
            self.metrics.flush()
            write_table(all_rows, self.scratch / f"step-{step:04d}.parquet", "trajectories")
            log.info("RL %s iteration %d step %d: reward %.3f, kept %.2f, grad norm %.3g", self.settings.run,
                     self.settings.iteration, step, values["reward_mean"], values["kept_frac"],
                     values.get("grad_norm", 0.0))
        if step + 1 < self.cfg.steps_per_iteration and self.cfg.step_checkpoints:
            save_checkpoint(accelerator, self.model, self.optimizer, self.tokenizer, self.scratch / "checkpoints",
                            step + 1, self.key, keep_last=1)

    def finish(self, resumed_steps: int) -> IterationResult:
        """Write the iteration's outputs (each atomically, the model and state via a rename; files by
        rank 0), drop the scratch."""
        accelerator, model_out, state_out = self.accelerator, Path(self.settings.model_out), self.settings.state_out
        replace_dir(accelerator, model_out, lambda tmp: export_hf(accelerator, self.model, self.tokenizer, tmp,
                                                                  self.settings.model_out_dtype, self.optimizer))
        if state_out is not None:
            replace_dir(accelerator, Path(state_out), lambda tmp: save_training_state(accelerator, self.optimizer, tmp))
        rows = []
        for step in range(self.cfg.steps_per_iteration):
            rows.extend(read_table(self.scratch / f"step-{step:04d}.parquet", "trajectories").to_pylist())
        accelerator.wait_for_everyone()  # everyone has read the scratch
        if accelerator.is_main_process:
            write_table(rows, self.settings.trajectories, "trajectories")
            write_table(self.metrics.rows, self.settings.metrics, "train_metrics")
            shutil.rmtree(self.scratch, ignore_errors=True)
        accelerator.wait_for_everyone()
        mean_reward = float(np.mean([row["reward"] for row in rows])) if rows else math.nan
        return IterationResult(model_out, self.cfg.steps_per_iteration, resumed_steps, len(rows), mean_reward)


def release_cached_gpu_memory() -> None:
    """Hand the update's cached blocks back: the next rollouts' evaluation children share this GPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    """RL prompts: the non-contaminated queries of the sources that feed RL, ordered by id (the first `max_prompts`)."""
    rows = training_queries(queries_path, "rl")
    return [AgentTask(r["query_id"], r["reference_src"]) for r in rows[:max_prompts]]


# rl.final_checkpoint: what a run's last iteration writes (kpipe.report.cost counts its disk so)
FINAL_CHECKPOINTS = ("trainer", "evaluation")


def drop_optimizer_state(path: str | os.PathLike) -> None:
    """Delete an iteration's optimizer state once the next iteration has its own (Adam's
    moments are twice the model in fp32: one per iteration would fill any disk)."""
    shutil.rmtree(path, ignore_errors=True)



@launched
def rl_job(*, queries: str, init_model: str, model_out: str, trajectories: str, metrics: str, scratch: str, run: str,
           iteration: int, rl: Mapping[str, Any], gym: Mapping[str, Any], state_out: str | None,
           init_state: str | None = None, drop_init_state: bool = False, reference_model: str | None = None,
           export: str = "trainer") -> None:
    """Rule `rl_iter`: one RL iteration in each of the job's processes (`kpipe.infra.jobs.run_job`), its
    settings the rule's (`rl`: the run's `rl` section; `gym`: the `gym` section); the prompts are the
    non-contaminated queries of `queries`. `drop_init_state`: delete `init_state` once done (the next
    iteration needs only this one's). `export` (`rl.final_checkpoint` of a run's last iteration): `trainer`
    writes the model as trained and the optimizer state to `state_out`; `evaluation`, what only evaluation
    reads: the model in bf16 and no optimizer state."""
    from accelerate import PartialState

    if export not in FINAL_CHECKPOINTS:
        raise ValueError(f"export must be one of {FINAL_CHECKPOINTS}, got {export!r}")
    if export == "evaluation" and state_out:
        raise ValueError("an evaluation-only export keeps no optimizer state: pass no state_out")
    cfg = RLConfig.from_dict(dict(rl))
    result = run_iteration(IterationSettings(
        cfg=cfg, tasks=tuple(training_tasks(queries, cfg.max_prompts)), init_model=Path(init_model),
        model_out=Path(model_out), trajectories=Path(trajectories), metrics=Path(metrics), scratch=Path(scratch),
        run=run, iteration=iteration, init_state=Path(init_state) if init_state else None,
        state_out=Path(state_out) if state_out else None, gym=dict(gym),
        reference_model=Path(reference_model) if reference_model else None,
        model_out_dtype=torch.bfloat16 if export == "evaluation" else None))
    if PartialState().is_main_process:
        if drop_init_state and init_state:
            drop_optimizer_state(init_state)
        log.info("RL %s iteration %d: %d turns, mean reward %.3f, %d step(s) resumed -> %s", run, iteration,
                 result.rows, result.mean_reward, result.resumed_steps, result.model_dir)
