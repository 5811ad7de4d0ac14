"""The rollouts of an RL step (paper §4.3, §6.1): which prompts, where a step's rollouts come from
(`RolloutSource`: saved, generated now, or generated ahead during the step before), the engine that
generates them (HF `generate` on the policy or an in-process vLLM engine) and the weight push that
feeds it the trainer's weights (in buckets; a sleeping engine woken around it: `feed_vllm`), the timing
wrappers behind the step's time split, and the rollouts' reward metrics. The episodes themselves run in
the one multi-turn loop, `kpipe.agent.run_episodes`; each turn's reward is `kpipe.train.algos.turn_reward`
of KernelGym's result.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from accelerate.utils import gather_object

from kpipe.agent.evaluator import Evaluator
from kpipe.agent.history import make_policy
from kpipe.agent.loop import AgentTask, Sampling, run_episodes
from kpipe.data import metrics as kmetrics
from kpipe.data.io import read_table, write_table
from kpipe.llm.types import ChatRequest, Completion, Engine, Message, ResultCallback, prompt_tokens
from kpipe.train.algos import turn_reward
from kpipe.train.batching import batch_indices
from kpipe.train.rl_config import IterationSettings, RLConfig

STAGE = "rl"
FAST_PS = (1.0, 1.2)


def step_tasks(tasks: Sequence[AgentTask], prompts_per_step: int, seed: int, global_step: int) -> list[AgentTask]:
    """The prompts of one global step: consecutive slices of a fresh permutation per epoch."""
    return [tasks[i] for i in batch_indices(len(tasks), min(prompts_per_step, len(tasks)), seed, global_step)]


def step_seed(seed: int, global_step: int) -> int:
    """Sampling seed of one step: every step draws new rollouts, a rerun draws the same ones."""
    return int(hashlib.sha256(f"rl:{seed}:{global_step}".encode()).hexdigest()[:8], 16)


def process_tasks(tasks: Sequence[AgentTask], rank: int, processes: int) -> list[AgentTask]:
    """The prompts of one process: every `processes`-th from `rank`, each with all its rollouts, so
    the (prompt, turn) groups of the advantages never straddle processes."""
    return list(tasks[rank::processes])


class TimedEngine:
    """An engine that adds up the wall time of its `generate` calls (the step's generation time)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = engine.model
        self.seconds = 0.0

    def prompt_tokens(self, chats: list[list[Message]]) -> list[int] | None:
        return prompt_tokens(self.engine, chats)

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


def rollout_rows(tasks: Sequence[AgentTask], engine: Any, evaluator: Any, cfg: RLConfig, *, run: str, iteration: int,
                 global_step: int, progress: bool) -> list[dict[str, Any]]:
    """The rollouts of one step: n episodes per prompt through the shared multi-turn loop, each turn
    judged while the engine decodes the others unless `async` is off."""
    sampling = Sampling(max_tokens=cfg.max_tokens_at(global_step), temperature=cfg.temperature, top_p=cfg.top_p,
                        logprobs=True)
    return run_episodes(
        tasks, engine, evaluator, make_policy(cfg.history, cfg.history_window), n_samples=cfg.rollouts_per_prompt,
        max_turns=cfg.max_turns, sampling=sampling,
        reward_fn=turn_reward(cfg.reward, cfg.use_pr, cfg.baseline, cfg.speedup_cap),
        run=run, stage=STAGE, iteration=iteration, seed=step_seed(cfg.seed, global_step),
        max_context_tokens=cfg.max_context_tokens, progress=progress, overlap=cfg.async_mode != "off",
    )


def rollout_metrics(rows: Sequence[dict[str, Any]], max_turns: int) -> dict[str, float]:
    """Reward statistics, hacking ratio and Fast@p of the rollouts (Fast@p at the last turn and best-of-history)."""
    rewards = np.array([float(row["reward"]) for row in rows])
    values = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
              "correct_frac": kmetrics.correct_rate([r["correct"] for r in rows], [r["hacked"] for r in rows]),
              "turns_mean": float(np.mean([r["turn"] for r in rows]))}
    if rows:  # Appendix C, kpipe's one definition (kmetrics.hacking_ratio): hacked turns / every generated turn
        values["hacking_ratio"] = kmetrics.hacking_ratio([r["hacked"] for r in rows])
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


def copy_full_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy the trainer's weights into the rollout copy, one tensor at a time. FSDP2-sharded
    tensors are all-gathered first (every process must call this), so the peak memory is one
    full tensor beyond the copy."""
    from torch.distributed.tensor import DTensor

    target_state = target.state_dict()
    with torch.no_grad():
        for name, value in source.state_dict().items():
            target_state[name].copy_(value.full_tensor() if isinstance(value, DTensor) else value)


# a push's bucket: the 512 MB of the colocated SGLang push in issue 63's anchors (verl's default is 2,048 MB)
PUSH_BUCKET_BYTES = 512 * 2**20


def _load_weights_on_vllm_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    # get_model(): the bare model under a CUDA-graph wrapper, in both the V1 and V2 model runners
    worker.model_runner.get_model().load_weights(weights=weights)


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights by HF name, whole: an FSDP2-sharded tensor is all-gathered as it comes (every
    process must walk them all, in the same order)."""
    from torch.distributed.tensor import DTensor

    for name, value in model.state_dict().items():
        yield name, (value.full_tensor() if isinstance(value, DTensor) else value).detach()


def weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                   budget_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive weights cast to `dtype` on their own device, grouped so that a bucket holds at most
    `budget_bytes` of them; a tensor larger than the budget travels alone (the 8B's embedding and head,
    1.2 GB each in bf16). The casts of one bucket at a time exist: its memory is the budget."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * dtype.itemsize
        if bucket and size + nbytes > budget_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.to(dtype)))
        size += nbytes
    if bucket:
        yield bucket


