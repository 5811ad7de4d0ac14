"""Multi-turn RL iterations (paper §4–5): rollouts → rewards → returns → advantages → filters →
PPO-clip update → checkpoint, as one resumable unit of work per Snakemake job.

One iteration runs `steps_per_iteration` steps. A step:

1. picks `prompts_per_step` training queries (a pure function of seed and global step) and runs
   `rollouts_per_prompt` multi-turn episodes each through the one agent loop
   (`kpipe.agent.run_episodes`), the policy generating with per-token log-probabilities and
   KernelGym judging every turn (per-turn reward, Eq. 1 / Eq. 8) — `rl_rollouts`;
2. computes reward-to-go returns per trajectory (Eq. 2) and recomputes π_train on the very
   same tokens (the old log-probs of PPO, and the numerator of MRS's ratio, Eq. 6) — `rl_update`;
3. applies the switchable filters — TritonForge's group buffer, MRS (Eq. 6), PRS (Eq. 9), the
   released code's zero-variance and regression masks — each counted in the metrics — `rl_advantages`;
4. computes advantages over (prompt, turn) groups of the kept rows (TRLOO, Eq. 5, by default; on the
   buffer's normalised returns when `rl.buffer` is set) — `rl_advantages`;
5. takes PPO-clip token-level optimizer steps (dual clip, seq-mean-token-sum, grad clipping) — `rl_update`.

Every turn becomes a `trajectories` row (stage "rl") with its reward, return, advantage and
whether (and by which filter) it was dropped; every step logs `train_metrics` rows.

In code, `IterationTrainer.step` says it in order: the rollout engine gets the policy's weights,
`RolloutSource` hands the step's rollouts (saved, generated now, or generated ahead during the step
before), `train_on_rollouts` runs steps 2–5, then the step's metrics and checkpoint.

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

Several processes (``kpipe launch --gpus N -- train rl ...``: one per GPU, FSDP2) run the same
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
from kpipe.infra.jobs import since_job_started
from kpipe.infra.provenance import RL_CODE, code_version, key_changes, library_versions, restart_key, weights_identity
from kpipe.train import algos
from kpipe.train.checkpoint import export_hf, latest_checkpoint, save_checkpoint
from kpipe.train.metrics_log import MetricsLog
from kpipe.train.rl_advantages import (
    annotate_rows,
    buffer_masks,
    buffer_values,
    filter_masks,
    mismatch_keep,
    rejection_reasons,
    row_advantages,
    row_returns,
)
from kpipe.train.rl_config import RLConfig
from kpipe.train.rl_rollouts import (
    STAGE,
    TimedEngine,
    TimedEvaluator,
    copy_full_weights,
    make_engine,
    process_tasks,
    push_weights_to_vllm,
    rollout_metrics,
    rollout_rows,
    step_seed,
    step_tasks,
)
from kpipe.train.rl_update import (
    TrainItem,
    global_means,
    policy_log_probs,
    row_key,
    token_samples,
    token_totals,
    update_policy,
)
from kpipe.train.mechanics import max_over_processes, resolve_precision

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


def train_on_rollouts(rows: list[dict[str, Any]], cfg: RLConfig, accelerator: Any, model: Any, optimizer: Any,
                      tokenizer: Any, filter_generator: torch.Generator, shuffle_generator: torch.Generator,
                      progress: bool, reference: Any | None = None) -> dict[str, float]:
    """Steps 2–5 of the module docstring on this process's rollouts; annotates `rows` and returns the
    step's metrics over every process's rows. `filter_generator` draws PRS's coin flips,
    `shuffle_generator` the mini-batches (the same state on every process); `reference` is the
    reference policy of the KL term (`rl.kl_coef` > 0)."""
    samples = token_samples(rows, tokenizer)
    has_tokens = torch.tensor([bool(s.response_ids) for s in samples], dtype=torch.bool)
    train_logp, ref_logp = recompute_log_probs(samples, cfg, accelerator, model, tokenizer, progress, reference)
    rollout_logp = rollout_log_probs(rows, samples)
    mrs_keep, log_w = mismatch_keep(train_logp, rollout_logp, cfg)  # MRS (Eq. 6): kept or not, whatever `mrs`
    returns = row_returns(rows, cfg)  # the turns' rewards to reward-to-go returns (Eq. 2)
    masks = buffer_masks(rows, returns, cfg) | filter_masks(rows, cfg, mrs_keep, filter_generator)
    reasons = rejection_reasons(has_tokens, masks)
    kept = torch.tensor([reason is None for reason in reasons])
    valid = has_tokens if cfg.baseline_includes_rejected else kept
    advantages = row_advantages(rows, buffer_values(rows, returns, masks, cfg), valid, cfg)
    annotate_rows(rows, returns, advantages, reasons)

    items = [TrainItem(row_key(rows[i]), samples[i], float(advantages[i]), train_logp[i], ref_logp[i])
             for i in range(len(rows)) if kept[i]]
    values = update_policy(accelerator, model, optimizer, items, cfg, tokenizer.pad_token_id, shuffle_generator,
                           progress)
    values.update(filter_metrics(accelerator, has_tokens, masks, kept, returns, advantages, log_w, mrs_keep,
                                 train_logp, rollout_logp))
    return values


def recompute_log_probs(samples: Sequence[Any], cfg: RLConfig, accelerator: Any, model: Any, tokenizer: Any,
                        progress: bool, reference: Any | None) -> tuple[list[Any], list[Any]]:
    """π_train's log-probabilities of the rollout tokens (PPO's old log-probs, MRS's numerator), and the
    reference policy's for the KL term (None each without one), in the update's precision: PPO's ratio
    starts at 1."""
    pad_id = tokenizer.pad_token_id
    model.eval()
    with accelerator.autocast():
        train_logp = policy_log_probs(model, samples, cfg.temperature, cfg.micro_batch_tokens, pad_id,
                                      accelerator.device, progress, partial(max_over_processes, accelerator))
        # the reference is a whole copy in every process: no collective, so no shared pass count
        ref_logp = (policy_log_probs(reference, samples, cfg.temperature, cfg.micro_batch_tokens, pad_id,
                                     accelerator.device) if reference is not None else [None] * len(samples))
    model.train()
    return train_logp, ref_logp


def rollout_log_probs(rows: Sequence[dict[str, Any]], samples: Sequence[Any]) -> list[list[float]]:
    """The generating policy's log-probabilities that each row recorded, one per response token."""
    rollout_logp = [list(row.get("response_logprobs") or []) for row in rows]
    for row, sample, logp in zip(rows, samples, rollout_logp, strict=True):
        if len(logp) != len(sample.response_ids):
            raise ValueError(f"{row['task_id']} sample {row['sample']} turn {row['turn']}: "
                             f"{len(logp)} rollout log-probs for {len(sample.response_ids)} tokens")
    return rollout_logp


def filter_metrics(accelerator: Any, has_tokens: torch.Tensor, masks: Mapping[str, torch.Tensor], kept: torch.Tensor,
                   returns: torch.Tensor, advantages: torch.Tensor, log_w: torch.Tensor, mrs_keep: torch.Tensor,
                   train_logp: Sequence[Any], rollout_logp: Sequence[Any]) -> dict[str, float]:
    """What each filter kept, the returns, advantages and the rollout/trainer mismatch, as means over
    every process's rows."""
    rows = len(kept)
    with_tokens = float(has_tokens.sum())
    totals = {f"kept_frac_{name}": (float((mask & has_tokens).sum()), with_tokens) for name, mask in masks.items()}
    totals.update(kept_frac=(float(kept.sum()), rows), return_mean=(float(returns.sum()), rows),
                  advantage_abs_mean=(float(advantages[kept].abs().sum()), float(kept.sum())),
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
    reference_model: str | os.PathLike | None = None,
) -> IterationResult:
    """RL iteration `iteration` of `run`, starting from the HF model `init_model`.

    `init_model` is the previous iteration's model (iteration 0: the SFT model); `init_state`
    the previous iteration's optimizer state, so Adam's moments carry over (missing: a fresh
    optimizer, with a warning after iteration 0). Writes the HF model to `model_out`, the
    optimizer state to `state_out`, the rollouts to `trajectories_path` and the step metrics
    to `metrics_path`. `gym` is the `gym` config section (backend, workers, cache, protocol);
    `evaluator` replaces the backend it names (tests, an evaluator shared across iterations).
    `reference_model`: the KL term's reference policy (the run's SFT model), loaded only if `kl_coef` > 0.
    """
    from accelerate import Accelerator

    from kpipe.agent.evaluator import open_evaluator, reference_reuse

    if not tasks:
        raise ValueError("RL needs at least one training task")
    gym = dict(gym or {})
    protocol = gym_protocol(cfg, gym.get("protocol"))
    gym["protocol"] = protocol.to_dict()
    init_state = Path(init_state) if init_state is not None and Path(init_state).is_dir() else None
    if init_state is None and iteration > 0:
        log.warning("RL iteration %d of %s starts with a fresh optimizer: no state from iteration %d",
                    iteration, run, iteration - 1)
    reference_model = Path(reference_model) if reference_model is not None and cfg.kl_coef > 0 else None
    key = iteration_key(cfg, run, iteration, tasks, protocol.to_json(), init_model, init_state, reference_model)
    accelerator = Accelerator(mixed_precision=resolve_precision(cfg.mixed_precision))
    check_processes(cfg, min(cfg.prompts_per_step, len(tasks)), accelerator.num_processes)
    trainer = IterationTrainer(accelerator, IterationSettings(
        cfg=cfg, run=run, iteration=iteration, tasks=tuple(tasks), init_model=Path(init_model), init_state=init_state,
        scratch=Path(scratch), key=key, progress=progress, reference_model=reference_model))
    with contextlib.ExitStack() as stack:
        if evaluator is None:
            evaluator = stack.enter_context(open_evaluator(gym, reuse_reference=reference_reuse(None),
                                                           progress=trainer.progress,
                                                           gpus=trainer.evaluation_gpus()))
        cached = CachedEvaluator(evaluator, trainer.scratch / f"evals-{trainer.accelerator.process_index}.jsonl",
                                 protocol.to_json())
        resumed_steps = trainer.start_step
        for step in range(trainer.start_step, cfg.steps_per_iteration):
            trainer.step(step, cached)
    return trainer.finish(Path(model_out), state_out, trajectories_path, metrics_path, resumed_steps)


@dataclass(frozen=True)
class IterationSettings:
    """What one iteration's trainer is built from: the RL settings, which iteration of which run on
    which prompts, the model and optimizer state it starts from, its scratch and restart key."""

    cfg: RLConfig
    run: str
    iteration: int
    tasks: tuple[AgentTask, ...]
    init_model: Path
    init_state: Path | None  # the previous iteration's optimizer state; None: a fresh optimizer
    scratch: Path
    key: dict[str, str]  # the restart key (iteration_key) guarding the scratch
    progress: bool
    reference_model: Path | None = None  # the KL term's reference policy (rl.kl_coef > 0)

    def global_step(self, step: int) -> int:
        """`step` of this iteration counted over the run: the seeds and metrics' step."""
        return self.iteration * self.cfg.steps_per_iteration + step


class RolloutSource:
    """A step's rollouts, wherever they come from: saved in the scratch (by a killed attempt, or
    generated ahead during the step before), else generated now; with `async: off_policy_1` the
    next step's are generated ahead on a background thread while the update runs. Every step's
    rollouts are saved before they are trained on (the ahead ones before the step's checkpoint), so a
    resumed step finds them."""

    def __init__(self, settings: IterationSettings, accelerator: Any, engine: TimedEngine, policy: Any) -> None:
        self.settings, self.accelerator, self.engine = settings, accelerator, engine
        self.policy = policy  # HF generation may run on the policy itself: in eval mode then

    def of_step(self, step: int, evaluator: Evaluator) -> list[dict[str, Any]]:
        """This process's rollouts of `step`: the saved ones, or generated now and saved."""
        rows = self.saved(step)
        if rows is None:
            self.policy.eval()
            rows = self.save(step, self.generate(step, evaluator))
        return rows

    @contextlib.contextmanager
    def ahead(self, step: int, evaluator: Evaluator) -> Iterator[None]:
        """With off_policy_1, generate `step`'s rollouts on a background thread during the block, from
        the rollout weights of now, and save them after it (none past the iteration's last step, none
        already saved)."""
        cfg = self.settings.cfg
        if cfg.async_mode != "off_policy_1" or step >= cfg.steps_per_iteration or self.path(step).exists():
            yield
            return
        with ThreadPoolExecutor(1, thread_name_prefix="rollouts-ahead") as background:
            rows = background.submit(self.generate, step, evaluator, side_stream())
            yield
            self.save(step, rows.result())

    def policy_lag(self, step: int) -> int:
        """Updates between the policy that generated `step`'s rollouts and the one trained on them: with
        off_policy_1 every step but an iteration's first trains on rollouts generated during the
        previous step's update (also after a resume: they are saved before that step's checkpoint)."""
        return int(self.settings.cfg.async_mode == "off_policy_1" and step > 0)

    def path(self, step: int) -> Path:
        return self.settings.scratch / f"rollouts-{step:04d}.parquet"

    def my_tasks(self, step: int) -> list[AgentTask]:
        """This process's prompts of `step`."""
        cfg = self.settings.cfg
        return process_tasks(step_tasks(self.settings.tasks, cfg.prompts_per_step, cfg.seed,
                                        self.settings.global_step(step)),
                             self.accelerator.process_index, self.accelerator.num_processes)

    def saved(self, step: int) -> list[dict[str, Any]] | None:
        """This process's rollouts of `step` as a previous attempt (or the step before) saved them."""
        path = self.path(step)
        if not path.exists():
            return None
        mine = {task.task_id for task in self.my_tasks(step)}
        return [row for row in read_table(path, "trajectories").to_pylist() if row["task_id"] in mine]

    def generate(self, step: int, evaluator: Evaluator, stream: Any = None) -> list[dict[str, Any]]:
        """This process's rollouts of `step`, generated and judged now by the rollout engine's current
        weights, on the CUDA `stream` if given. No collectives: it runs on a background thread during
        the update (off_policy_1)."""
        settings = self.settings
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        # HF rollouts in the trainer's precision: less mismatch for MRS
        with on_stream, self.accelerator.autocast():
            return rollout_rows(self.my_tasks(step), self.engine, evaluator, settings.cfg, run=settings.run,
                                iteration=settings.iteration, global_step=settings.global_step(step),
                                progress=settings.progress and self.accelerator.is_main_process)

    def save(self, step: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every process's rollouts of `step` into the scratch (rank 0 writes); returns this process's."""
        all_rows = gather_object(rows)
        if self.accelerator.is_main_process:
            write_table(all_rows, self.path(step), "trajectories")
        return rows


class IterationTrainer:
    """The state of one iteration in one process: accelerator, policy, optimizer, rollout source and
    metrics log. With several processes and the HF engine, rollouts run on `rollout_model`, a full-weight copy of the
    policy refreshed before every step: generation through the sharded policy would need every
    process to run the same number of forward passes, which the processes' episodes do not. With
    `async: off_policy_1` (HF engine) too: the next step's rollouts are generated from that copy while
    the update changes the policy's own weights."""

    def __init__(self, accelerator: Any, settings: IterationSettings) -> None:
        from accelerate.utils import set_seed

        set_up = time.perf_counter()
        cfg, scratch, run, iteration = settings.cfg, settings.scratch, settings.run, settings.iteration
        self.accelerator, processes = accelerator, accelerator.num_processes
        self.settings, self.cfg, self.scratch = settings, cfg, scratch
        self.progress = settings.progress and self.accelerator.is_main_process
        with self.accelerator.main_process_first():  # rank 0 clears a stale scratch before the others look
            resumed = prepare_scratch(scratch, settings.key)
        set_seed(cfg.seed + iteration)
        model, self.tokenizer = load_policy(settings.init_model, cfg)
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                      fused=torch.cuda.is_available())
        # together: FSDP2 rebuilds the parameters, and the optimizer must hold the new ones
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        checkpoint = latest_checkpoint(scratch / "checkpoints")
        self.start_step = checkpoint.step if checkpoint is not None else 0
        if checkpoint is not None:
            self.accelerator.load_state(str(checkpoint.state_dir))
        elif settings.init_state is not None:
            self.accelerator.load_state(str(settings.init_state))
        self.metrics = MetricsLog(scratch / "metrics.parquet", run=run, stage=STAGE, iteration=iteration)
        self.metrics.resume(settings.global_step(self.start_step))
        if self.accelerator.is_main_process:
            # the job's start-up in two parts: this set-up (policy, optimizer, state), and all before it
            log.info("RL %s iteration %d on %d process(es) (%s)%s, %.1f s of it loading the policy and its state",
                     run, iteration, processes, self.accelerator.distributed_type, since_job_started(),
                     time.perf_counter() - set_up)
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
        """One step, in order: the rollout engine gets the policy's weights; this process's rollouts
        (saved, or generated and judged now); the update on them (rewards → returns → MRS/PRS and the
        other filters → advantages → PPO-clip, `train_on_rollouts`), with off_policy_1 the next step's
        rollouts generated meanwhile; metrics over every process's rows; the step's rows and a
        checkpoint in the scratch."""
        self.sync_rollout_weights(step)
        timed = TimedEvaluator(evaluator)
        self.engine.seconds = 0.0
        started = time.perf_counter()
        rows = self.rollouts.of_step(step, timed)
        rollout_s = time.perf_counter() - started
        self.seed_step_generators(step)
        with self.rollouts.ahead(step + 1, timed):
            train_started = time.perf_counter()
            values = train_on_rollouts(rows, self.cfg, self.accelerator, self.model, self.optimizer, self.tokenizer,
                                       self.filter_generator, self.shuffle_generator, self.progress, self.reference)
            train_s = time.perf_counter() - train_started
        release_cached_gpu_memory()
        all_rows = gather_object(rows)
        values.update(self.step_metrics(step, all_rows, timed, rollout_s, train_s, time.perf_counter() - started))
        self.save_step(step, all_rows, values)
        return values

    def sync_rollout_weights(self, step: int) -> None:
        """Give the rollout engine the policy's current weights: the HF rollout copy every step, vLLM's
        engine after the first (it loaded the iteration's initial model itself)."""
        policy = self.accelerator.unwrap_model(self.model)
        if self.rollout_model is not None:
            copy_full_weights(policy, self.rollout_model)
        if self.cfg.engine == "vllm" and step > 0:
            push_weights_to_vllm(self.raw_engine, policy)

    def seed_step_generators(self, step: int) -> None:
        """Seed the step's two random streams from the run's seed and global step, so a resumed step
        draws what the first attempt drew: PRS's coin flips, one stream per process (rank 0's is the
        one-process stream), and the mini-batches' shuffle, one stream for all."""
        global_step = self.settings.global_step(step)
        self.filter_generator.manual_seed(step_seed(self.cfg.seed + 1, global_step) + self.accelerator.process_index)
        self.shuffle_generator.manual_seed(step_seed(self.cfg.seed + 2, global_step))

    def step_metrics(self, step: int, all_rows: list[dict[str, Any]], timed: TimedEvaluator, rollout_s: float,
                     train_s: float, step_s: float) -> dict[str, float]:
        """The step's rollout metrics and times. The times are this process's (the step ends in
        collectives, so step_s is everyone's); gen_s and eval_s count whatever generation and evaluation
        ran during the step, overlap_s what running them alongside each other and the update saved
        against one after the other."""
        values = rollout_metrics(all_rows, self.cfg.max_turns)
        values.update(gen_s=self.engine.seconds, eval_s=timed.seconds, rollout_s=rollout_s, train_s=train_s,
                      step_s=step_s, overlap_s=self.engine.seconds + timed.seconds + train_s - step_s,
                      policy_lag=float(self.rollouts.policy_lag(step)), lr=self.cfg.lr, rows=float(len(all_rows)))
        return values

    def save_step(self, step: int, all_rows: list[dict[str, Any]], values: dict[str, float]) -> None:
        """The step's metrics and rows into the scratch, and a checkpoint unless it is the iteration's last
        step (finish writes that one's model and state)."""
        accelerator = self.accelerator
        self.metrics.log(self.settings.global_step(step) + 1, values)
        if accelerator.is_main_process:
            write_table(all_rows, self.scratch / f"step-{step:04d}.parquet", "trajectories")
            log.info("RL %s iteration %d step %d: reward %.3f, kept %.2f, grad norm %.3g", self.settings.run,
                     self.settings.iteration, step, values["reward_mean"], values["kept_frac"],
                     values.get("grad_norm", 0.0))
        if step + 1 < self.cfg.steps_per_iteration:
            if accelerator.is_main_process:
                self.metrics.flush()
            save_checkpoint(accelerator, self.model, self.tokenizer, self.scratch / "checkpoints", step + 1,
                            self.settings.key, keep_last=1)

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


def release_cached_gpu_memory() -> None:
    """Hand the update's cached blocks back: the next rollouts' evaluation children share this GPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def side_stream() -> Any:
    """A CUDA stream for a background thread's rollouts, ordered after the work queued so far (the
    rollout copy's weights); None without CUDA. Threads share the default stream, on which the
    rollouts' kernels would queue behind the update's instead of running beside them."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


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


def drop_optimizer_state(path: str | os.PathLike) -> None:
    """Delete an iteration's optimizer state once the next iteration has its own (Adam's
    moments are twice the model in fp32: one per iteration would fill any disk)."""
    shutil.rmtree(path, ignore_errors=True)