def push_weights_to_vllm(engine: Any, model: Any, bucket_bytes: int = PUSH_BUCKET_BYTES) -> int:
    """Copy the trainer's weights (fp32 or bf16, FSDP2-sharded or not) into an in-process vLLM engine, in
    buckets cast to the engine's dtype; returns the buckets sent. vLLM 0.26 and 0.33, V1 engine (their source:
    tests/test_vllm_api.py); run with 0.26 on one H200 for the 8B, from fp32 weights, in
    docs/gpu-results/paper_units.md (push_switch).

    Needs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before the engine is
    built), so `collective_rpc` calls the function on the worker object directly and the tensors are
    handed over without serialisation; `load_weights` takes HF parameter names. One RPC a bucket, not a
    tensor: the 8B has 399 tensors, and per-tensor calls are what made pushes slow elsewhere (issue 63's
    anchors). Beyond the engine's weights the push holds one bucket of casts (and under FSDP2 the tensor
    being gathered). The prefix cache holds KV of the old weights, so it is reset (host-side bookkeeping
    only, `vllm/v1/core/block_pool.py:761-790`: safe while the KV cache sleeps).
    """
    dtype = engine.llm.model_config.dtype  # LLM.model_config, vllm/entrypoints/llm.py:341
    buckets = 0
    for bucket in weight_buckets(full_weights(model), dtype, bucket_bytes):
        engine.llm.collective_rpc(_load_weights_on_vllm_worker, args=(bucket,))
        buckets += 1
    engine.llm.reset_prefix_cache()
    return buckets


def untimed(phase: str) -> contextlib.AbstractContextManager[None]:
    """No timer: `feed_vllm` outside an RL step."""
    return contextlib.nullcontext()


def wake_vllm(engine: Any, tag: str) -> None:
    """Give a sleeping engine back one memory tag. It takes the memory from the driver (`create_and_map`,
    vllm/device_allocator/cumem.py:283-307 in 0.26.0): blocks torch's allocator keeps cached (the trainer's
    freed activations, the push's casts) are not free to it, so they go first."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.wake_up(tag)


def feed_vllm(engine: Any, model: Any, timer: Callable[[str], contextlib.AbstractContextManager[None]] = untimed,
              bucket_bytes: int = PUSH_BUCKET_BYTES) -> None:
    """The trainer's weights into its colocated vLLM engine: a sleeping engine first takes back the memory of
    its weights, then the push, then the memory of its KV cache (the order that never holds the push's casts
    and the KV cache at once beside the trainer). `timer` times the phases ``sleep_wake`` and ``push``."""
    if "weights" in engine.asleep:
        with timer("sleep_wake"):
            wake_vllm(engine, "weights")
    with timer("push"):
        push_weights_to_vllm(engine, model, bucket_bytes)
    if "kv_cache" in engine.asleep:
        with timer("sleep_wake"):
            wake_vllm(engine, "kv_cache")


def vllm_engine_args(cfg: RLConfig, processes: int) -> dict[str, Any]:
    """`LLM(...)` arguments of the rollout engine. With several processes (``kpipe launch``) each
    builds its own engine on its GPU with ``distributed_executor_backend="external_launcher"``:
    vLLM joins the launcher's torch.distributed group (RANK, LOCAL_RANK from the environment) as
    independent data-parallel engines, TRL's colocate mode and verl's layout of one engine per GPU."""
    args: dict[str, Any] = {"gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
                            "logprobs_mode": "processed_logprobs", "max_model_len": cfg.max_context_tokens}
    if cfg.vllm_sleep:  # the CuMem allocator that lets it sleep (vllm/config/model.py:545-552)
        args["enable_sleep_mode"] = True
    if processes > 1:
        args["distributed_executor_backend"] = "external_launcher"
    return args


def make_engine(cfg: RLConfig, model: Any, tokenizer: Any, model_dir: Path, name: str, progress: bool,
                processes: int = 1) -> Any:
    """The rollout engine: HF generate on the live policy, or an in-process vLLM engine (one per process)."""
    if cfg.engine == "hf":
        from kpipe.llm.hf_engine import HFEngine

        return HFEngine(model, tokenizer, name=name, batch_size=cfg.generation_batch_size, seed=cfg.seed,
                        progress=progress)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kpipe.llm.vllm_engine import VLLMEngine, _require_vllm

    args = vllm_engine_args(cfg, processes)
    key, module = (repr(sorted(args.items())), cfg.seed), _require_vllm()
    live = _LIVE_VLLM
    if live.get("key") == key and live.get("module") is module:
        # a later iteration in the same process (``checks.gpu.rl_learns``, a notebook): the engine of
        # the first one, fed this iteration's policy, instead of a second engine beside it (vLLM does
        # not give an in-process engine's GPU memory back, so each would take another
        # `vllm_gpu_memory_utilization` of the GPU, and start-up again). Same tokenizer: one run.
        engine = live["engine"]
        feed_vllm(engine, model)
        engine.model = name
        return engine
    live.clear()
    engine = VLLMEngine(str(model_dir), name=name, seed=cfg.seed, **args)
    live.update(key=key, module=module, engine=engine)
    return engine


_LIVE_VLLM: dict[str, Any] = {}  # this process's in-process vLLM engine: key (its arguments), module, engine


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


def side_stream() -> Any:
    """A CUDA stream for a background thread's rollouts, ordered after the work queued so far (the
    rollout copy's weights); None without CUDA. Threads share the default stream, on which the
    rollouts' kernels would queue behind the update's instead of running beside them."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream
