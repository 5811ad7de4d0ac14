"""The paper run's unit costs at the 8B architecture (issue 54), on the GPUs present: what `kpipe plan
--cost` multiplies by the config's counts (config/cost_units.yaml, docs/cost.md). Qwen3-8B-Base's shapes
are built from its config (``kpipe.train.tiny_model``'s ``qwen3-8b`` preset), random weights: memory, time
and mechanics are real, learning is not measured.

    # vLLM installed into /tmp/site as docs/vllm-on-the-device.md says, then:
    export PYTHONPATH=$PWD/src:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \\
        VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu paper_units optimizer_numerics trainer   # one call, ~8 min
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu paper_units sft_long                     # one call alone, ~5 min
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu paper_units vllm_batch                   # one call, ~5 min
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu paper_units vllm_replay push_switch      # one call, ~8 min
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu paper_units gym_beside_vllm              # one call, ~6 min
    python -m checks.gpu paper_units --tiny                         # the same code on a nano model (CPU test)

``sft_long`` runs alone: with ``optimizer_numerics trainer`` (176 s on an H100 at a9dc40a, 510 planned) its 300 planned
seconds pass a call's 540, and its steps' limits could pass ten minutes. Back here, each call's folder is merged
into the one current report, every section naming its card, commit and date (``KEEPS_SECTIONS``)::

    python -m checks.gpu --combine CALL_DIR --out docs/gpu-results   # not `kpipe.infra.ledger add`: it refuses

Sections (each step under its own time limit, the report saved after each, so a cut-off run keeps what it
measured):

1. ``optimizer_numerics``: ``kpipe.train.trainer_memory.OffloadedAdamW`` (fp32 master on the GPU, then
   on the host) against ``torch.optim.AdamW`` on the GPU: 4 layers at full width, 3 steps at lr 1e-6 from
   the same weights and batch; the relative difference and the fraction of parameters moved.
2. ``trainer``: the 8B on one GPU, all 36 layers with the real 151,936-row embedding and head: full
   activation checkpointing, bf16 autocast, log-probs and entropy through the head in chunks
   (``kpipe.train.trainer_memory``), OffloadedAdamW with the memory plan the free GPU memory allows
   (``kpipe.train.trainer_memory.choose_memory_plan``: fp32 weights and gradients on an H200, bf16 ones with the fp32 master on the host on
   an H100). 5 steps of a 32,768-token micro-batch, then 5 of 8,192: peak GPU and host memory, tokens/s,
   MFU with causal attention counted (over 989 TFLOP/s bf16 dense), the optimizer step's seconds and copy
   GB/s.
3. ``sft_long``: SFT of the 8B as the ``trainer`` section builds it (its memory plan, full activation
   checkpointing) on one sample shaped like the paper's cold-start trajectories: 5 turns (a 1,024-token prompt,
   4,096-token answers, 512-token feedbacks, ~23.7K tokens in all), the sample and its assistant-only labels
   built by ``kpipe.train.samples.build_samples``, the model and optimizer by ``prepare_model_and_optimizer``,
   each of 5 steps ``kpipe.train.sft.train_step`` (the chunked loss, gradient clipping, the optimizer step):
   tokens/s, MFU, seconds a step and of its optimizer step, peak GPU and host memory.
4. ``vllm_batch``: vLLM with ``load_format="dummy"`` standalone (``vllm.LLM``, vLLM's defaults: its engine
   core in a process of its own) against kpipe's engine (``VLLMEngine`` with RL's arguments: the core in
   process, processed log-probs, a seed a request) on the same 256 chats of 1,024 prompt tokens, each
   decoding --batch-output-tokens with ``ignore_eos`` at the same gpu_memory_utilization: output tokens/s,
   their ratio (issue 63: within 15 %), the KV cache's capacity, each engine's start-up (the first from an
   empty vLLM compile cache). The paper's 8,192 tokens a turn are cut to fit the call.
5. ``vllm_replay``: kpipe's engine through 3 turns that keep the history (each prompt the previous prompt,
   its answer and a feedback), at a batch the KV cache holds whole: tokens/s a turn, the prefix cache's
   share of each prompt, the HBM-bandwidth efficiency each turn implies (the cost model's
   ``decode_bandwidth_efficiency``), prefill tokens/s, and the seconds a token at batch 1 and 4.
6. ``push_switch``: RL's colocated cycle with ``rl.vllm_sleep``, three times: sleep (level 2), the trainer
   claims the freed memory, wake for the weights, the bucketed push of the trainer's own weights (fp32 on
   the GPU where they fit beside the engine, else bf16), wake for the KV cache
   (``kpipe.train.rollouts.feed_vllm``): seconds of each, the memory a sleeping engine leaves, and MRS's
   agreement of the engine's log-probs with the trainer's after each push (``mismatch_keep`` at RLConfig's
   thresholds; before the first push, on the dummy weights, for contrast).
6. ``gym_beside_vllm``: KernelGym's timing beside vLLM on the same GPU. The bank's honest kernels of L2_76 (a
   GEMM with an epilogue) and L1_88 (GELU, at the bandwidth bound) at KernelBench's main sizes, each evaluated
   --gym-evaluations times through the run's pool (``GymPool``, the RL protocol) with no vLLM process, then
   beside kpipe's 8B engine (dummy weights, sleep mode, --gym-gpu-memory-utilization) in a process of its own:
   awake and idle, decoding a batch call after call, asleep at level 2. Candidate ms, speedup and eager ms
   (median, min, max), their drift from no vLLM, the engine's memory and its decode rate beside the gym; and
   which condition the RL run evaluates in (awake and idle: the in-process engine hands a turn's answers over
   only once it has decoded them all).

Every vLLM figure names its card; without vLLM (the CPU test) those sections say so and pass.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from checks.gpu.harness import ROOT, CheckFailed, Report, Section
from kpipe.llm.vllm_engine import VLLMEngine  # light: vLLM itself is imported when an engine is built

TITLE = "Unit costs of the paper's run at the 8B architecture: the one-GPU trainer and SFT, vLLM rollout, weight push"
# one current report of every section, each run on the card it needs (the trainer's on an H100, vLLM's on an H200):
# a run of some sections keeps the others (checks.gpu.harness, KEEPS_SECTIONS)
KEEPS_SECTIONS = True
H100_H200_BF16_DENSE_FLOPS = 989e12  # the published dense bf16 peak of both (SXM): MFU's denominator


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--tiny", action="store_true", help="a nano model and short lengths: the CPU test")
    parser.add_argument("--trainer-lengths", default="32768,8192",
                        help="micro-batch tokens the trainer section times, in order (rl.micro_batch_tokens: 32,768)")
    parser.add_argument("--trainer-steps", type=int, default=5, help="steps a micro-batch length (the first warms up)")
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="tokens a chunk of the LM head's log-probs")
    parser.add_argument("--step-limit-s", type=int, default=150, help="hard limit of each measured step")
    parser.add_argument("--sft-turns", type=int, default=5, help="sft_long: answers of the trajectory (the paper's 5)")
    parser.add_argument("--sft-prompt-tokens", type=int, default=1024, help="sft_long: tokens of the first prompt")
    parser.add_argument("--sft-answer-tokens", type=int, default=4096,
                        help="sft_long: tokens of each answer (5 x 4,096 + 1,024 + 4 x 512: ~24K tokens in all)")
    parser.add_argument("--sft-feedback-tokens", type=int, default=512, help="sft_long: tokens of each feedback")
    parser.add_argument("--sft-steps", type=int, default=5, help="sft_long: steps of one sample (the first warms up)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="vllm_batch's and vllm_replay's engines, each alone on the GPU (vLLM's default)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of a first-turn prompt (issue 63: 1K)")
    parser.add_argument("--batch", type=int, default=256, help="vllm_batch: sequences of the batch")
    parser.add_argument("--batch-output-tokens", type=int, default=1024,
                      help="vllm_batch: tokens each sequence decodes (the paper's 8,192 take ~6 min an engine)")
    parser.add_argument("--batch-engines", default="standalone,kpipe",
                        help="vllm_batch: the engines to run, in order (one alone: the paper's 8,192-token batch takes an "
                             "engine's whole call; the other engine's figures then come from the current report, where an "
                             "earlier call measured it at the same batch, vLLM and card)")
    parser.add_argument("--standalone-in-process", dest="standalone_multiprocessing", action="store_false",
                      help="vllm_batch: vLLM standalone with its engine core in process too (default: vLLM's default, "
                           "a process of its own)")
    parser.add_argument("--replay-batch", type=int, default=128, help="vllm_replay: sequences, fewer if the KV cache is short")
    parser.add_argument("--replay-answer-tokens", type=int, default=1024, help="vllm_replay: tokens of each turn's answer")
    parser.add_argument("--replay-feedback-tokens", type=int, default=512, help="vllm_replay: tokens of each feedback")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="vllm_replay: prompt tokens a sequence for prefill")
    parser.add_argument("--low-batch-tokens", type=int, default=256, help="vllm_replay: tokens decoded at batch 1 and 4")
    parser.add_argument("--switch-gpu-memory-utilization", type=float, default=0.6,
                      help="push_switch: the engine's share beside the trainer's weights")
    parser.add_argument("--cycles", type=int, default=3, help="push_switch: sleep, wake, push cycles")
    parser.add_argument("--push-bucket-mib", type=int, default=512, help="push_switch: bytes a bucket of the push")
    parser.add_argument("--agreement-sequences", type=int, default=8, help="push_switch: sequences MRS compares")
    parser.add_argument("--engine-limit-s", type=int, default=330,
                      help="limit of each step that starts an engine (start-up included)")
    parser.add_argument("--gym-evaluations", type=int, default=5,
                        help="gym_beside_vllm: evaluations of each task's kernel a condition")
    parser.add_argument("--gym-gpu-memory-utilization", type=float, default=0.35,
                        help="gym_beside_vllm: the engine's share beside KernelGym (rl.vllm_gpu_memory_utilization)")
    parser.add_argument("--gym-decode-batch", type=int, default=64,
                        help="gym_beside_vllm: sequences the engine decodes beside the evaluations")
    parser.add_argument("--gym-decode-tokens", type=int, default=256,
                        help="gym_beside_vllm: tokens a sequence of each of its generate calls")
    parser.add_argument("--gym-step-limit-s", type=int, default=90,
                        help="gym_beside_vllm: limit of a condition's evaluations and of each engine state change")
    parser.add_argument("--smoke-dir", default=str(ROOT),
                        help="rl_step: the checkout where the one-GPU smoke ran (its results/ and logs/)")
    parser.add_argument("--gym-engine-limit-s", type=int, default=150,
                        help="gym_beside_vllm: limit of the engine's start-up (its compile cache cold)")


class StepTimeout(Exception):
    """A step ran past its limit: the section records it and goes on."""


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """SIGALRM after `seconds`: one slow step must not take the call's other measurements with it."""
    def expire(signum: int, frame: Any) -> None:
        raise StepTimeout(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def step(report: Report, name: str, limit_s: int, measure: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """Run one measurement under its limit; its figures (or its error) go into the report, saved at once."""
    print(f"[paper_units] {name} (limit {limit_s} s) ...", flush=True)
    started = time.perf_counter()
    try:
        with time_limit(limit_s):
            figures = measure()
    except Exception as exc:  # noqa: BLE001 - the next step still runs
        report.row(name, f"ERROR {type(exc).__name__}: {str(exc)[:150]}", f"{time.perf_counter() - started:.1f}", ok=False)
        report.save()
        return None
    report.data[name] = figures
    report.row(name, json.dumps(rounded(figures), default=str), f"{time.perf_counter() - started:.1f}")
    report.save()
    print(f"[paper_units] {name}: {figures}", flush=True)
    return figures


def rounded(value: Any) -> Any:
    """Floats to 4 decimals, inside dicts and lists too: the report's rows (its JSON keeps them whole)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


def architecture(tiny: bool, layers: int | None = None) -> Any:
    """Qwen3-8B's config (or the nano preset for the CPU test), `layers` of its decoder layers."""
    from kpipe.train.tiny_model import tiny_config

    config = tiny_config("nano" if tiny else "qwen3-8b", vocab_size=259, eos_token_id=258, pad_token_id=256)
    if layers is None:
        return config
    fields = {**config.to_dict(), "num_hidden_layers": layers}
    fields.pop("layer_types", None)  # one entry a layer: rebuilt for the new count
    return type(config).from_dict(fields)


def device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def gpu_used_gib() -> float:
    """Memory in use on the GPU by every allocator (vLLM's KV cache included), not only torch's peak."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def training_flops(matmul_params: float, layers: int, attention_width: int, tokens: int) -> float:
    """One forward+backward of one causal sequence of `tokens`: 6 N t for the weights' matmuls plus causal
    attention, 6 L d t^2 (QK^T and AV, 4 d FLOPs a query-key pair forward, halved by the mask, tripled by
    the backward). Activation recomputation is not counted: MFU's convention (docs/gpu-results/sft.md)."""
    return 6.0 * matmul_params * tokens + 6.0 * layers * attention_width * tokens * tokens


def host_peak_gib() -> float:
    """This process's peak resident host memory (the page-locked optimizer state included)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def parameter_count(config: Any) -> int:
    """Parameters of an architecture, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        return Qwen3ForCausalLM(config).num_parameters()


def build_model(config: Any, dtype: Any) -> Any:
    """The model made directly on the device in `dtype` (an fp32 8B made in CPU memory first would take
    33 GB and a minute), with full activation checkpointing."""
    import torch
    from transformers import Qwen3ForCausalLM

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device()):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def forward_backward(model: Any, ids: Any, targets: Any, chunk_tokens: int) -> float:
    """One micro-batch: the decoder under bf16 autocast (no weight-cast cache: checkpointing recasts in
    the backward anyway), log-probs and entropy through the head in chunks, a policy-gradient-shaped
    loss (token mean of -log p, minus a small entropy bonus) and its backward. Returns the loss."""
    import torch

    from kpipe.train.trainer_memory import token_logprobs_and_entropy

    on_gpu = torch.cuda.is_available()
    with torch.autocast(device().type, dtype=torch.bfloat16, enabled=on_gpu, cache_enabled=False):
        hidden = model.model(input_ids=ids).last_hidden_state
    logprobs, entropy = token_logprobs_and_entropy(hidden, model.lm_head.weight, targets, chunk_tokens,
                                                   matmul_dtype=torch.bfloat16 if on_gpu else None)
    loss = -logprobs.mean() - 1e-3 * entropy.mean()
    loss.backward()
    return float(loss.detach())


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trainer(report: Report, args: argparse.Namespace) -> None:
    """The 8B trainer on one GPU, all 36 layers: 5 steps of a 32K micro-batch (then of an 8K one), each a
    forward+backward and an OffloadedAdamW step; peak GPU and host memory, tokens/s, MFU, the optimizer's
    seconds and copy GB/s."""
    import torch

    from kpipe.train.trainer_memory import MEMORY_PLANS, OffloadedAdamW, choose_memory_plan

    config = architecture(args.tiny)
    lengths = [64, 32] if args.tiny else [int(n) for n in args.trainer_lengths.split(",")]
    held: dict[str, Any] = {}
    # parameters of the architecture, counted before anything is built (the memory plan needs them)
    embedding = config.vocab_size * config.hidden_size
    params = parameter_count(config)
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else float("inf")
    plan = choose_memory_plan(params, 1, free, MEMORY_PLANS[1:])  # the 8B's 16 bytes a parameter fit no one GPU
    attention_width = config.num_attention_heads * config.head_dim
    report.line(f"All {config.num_hidden_layers} layers, {params / 1e9:.2f} B parameters ({config.vocab_size:,}-row "
                f"untied embedding and head), random weights. Memory plan `{plan.name}` (free GPU memory "
                f"{free / 2**30:.0f} GiB; kpipe.train.trainer_memory.choose_memory_plan): "
                f"{plan.gpu_bytes_per_param} bytes a parameter of weights and gradients on the GPU, "
                f"{plan.host_bytes_per_param} in page-locked host memory ({plan.optimizer}). Full "
                f"activation checkpointing, bf16 autocast, log-probs and entropy in chunks of "
                f"{args.chunk_tokens} tokens (kpipe.train.trainer_memory). MFU = tokens/s x (6 N + 6 L d t) / "
                f"989 TFLOP/s with N the matmul parameters (the embedding is a lookup), d = {attention_width}.")
    report.table("step", "figures", "wall s")

    def build() -> dict[str, Any]:
        reset_peak()
        started = time.perf_counter()
        held["model"] = build_model(config, torch.float32 if plan.name == "fp32" else torch.bfloat16)
        built = time.perf_counter()
        held["optimizer"] = OffloadedAdamW(held["model"].parameters(), lr=1e-6, weight_decay=0.01,
                                           master_on_host=plan.name == "bf16")
        synchronize()
        return {"plan": plan.name, "parameters": params, "model_build_s": built - started,
                "optimizer_build_s": time.perf_counter() - built,
                "host_state_pinned": held["optimizer"].host_state.is_pinned(), "host_state_gib":
                held["optimizer"].host_state.numel() * 4 / 2**30, "gpu_peak_gib": peak_gib(),
                "host_peak_gib": host_peak_gib()}

    def train(tokens: int) -> dict[str, Any]:
        model, optimizer = held["model"], held["optimizer"]
        generator = torch.Generator().manual_seed(tokens)
        forward_s, optimizer_s, losses = [], [], []
        for _ in range(args.trainer_steps):
            ids = torch.randint(0, config.vocab_size, (1, tokens), generator=generator).to(device())
            targets = torch.randint(0, config.vocab_size, (1, tokens), generator=generator).to(device())
            started = time.perf_counter()
            losses.append(forward_backward(model, ids, targets, args.chunk_tokens))
            synchronize()
            stepped = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize()
            forward_s.append(stepped - started)
            optimizer_s.append(time.perf_counter() - stepped)
        timed = forward_s[1:] or forward_s  # the first step warms up kernels and the allocator
        forward_backward_s = sum(timed) / len(timed)
        optimizer_step_s = sum(optimizer_s[1:] or optimizer_s) / len(optimizer_s[1:] or optimizer_s)
        flops = training_flops(params - embedding, config.num_hidden_layers, attention_width, tokens)
        return {"tokens": tokens, "steps": args.trainer_steps, "forward_backward_s": forward_backward_s,
                "tokens_per_s": tokens / forward_backward_s,
                "mfu": flops / forward_backward_s / H100_H200_BF16_DENSE_FLOPS,
                "optimizer_step_s": optimizer_step_s,
                "optimizer_copy_gb_per_s": optimizer.last_step_bytes / optimizer_step_s / 1e9,
                "tokens_per_s_with_an_optimizer_step_each": tokens / (forward_backward_s + optimizer_step_s),
                "losses": [round(loss, 4) for loss in losses], "gpu_peak_gib": peak_gib(),
                "host_peak_gib": host_peak_gib()}

    if step(report, "trainer_build", args.step_limit_s, build) is None:
        return
    for tokens in lengths:
        step(report, f"trainer_{tokens}", args.step_limit_s, lambda: train(tokens))
    held.clear()
    import gc

    gc.collect()
    reset_peak()


def optimizer_numerics(report: Report, args: argparse.Namespace) -> None:
    """OffloadedAdamW against torch.optim.AdamW on the GPU, 3 steps at lr 1e-6 from the same weights and
    batch, on 4 layers at the 8B's width (issue 63: <= 1e-6 relative, >= 99 % of parameters moved)."""
    import gc

    import torch

    from kpipe.train.trainer_memory import OffloadedAdamW

    config = architecture(args.tiny, 1 if args.tiny else 4)
    tokens = 32 if args.tiny else 512
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    report.line(f"{config.num_hidden_layers} layers at full width, fp32 weights (no autocast), one batch of "
                f"{tokens} tokens, 3 steps at lr 1e-6, weight decay 0.01. Relative difference = max |a - b| / "
                f"max |b| over each parameter, the worst one; moved = parameters whose fp32 master changed, "
                f"of those with a gradient (embedding rows of tokens absent from the batch have none).")
    report.table("step", "figures", "wall s")
    initial: list[Any] = []
    held: dict[str, Any] = {}

    def run(make_optimizer: Callable[[Any], Any]) -> tuple[list[Any], list[Any]]:
        """(final parameters, final fp32 master) on the host after 3 steps."""
        torch.manual_seed(0)
        model = build_model(config, torch.float32)
        model.gradient_checkpointing_disable()
        if not initial:
            initial.extend(p.detach().to("cpu", copy=True) for p in model.parameters())
        optimizer = make_optimizer(model)
        for _ in range(3):
            model(input_ids=ids.to(device()), labels=ids.to(device())).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        final = [p.detach().to("cpu", copy=True) for p in model.parameters()]
        master = [p.detach().to("cpu", copy=True) for p in getattr(optimizer, "master_weights", lambda: final)()]
        del model, optimizer
        gc.collect()
        reset_peak()
        return final, master

    def relative(got: list[Any], expected: list[Any]) -> float:
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, expected))

    def compare(master_on_host: bool) -> dict[str, Any]:
        if "reference" not in held:
            held["reference"] = run(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01))[0]
        final, master = run(lambda model: OffloadedAdamW(model.parameters(), lr=1e-6, weight_decay=0.01,
                                                         master_on_host=master_on_host))
        moved = sum(int((now != before).sum()) for now, before in zip(master, initial))
        reference = held["reference"]
        reference_moved = sum(int((now != before).sum()) for now, before in zip(reference, initial))
        # embedding rows of tokens absent from the batch get no gradient, and weight decay's 1 - 1e-8 is
        # below fp32's resolution: they move under neither optimizer, so they are not counted as trained
        untrained = (config.vocab_size - int(ids.unique().numel())) * config.hidden_size
        trained = sum(before.numel() for before in initial) - untrained
        return {"master_on_host": master_on_host, "relative_difference": relative(final, reference),
                "master_relative_difference": relative(master, reference), "moved_fraction": moved / trained,
                "adamw_moved_fraction": reference_moved / trained, "embedding_rows_without_gradient":
                untrained // config.hidden_size}

    for master_on_host in (False, True):
        figures = step(report, f"offloaded_vs_adamw_master_on_{'host' if master_on_host else 'gpu'}",
                       args.step_limit_s, lambda: compare(master_on_host))
        if figures:
            report.expect(figures["relative_difference"] <= 1e-6 and figures["moved_fraction"] >= 0.99,
                          f"OffloadedAdamW (master on {'host' if master_on_host else 'gpu'}) within 1e-6 of AdamW "
                          f"and >= 99 % of parameters moved")
    held.clear()
    initial.clear()
    gc.collect()


def trajectory_messages(prompt_tokens: int, answer_tokens: int, feedback_tokens: int, turns: int,
                        seed: int = 0) -> list[dict[str, str]]:
    """A cold-start trajectory's conversation (the paper's "8K 5-turn trajectories" at their longest): a prompt,
    then `turns` answers with a feedback between each two. Byte-token contents (a character a token), every
    message different, so that each assistant message is found once in the render (kpipe.train.samples)."""
    import random

    draw = random.Random(f"sft_long:{seed}")

    def content(tokens: int) -> str:
        return "".join(draw.choices(ASCII_LETTERS, k=tokens))

    messages = [{"role": "user", "content": content(prompt_tokens)}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": content(feedback_tokens)})
        messages.append({"role": "assistant", "content": content(answer_tokens)})
    return messages


def trajectory_sample(tokenizer: Any, messages: list[dict[str, str]], max_length: int) -> Any:
    """The SFT sample of one trajectory as SFT builds it (kpipe.train.samples.build_samples, unit
    ``trajectory``, the paper preset's: the last turn's context and answer, the loss on every assistant message)."""
    from kpipe.train.samples import build_samples

    row = {"run": "paper_units", "stage": "cold_start", "iteration": 0, "task_id": "sft_long", "sample": 0,
           "turn": sum(message["role"] == "assistant" for message in messages),
           "prompt_messages": messages[:-1], "response": messages[-1]["content"]}
    samples, built = build_samples([row], tokenizer, max_length, unit="trajectory")
    if not samples:
        raise ValueError(f"the trajectory gave no SFT sample: {built.as_dict()}")
    return samples[0]


def sft_long(report: Report, args: argparse.Namespace) -> None:
    """SFT of the 8B on one GPU on a 5-turn trajectory of ~24K tokens (issue 63), through SFT's own code: the
    sample and its assistant-only labels from kpipe.train.samples, the model and optimizer prepared as
    `train_sft` prepares them, each step `kpipe.train.sft.train_step` (the chunked loss `micro_batch_loss`,
    gradient clipping, the optimizer and scheduler steps): tokens/s, MFU, seconds a step and of its
    optimizer step, peak GPU and host memory."""
    import torch
    from accelerate import Accelerator

    from kpipe.train.batching import resolve_precision
    from kpipe.train.sft import PRESETS, predicted_tokens, train_step
    from kpipe.train.tiny_model import byte_tokenizer_for
    from kpipe.train.trainer_memory import MEMORY_PLANS, choose_memory_plan, prepare_model_and_optimizer, weights_dtype

    paper = PRESETS["paper"]
    config = architecture(args.tiny)
    lengths = (16, 24, 8) if args.tiny else (args.sft_prompt_tokens, args.sft_answer_tokens, args.sft_feedback_tokens)
    params = parameter_count(config)
    head = config.vocab_size * config.hidden_size
    decoder = params - head * (1 if config.tie_word_embeddings else 2)  # the embedding is a lookup
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else float("inf")
    plan = choose_memory_plan(params, 1, free, MEMORY_PLANS[1:])  # as the trainer section: 16 bytes fit no one GPU
    attention_width = config.num_attention_heads * config.head_dim
    held: dict[str, Any] = {}
    report.line(f"The paper preset's SFT (kpipe.train.sft PRESETS['paper']: lr {paper.lr}, grad clip "
                f"{paper.grad_clip}, unit `{paper.unit}`) on one trajectory of {args.sft_turns} turns: a "
                f"{lengths[0]:,}-token prompt, {lengths[1]:,}-token answers, {lengths[2]:,}-token feedbacks (byte "
                f"tokens, ChatML), the loss on the assistant messages only. All {config.num_hidden_layers} layers, "
                f"{params / 1e9:.2f} B parameters, random weights, built as the trainer section builds them (full "
                f"activation checkpointing); memory plan `{plan.name}` (free GPU memory {free / 2**30:.0f} GiB; "
                f"choose_memory_plan), prepared by `prepare_model_and_optimizer`; each step one sample through "
                f"`kpipe.train.sft.train_step` with log-probs in chunks of {args.chunk_tokens} tokens. The first "
                f"step warms up. tokens/s = the sample's tokens over a step less its optimizer step (one in "
                f"{paper.batch_size} samples at the paper's batch); MFU = (6 N_decoder t + 6 L d t^2 + 6 N_head "
                f"t_labelled) / s / 989 TFLOP/s (the head's logits are computed at labelled positions only).")
    report.table("step", "figures", "wall s")

    def sample() -> dict[str, Any]:
        tokenizer = byte_tokenizer_for("nano" if args.tiny else "qwen3-8b")
        messages = trajectory_messages(*lengths, args.sft_turns)
        held["sample"], held["pad_id"] = trajectory_sample(tokenizer, messages, paper.max_length), tokenizer.pad_token_id
        built = held["sample"]
        return {"turns": args.sft_turns, "messages": len(messages), "tokens": len(built.input_ids),
                "label_tokens": built.n_label_tokens, "predicted_tokens": predicted_tokens([built])}

    def build() -> dict[str, Any]:
        reset_peak()
        started = time.perf_counter()
        model = build_model(config, weights_dtype(plan))
        built = time.perf_counter()
        accelerator = Accelerator(mixed_precision=resolve_precision(paper.mixed_precision))
        model, optimizer = prepare_model_and_optimizer(accelerator, model, plan, paper.lr, paper.betas,
                                                       paper.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # the peak lr: no schedule timed
        held.update(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler)
        synchronize()
        return {"plan": plan.name, "parameters": params, "mixed_precision": accelerator.mixed_precision,
                "model_build_s": built - started, "optimizer_build_s": time.perf_counter() - built,
                "gpu_peak_gib": peak_gib(), "host_peak_gib": host_peak_gib()}

    def train() -> dict[str, Any]:
        built, optimizer = held["sample"], held["optimizer"]
        marks: list[float] = []

        def mark(*_: Any) -> None:  # before and after each optimizer step, inside train_step
            synchronize()
            marks.append(time.perf_counter())

        hooks = [optimizer.register_step_pre_hook(mark), optimizer.register_step_post_hook(mark)]
        reset_peak()
        try:
            steps = [train_step(held["accelerator"], held["model"], optimizer, held["scheduler"], [built], [0],
                                len(built.input_ids), paper.grad_clip, held["pad_id"], args.chunk_tokens)
                     for _ in range(args.sft_steps)]
        finally:
            for hook in hooks:
                hook.remove()
        optimizer_s = [end - start for start, end in zip(marks[::2], marks[1::2])]
        timed = slice(1, None) if args.sft_steps > 1 else slice(None)  # the first step warms up
        step_s = sum(s["step_s"] for s in steps[timed]) / len(steps[timed])
        optimizer_step_s = sum(optimizer_s[timed]) / len(optimizer_s[timed])
        tokens, labelled = len(built.input_ids), predicted_tokens([built])
        flops = (training_flops(decoder, config.num_hidden_layers, attention_width, tokens)
                 + 6.0 * head * labelled)
        return {"tokens": tokens, "label_tokens": labelled, "steps": args.sft_steps, "step_s": step_s,
                "optimizer_step_s": optimizer_step_s, "tokens_per_s": tokens / (step_s - optimizer_step_s),
                "mfu": flops / (step_s - optimizer_step_s) / H100_H200_BF16_DENSE_FLOPS,
                "tokens_per_s_with_an_optimizer_step_each": tokens / step_s,
                "losses": [round(s["loss"], 4) for s in steps], "grad_norms": [round(s["grad_norm"], 4) for s in steps],
                "gpu_peak_gib": peak_gib(), "host_peak_gib": host_peak_gib(), "card": card()}

    if step(report, "sft_sample", args.step_limit_s, sample) is None:
        return
    if step(report, "sft_build", args.step_limit_s, build) is None:
        return
    step(report, "sft_train", args.step_limit_s, train)
    held.clear()
    import gc

    gc.collect()
    reset_peak()


def save_architecture(out: Path, tiny: bool) -> Path:
    """Config and byte tokenizer only: vLLM's `load_format="dummy"` makes random weights of the shapes."""
    from kpipe.train.tiny_model import byte_tokenizer_for, tiny_config

    size = "nano" if tiny else "qwen3-8b"
    tokenizer = byte_tokenizer_for(size)  # 151,936 ids that all decode at 8B
    config = tiny_config(size, len(tokenizer), tokenizer.eos_token_id,
                         tokenizer.pad_token_id)
    config.torch_dtype = "bfloat16"
    config.architectures = ["Qwen3ForCausalLM"]  # without it vLLM resolves the base model, a pooling one
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- vLLM at the 8B's shapes
# Each engine of `vllm_batch` and `vllm_replay` runs in a Python process of its own (`run_engine_child`): an
# in-process engine gives its GPU memory back only when its process ends, and two engines at the same
# gpu_memory_utilization cannot share one GPU. `push_switch` runs in this process: the push hands the trainer's
# tensors to the engine in process, and vLLM's sleep allocator serves one engine a process
# (vllm/v1/worker/gpu_worker.py:264-269 in 0.26.0).

CHILD_SKIP = "vLLM is not installed here: section skipped (the device installs it, docs/vllm-on-the-device.md)."
ASCII_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:()[]{}=+-*/"
_started_engines: list[str] = []  # engines started by this check's processes: the first found vLLM's compile cache empty


def vllm_version() -> str | None:
    """vLLM's version, or None where it is not installed (the CPU test): the section then says so."""
    try:
        import vllm
    except ImportError:
        return None
    return str(vllm.__version__)


def card() -> str:
    """The GPU a figure comes from (every vLLM figure names it: reports of several calls are combined)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


@functools.cache
def model_dir(tiny: bool) -> tuple[Path, int]:
    """The saved architecture (config and byte tokenizer, no weights: vLLM's `load_format="dummy"`) and the
    tokens the chat template adds around one user message (a prompt of n tokens has n - that of content)."""
    from transformers import AutoTokenizer

    work = tempfile.mkdtemp(prefix="kpipe-paper-units-")
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    path = save_architecture(Path(work) / "qwen3-8b", tiny)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True)
    return path, len(tokenizer(text, add_special_tokens=False)["input_ids"])


@functools.cache
def vllm_cache_root() -> str:
    """An empty vLLM cache (its torch.compile artifacts) for this check and its children: the first engine's
    start-up is a fresh machine's, as the compile caches of `checks.gpu.harness.cold_caches` are."""
    path = tempfile.mkdtemp(prefix="cold-vllm-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def batch_messages(count: int, content_tokens: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` one-message chats of `content_tokens` byte tokens each (the byte tokenizer: a token a byte),
    different from one another so that no prompt is served from another's prefix cache."""
    import random

    return [[{"role": "user", "content": "".join(random.Random(f"{seed}:{i}").choices(ASCII_LETTERS, k=content_tokens))}]
            for i in range(count)]


def replay_contexts(prompt: int, answer: int, feedback: int, turns: int) -> list[tuple[int, float]]:
    """(prompt tokens, mean context while decoding) of each turn of a replay that keeps the history: turn t's
    prompt is turn t-1's prompt, its answer and a feedback; every answer is `answer` tokens (ignore_eos)."""
    prompts = [prompt + t * (answer + feedback) for t in range(turns)]
    return [(p, p + answer / 2) for p in prompts]


def fitting_batch(requested: int, kv_capacity_tokens: int, final_context: int) -> int:
    """The largest batch up to `requested` whose sequences all fit the KV cache at their final context (none
    preempted: a preempted sequence's recomputation would be timed as decoding)."""
    return max(1, min(requested, kv_capacity_tokens // final_context))


def trainer_weights_dtype(total_bytes: float, engine_fraction: float, params: float) -> str:
    """The dtype of the trainer's own weights beside an awake engine: fp32 (the paper's master weights) when
    they fit with the engine's share and 6 GiB of working memory, else bf16 (an H100's memory plan, the fp32
    master on the host: kpipe.train.trainer_memory's ``bf16`` plan)."""
    return "fp32" if params * 4 + engine_fraction * total_bytes + 6 * 2**30 <= total_bytes else "bf16"


def gpu_kind(name: str) -> str | None:
    """config/cost_units.yaml's GPU kind of a device name (``NVIDIA H200`` -> ``h200``), None if it has none."""
    from kpipe.infra.ledger import device_label

    kind = device_label(name, 1).lower()
    return kind if kind in ("h100", "h200") else None


def bandwidth_efficiency(tokens_per_s: float, batch: int, context: float, config: Any, name: str) -> float | None:
    """The unit `decode_bandwidth_efficiency` a decode rate of the architecture `config` implies on the card
    `name` (kpipe.report.cost), None on a card the units file does not know."""
    from kpipe.report.cost import implied_bandwidth_efficiency, kv_bytes_per_token, load_units

    kind = gpu_kind(name)
    if kind is None:
        return None
    units = load_units(ROOT / "config" / "cost_units.yaml")
    kv = kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads * config.head_dim)
    return implied_bandwidth_efficiency(tokens_per_s, batch, context, parameter_count(config) * 2, kv,
                                        units.gpu_kinds[kind]["hbm_bytes_per_s"].value)


def run_engine_child(task: str, spec: dict[str, Any], multiprocessing: bool) -> dict[str, Any]:
    """`task` of `CHILD_TASKS` in a new Python process (this module as ``__main__``). Stopped by the step's
    limit or a SIGTERM (``timeout`` around the call), it goes with its own children (vLLM's multiprocess engine
    core): an engine left behind would hold the GPU. It stays in this process group, so a kill of the group
    takes it too. `multiprocessing`: vLLM's default engine core in a process of its own, or kpipe's, in process."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
           "VLLM_CACHE_ROOT": vllm_cache_root()}
    with tempfile.TemporaryDirectory(prefix="kpipe-engine-child-") as scratch:
        spec_path, result_path = Path(scratch) / "spec.json", Path(scratch) / "result.json"
        spec_path.write_text(json.dumps({**spec, "task": task, "result": str(result_path),
                                         "cold": not _started_engines}))
        _started_engines.append(task)

        def terminated(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, terminated)
        child = subprocess.Popen([sys.executable, "-m", "checks.gpu.paper_units", str(spec_path)], cwd=ROOT, env=env)
        try:
            code = child.wait()
        except BaseException:  # StepTimeout, SIGTERM, Ctrl-C
            stop_process_tree(child.pid)
            child.wait()
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        if code != 0:
            raise RuntimeError(f"the {task} engine's process exited {code} (its log is above)")
        return json.loads(result_path.read_text())


def stop_process_tree(pid: int) -> None:
    """Kill the process `pid` started and every process under it, by id."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for process in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


# issue 63's vLLM targets, held where the batch decodes the paper's 8,192-token turns
PAPER_TURN_TOKENS = 8192
STANDALONE_TARGET_TOKENS_PER_S = 3000
KV_CAPACITY_TARGET_TOKENS = 700_000


def vllm_batch(report: Report, args: argparse.Namespace) -> None:
    """vLLM standalone (`vllm.LLM` as vLLM sets it up by default: its engine core in a process of its own) and
    kpipe's engine (`VLLMEngine` with RL's arguments: engine core in process, processed log-probs, a seed a
    request) on the same batch of chats at the same gpu_memory_utilization: output tokens/s, the ratio, the
    KV cache's capacity and each engine's start-up."""
    version = vllm_version()
    if version is None:
        report.line(CHILD_SKIP)
        return
    from kpipe.train.rl_config import RLConfig

    path, template = model_dir(args.tiny)
    prompt, batch, output = (32, 8, 16) if args.tiny else (args.prompt_tokens, args.batch, args.batch_output_tokens)
    spec = {"model": str(path), "tiny": args.tiny, "utilization": args.gpu_memory_utilization,
            "max_model_len": 2048 if args.tiny else RLConfig().max_context_tokens, "batch": batch,
            "content_tokens": prompt - template, "output_tokens": output}
    report.line(f"vLLM {version} on {card()}, dummy weights of the architecture, gpu_memory_utilization "
                f"{args.gpu_memory_utilization}, max_model_len {spec['max_model_len']:,}: {batch} chats of {prompt:,} "
                f"prompt tokens -> {output:,} tokens each (ignore_eos)." + (
                    f" The paper's turn is up to {PAPER_TURN_TOKENS:,} tokens; at 256 sequences that is 2.4M tokens of "
                    f"context, three times an H200's KV cache, and ~6 minutes an engine: cut to {output:,} so that both "
                    f"engines fit one call (--batch-output-tokens)." if output < PAPER_TURN_TOKENS else
                    f" The paper's turn: issue 63's targets ({STANDALONE_TARGET_TOKENS_PER_S:,} output tokens/s standalone, "
                    f"a KV cache of {KV_CAPACITY_TARGET_TOKENS:,} tokens) are held."))
    report.table("step", "figures", "wall s")
    engines = args.batch_engines.split(",")
    unknown = set(engines) - {"standalone", "kpipe"}
    if unknown:
        raise CheckFailed(f"--batch-engines: unknown engine(s) {', '.join(sorted(unknown))} (standalone, kpipe)")
    measured_on = batch_key(spec, version, card())
    report.data.update(batch_key=measured_on, engines={})
    standalone = kpipe = None
    if "standalone" in engines:
        standalone = step(report, "standalone", args.engine_limit_s,
                          lambda: run_engine_child("batch", {**spec, "engine": "standalone"}, args.standalone_multiprocessing))
    if "kpipe" in engines:
        kpipe = step(report, "kpipe_engine", args.engine_limit_s,
                     lambda: run_engine_child("batch", {**spec, "engine": "kpipe"}, False))
    report.data["engines"] = {name: figures for name, figures in (("standalone", standalone), ("kpipe", kpipe)) if figures}
    for name, figures in (("standalone", standalone), ("kpipe", kpipe)):
        if figures is None and name not in engines:  # the other engine of a batch split over two calls
            figures = earlier_batch_engine(RESULTS_JSON, name, measured_on)
            if figures is not None:
                report.data["engines"][name] = figures
                report.row(f"{name} (an earlier call: {figures['measured']})", json.dumps(figures)[:200], "-")
                standalone, kpipe = (figures, kpipe) if name == "standalone" else (standalone, figures)
    if standalone and output >= PAPER_TURN_TOKENS:  # issue 63's targets hold at the paper's turn
        report.expect(standalone["output_tokens_per_s"] >= STANDALONE_TARGET_TOKENS_PER_S,
                      f"vLLM standalone at {STANDALONE_TARGET_TOKENS_PER_S:,} output tokens/s or more on the "
                      f"{output:,}-token batch")
        report.expect(standalone["kv_capacity_tokens"] >= KV_CAPACITY_TARGET_TOKENS,
                      f"a KV cache of {KV_CAPACITY_TARGET_TOKENS:,} tokens or more")
    if standalone and kpipe:
        ratio = kpipe["output_tokens_per_s"] / standalone["output_tokens_per_s"]
        report.data["comparison"] = {"kpipe_vs_standalone": ratio, "card": card()}
        report.line("", f"kpipe's engine at {ratio:.2f} x standalone's output tokens/s (issue 63: within 15 %).")
        report.expect(ratio >= 0.85, "kpipe's engine within 15 % of vLLM standalone")


# the check's current report in the repository: a batch split over two calls finds its other engine there
RESULTS_JSON = ROOT / "docs" / "gpu-results" / "paper_units.json"


def batch_key(spec: dict[str, Any], version: str, here: str) -> dict[str, Any]:
    """What makes two engines' runs of vllm_batch comparable: the batch, the lengths, the memory setting, vLLM's
    version and the card (not the model's path, which is the machine's)."""
    return {**{key: value for key, value in spec.items() if key != "model"}, "vllm": version, "card": here}


def earlier_batch_engine(results: Path, engine: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """`engine`'s figures from the vllm_batch section of the report at `results`, where an earlier call measured it
    with the same ``batch_key`` (None otherwise), with when and at which commit (`measured`). The paper's
    8,192-token turn takes about 6 minutes an engine, so ``--batch-engines standalone`` and then
    ``--batch-engines kpipe`` each fit a ten-minute call, the second compared with the first."""
    if not results.exists():
        return None
    section = json.loads(results.read_text()).get("sections", {}).get("vllm_batch", {})
    data, facts = section.get("data", {}), section.get("facts", {})
    figures = data.get("engines", {}).get(engine)
    if figures is None or data.get("batch_key") != key:
        return None
    return {**figures, "measured": f"commit {facts.get('commit', '?')}, {facts.get('date', '?')}"}


def vllm_replay(report: Report, args: argparse.Namespace) -> None:
    """kpipe's engine through 3 turns that keep the history (turn t's prompt = turn t-1's prompt, its answer and
    a feedback): tokens/s a turn at a batch the KV cache holds whole, the prefix cache's share of each prompt,
    the unit decode_bandwidth_efficiency each turn implies, prefill tokens/s, and the seconds a token at batch
    1 and 4 (the longest answer's floor)."""
    version = vllm_version()
    if version is None:
        report.line(CHILD_SKIP)
        return
    from kpipe.train.rl_config import RLConfig

    path, _ = model_dir(args.tiny)
    sizes = (32, 16, 8, 8, 4) if args.tiny else (args.prompt_tokens, args.replay_answer_tokens,
                                                  args.replay_feedback_tokens, args.replay_batch, args.low_batch_tokens)
    prompt, answer, feedback, batch, low_tokens = sizes
    spec = {"model": str(path), "tiny": args.tiny, "utilization": args.gpu_memory_utilization,
            "max_model_len": 2048 if args.tiny else RLConfig().max_context_tokens, "batch": batch,
            "contexts": replay_contexts(prompt, answer, feedback, 3), "answer_tokens": answer,
            "feedback_tokens": feedback, "low_batch_tokens": low_tokens,
            "prefill_tokens": 64 if args.tiny else args.prefill_tokens}
    report.line(f"vLLM {version} on {card()}, kpipe's engine (`VLLMEngine`, RL's arguments, a seed a request), "
                f"dummy weights, gpu_memory_utilization {args.gpu_memory_utilization}. Prompts are token ids (the "
                f"byte tokenizer would re-encode a sampled token as 2-3 bytes), so contexts are exact: {prompt:,} "
                f"prompt tokens, {answer:,}-token answers (ignore_eos), {feedback}-token feedbacks; up to {batch} "
                f"sequences, fewer if the KV cache cannot hold them all at turn 3. Efficiency: the fraction of "
                f"the card's HBM bandwidth (config/cost_units.yaml) at which a step reads the bf16 weights and "
                f"every sequence's KV cache (kpipe.report.cost.implied_bandwidth_efficiency).")
    report.table("step", "figures", "wall s")
    replay = step(report, "replay", args.engine_limit_s, lambda: run_engine_child("replay", spec, False))
    if replay is None:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    for turn in replay["turns"]:
        turn["bandwidth_efficiency"] = bandwidth_efficiency(turn["output_tokens_per_s"], replay["batch"],
                                                            turn["mean_context"], config, replay["card"])
    report.save()
    report.line("", "| turn | prompt tokens | of them in the prefix cache | decode tokens/s | bandwidth efficiency |",
                "|---|---|---|---|---|")
    for number, turn in enumerate(replay["turns"], 1):
        efficiency = turn["bandwidth_efficiency"]
        report.line(f"| {number} | {turn['prompt_tokens']:,} | {turn['cached_prompt_tokens_mean']:,.0f} | "
                    f"{turn['output_tokens_per_s']:,.0f} | {'-' if efficiency is None else f'{efficiency:.2f}'} |")
    low = ", ".join(f"{item['seconds_per_token'] * 1e3:.1f} ms at batch {item['batch']}" for item in replay["low_batch"])
    report.line("", f"{replay['batch']} sequences (KV cache {replay['kv_capacity_tokens']:,} tokens); prefill "
                f"{replay['prefill']['prefill_tokens_per_s']:,.0f} tokens/s; a token at turn 3's context: {low}.")


def push_switch(report: Report, args: argparse.Namespace) -> None:
    """The colocated cycle of RL with `rl.vllm_sleep`, three times: the engine sleeps (level 2), the trainer
    claims the memory, the engine wakes for its weights, takes the bucketed push of the trainer's own weights
    (fp32 where they fit beside the engine, else bf16) and wakes for its KV cache (kpipe.train.rollouts.feed_vllm);
    then MRS's agreement of its log-probs with the trainer's on sampled sequences. Before the first push the
    same agreement on the engine's dummy weights shows what a missed push looks like."""
    version = vllm_version()
    if version is None:
        report.line(CHILD_SKIP)
        return
    import gc

    import torch
    from transformers import AutoConfig

    from kpipe.train.rl_config import RLConfig
    from kpipe.train.rollouts import feed_vllm, vllm_engine_args

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the push hands tensors to the engine in this process
    os.environ["VLLM_CACHE_ROOT"] = vllm_cache_root()
    path, _ = model_dir(args.tiny)
    config = AutoConfig.from_pretrained(path)
    params = parameter_count(config)
    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else float("inf")
    dtype_name = trainer_weights_dtype(total, args.switch_gpu_memory_utilization, params)
    cfg = RLConfig(engine="vllm", vllm_sleep=True, vllm_gpu_memory_utilization=args.switch_gpu_memory_utilization,
                   max_context_tokens=2048 if args.tiny else RLConfig().max_context_tokens)
    engine_args = {**vllm_engine_args(cfg, 1), "load_format": "dummy"}
    bucket_bytes = args.push_bucket_mib * 2**20
    why = ("the paper's fp32 master" if dtype_name == "fp32" else
           "fp32 does not fit beside the engine on this card: the bf16 memory plan, its fp32 master on the host")
    report.line(f"vLLM {version} on {card()}. The trainer's weights: {params / 1e9:.2f} B parameters in "
                f"{dtype_name} on the GPU ({why}). "
                f"kpipe's engine `VLLMEngine(..., {engine_args})`; pushes in buckets of {args.push_bucket_mib} MiB cast "
                f"to bf16 on the GPU. Residue = GPU memory in use while asleep less that in use before the engine "
                f"started (CUDA context, the trainer's weights), torch's cache emptied; claimed = what the trainer "
                f"then allocated. MRS at RLConfig's thresholds on {args.agreement_sequences} sampled sequences.")
    report.table("step", "figures", "wall s")
    held: dict[str, Any] = {}

    def synced(seconds: list[tuple[str, float]]) -> Callable[[str], contextlib.AbstractContextManager[None]]:
        """A phase timer that waits for the GPU at the end of each phase (the push's copies are asynchronous)."""
        @contextlib.contextmanager
        def timer(phase: str) -> Iterator[None]:
            started = time.perf_counter()
            yield
            synchronize()
            seconds.append((phase, time.perf_counter() - started))
        return timer

    def start() -> dict[str, Any]:
        reset_peak()
        held["model"] = build_model(config, torch.float32 if dtype_name == "fp32" else torch.bfloat16).eval()
        synchronize()
        held["before_engine_gib"] = gpu_used_gib()
        started = time.perf_counter()
        held["engine"] = FixedLengthEngine(str(path), name="paper-units", seed=0, **engine_args)
        _started_engines.append("push_switch")
        return {"startup_s": time.perf_counter() - started, "trainer_weights": dtype_name,
                "trainer_weights_gib": params * (4 if dtype_name == "fp32" else 2) / 2**30,
                "kv_capacity_tokens": kv_capacity(held["engine"].llm), "gpu_used_gib": gpu_used_gib(),
                "card": card()}

    def agreement(seed: int) -> dict[str, Any]:
        from kpipe.train.rl_batch import mismatch_keep

        engine, model = held["engine"], held["model"]
        outputs = generate_tokens(engine, [token_prompt(16, i) for i in range(args.agreement_sequences)],
                                  16 if args.tiny else 256, seed=seed)
        train_logp, rollout_logp = [], []
        for output in outputs:
            prompt, sample = list(output.prompt_token_ids), output.outputs[0]
            ids = torch.tensor([prompt + list(sample.token_ids)], device=device())
            # RL's log-probs under bf16 autocast; no cache of the weights' casts (16 GB more beside the engine)
            with torch.no_grad(), torch.autocast(device().type, dtype=torch.bfloat16, enabled=torch.cuda.is_available(),
                                                 cache_enabled=False):
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            train_logp.append(torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0].cpu())
            rollout_logp.append([step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
        keep, log_w = mismatch_keep(train_logp, rollout_logp, cfg)
        return {"sequences": len(outputs), "mrs_kept": int(keep.sum()), "log_w_abs_mean": float(log_w.abs().mean()),
                "log_w_abs_max": float(log_w.abs().max()),
                "mrs_delta": cfg.mrs_delta, "mrs_token_veto": cfg.mrs_token_veto}

    def cycle() -> dict[str, Any]:
        engine = held["engine"]
        started = time.perf_counter()
        engine.sleep()
        synchronize()
        sleep_s = time.perf_counter() - started
        gc.collect()
        torch.cuda.empty_cache()
        residue = gpu_used_gib() - held["before_engine_gib"]
        free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        claim = torch.empty(int(free * 0.9), dtype=torch.uint8, device=device())  # the trainer's turn
        claimed = claim.numel() / 2**30
        del claim
        torch.cuda.empty_cache()
        seconds: list[tuple[str, float]] = []
        feed_vllm(engine, held["model"], synced(seconds), bucket_bytes)
        (_, wake_weights_s), (_, push_s), (_, wake_kv_s) = seconds
        pushed_bytes = params * engine.llm.model_config.dtype.itemsize
        return {"sleep_s": sleep_s, "wake_weights_s": wake_weights_s, "push_s": push_s, "wake_kv_cache_s": wake_kv_s,
                "sleep_wake_s": sleep_s + wake_weights_s + wake_kv_s, "push_gb_per_s": pushed_bytes / push_s / 1e9,
                "asleep_residue_gib": residue, "claimed_gib": claimed, "gpu_used_awake_gib": gpu_used_gib(),
                "card": card()}

    limit = args.step_limit_s
    if step(report, "engine_startup", args.engine_limit_s, start) is None:
        return
    step(report, "agreement_dummy_weights", limit, lambda: agreement(0))
    for number in range(1, args.cycles + 1):
        figures = step(report, f"cycle_{number}", limit, cycle)
        if figures is None:
            break
        report.expect(figures["push_s"] <= 2.0, f"cycle {number}: the push within 2 s")
        report.expect(figures["sleep_wake_s"] <= 10.0, f"cycle {number}: sleep and wakes within 10 s")
        report.expect(figures["asleep_residue_gib"] <= 3.0, f"cycle {number}: at most 3 GiB left while asleep")
        agreed = step(report, f"agreement_{number}", limit, lambda: agreement(number))
        if agreed:
            report.expect(agreed["mrs_kept"] == agreed["sequences"], f"cycle {number}: MRS keeps every sequence")
    held.clear()


def kv_capacity(llm: Any) -> int:
    """Tokens the engine's KV cache holds: its blocks x tokens a block, as vLLM 0.26.0 sets them after
    profiling (in process: `vllm/v1/engine/core.py:309-312`; from the core's process: `vllm/v1/engine/
    core_client.py:726-733`), the "GPU KV cache size: N tokens" of its log."""
    cache = llm.llm_engine.vllm_config.cache_config
    return int(cache.num_gpu_blocks * cache.block_size)


def token_prompt(length: int, index: int) -> list[int]:
    """A prompt of `length` byte-token ids (0-255: no special token), different for every `index`."""
    import random

    draw = random.Random(f"prompt:{index}")
    return [draw.randrange(256) for _ in range(length)]


def generate_tokens(engine: Any, prompts: list[list[int]], max_tokens: int, seed: int) -> list[Any]:
    """`FixedLengthEngine`'s sampling (kpipe's: a seed a request, the sampled token's log-prob; every answer
    `max_tokens` long) on token-id prompts."""
    from kpipe.llm.types import ChatRequest

    params = [engine.sampling_params(ChatRequest(messages=[], max_tokens=max_tokens, logprobs=True,
                                                 seed=seed * 100_003 + index)) for index in range(len(prompts))]
    return engine.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)


def child_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine of `vllm_batch`: start-up, a warm-up, then the timed batch of chats."""
    import vllm

    from kpipe.llm.types import ChatRequest
    from kpipe.train.rl_config import RLConfig
    from kpipe.train.rollouts import vllm_engine_args

    common = {"gpu_memory_utilization": spec["utilization"], "max_model_len": spec["max_model_len"],
              "load_format": "dummy"}
    started = time.perf_counter()
    if spec["engine"] == "standalone":
        llm = vllm.LLM(model=spec["model"], seed=0, **common)
        startup_s = time.perf_counter() - started

        def chat(chats: list[Any], max_tokens: int) -> list[int]:
            params = vllm.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True)
            return [len(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
    else:
        engine = FixedLengthEngine(spec["model"], name="paper-units", seed=0,
                                   **{**vllm_engine_args(RLConfig(engine="vllm"), 1), **common})
        llm = engine.llm
        startup_s = time.perf_counter() - started

        def chat(chats: list[Any], max_tokens: int) -> list[int]:
            requests = [ChatRequest(messages=c, max_tokens=max_tokens, seed=i, logprobs=True) for i, c in enumerate(chats)]
            return [completion.completion_tokens for completion in engine.generate(requests)]

    chat(batch_messages(8, 16, seed=1), 8)  # warm-up: the first requests' one-off costs
    chats = batch_messages(spec["batch"], spec["content_tokens"], seed=0)
    started = time.perf_counter()
    tokens = chat(chats, spec["output_tokens"])
    seconds = time.perf_counter() - started
    capacity, final_context = kv_capacity(llm), spec["content_tokens"] + spec["output_tokens"]
    return {"engine": spec["engine"], "multiprocessing": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1",
            "startup_s": startup_s, "compile_cache": "cold" if spec["cold"] else "warm", "kv_capacity_tokens": capacity,
            # more context than the cache holds: vLLM preempts and recomputes some sequences (an H100 at 256 x 2K)
            "kv_limited": spec["batch"] * final_context > capacity,
            "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
            "sequences": len(tokens), "output_tokens": sum(tokens), "seconds": seconds,
            "output_tokens_per_s": sum(tokens) / seconds, "gpu_used_gib": gpu_used_gib(), "card": card()}


def child_replay(spec: dict[str, Any]) -> dict[str, Any]:
    """`vllm_replay`'s engine: prefill, the 3 turns, then batch 1 and 4 at turn 3's context."""
    from kpipe.train.rl_config import RLConfig
    from kpipe.train.rollouts import vllm_engine_args

    started = time.perf_counter()
    engine = FixedLengthEngine(spec["model"], name="paper-units", seed=0,
                               **{**vllm_engine_args(RLConfig(engine="vllm"), 1), "load_format": "dummy",
                                  "gpu_memory_utilization": spec["utilization"], "max_model_len": spec["max_model_len"]})
    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "kv_capacity_tokens": kv_capacity(engine.llm),
                              "card": card()}
    final_context = spec["contexts"][-1][0] + spec["answer_tokens"]
    batch = result["batch"] = fitting_batch(spec["batch"], result["kv_capacity_tokens"], final_context)
    generate_tokens(engine, [token_prompt(16, -1 - i) for i in range(8)], 8, seed=1)  # warm-up

    prefill_prompts = [token_prompt(spec["prefill_tokens"], 10_000 + i) for i in range(batch)]
    started = time.perf_counter()
    generate_tokens(engine, prefill_prompts, 1, seed=2)
    seconds = time.perf_counter() - started
    result["prefill"] = {"prompt_tokens": batch * spec["prefill_tokens"], "seconds": seconds,
                         "prefill_tokens_per_s": batch * spec["prefill_tokens"] / seconds}

    feedback = [token_prompt(spec["feedback_tokens"], 20_000 + i) for i in range(batch)]
    prompts = [token_prompt(spec["contexts"][0][0], i) for i in range(batch)]
    result["turns"] = []
    for turn, (prompt_tokens, mean_context) in enumerate(spec["contexts"]):
        # the turn's prompts first alone (one token each): what the prefix cache kept of the history, and the
        # prefill out of the decoding's time
        started = time.perf_counter()
        cached = [o.num_cached_tokens or 0 for o in generate_tokens(engine, prompts, 1, seed=10 + turn)]
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        outputs = generate_tokens(engine, prompts, spec["answer_tokens"], seed=10 + turn)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result["turns"].append({"prompt_tokens": prompt_tokens, "mean_context": mean_context, "output_tokens": tokens,
                                "seconds": seconds, "output_tokens_per_s": tokens / seconds, "prefill_s": prefill_s,
                                "cached_prompt_tokens_mean": sum(cached) / len(cached)})
        prompts = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) + extra for o, extra in zip(outputs, feedback)]

    low_context = spec["contexts"][-1][0]
    result["low_batch"] = []
    for size in (1, 4):
        chosen = [token_prompt(low_context, 30_000 + 10 * size + i) for i in range(size)]
        generate_tokens(engine, chosen, 1, seed=3)  # the prompts' prefill, into the prefix cache
        started = time.perf_counter()
        generate_tokens(engine, chosen, spec["low_batch_tokens"], seed=4)
        seconds = time.perf_counter() - started
        result["low_batch"].append({"batch": size, "context": low_context + spec["low_batch_tokens"] / 2,
                                    "seconds_per_token": seconds / spec["low_batch_tokens"]})
    return result


class FixedLengthEngine(VLLMEngine):
    """kpipe's engine whose requests ignore the EOS token: a dummy-weight model samples it at random, and a
    throughput figure needs answers of known length. Nothing else differs from RL's engine."""

    def sampling_params(self, request: Any) -> Any:
        params = super().sampling_params(request)
        params.ignore_eos = True  # read when the request is processed: vllm/sampling_params.py:635-658
        return params


# --------------------------------------------------------------------------- KernelGym beside vLLM (issue 63)
GYM_TASKS = ((2, 76), (1, 88))  # a GEMM with an epilogue (~1.6 ms) and an elementwise GELU at the bandwidth bound
GYM_TINY_TASK = (1, 19)  # the CPU test: a ReLU shrunk to 48, as the gym's own tests run it
# the engine's states, in the order the section puts it in them; "none" is the pool alone on the GPU
GYM_CONDITIONS = ("none", "vllm_awake", "vllm_decoding", "vllm_asleep")


def gym_tasks(tiny: bool) -> list[tuple[str, str, str]]:
    """(name, KernelBench reference at its main sizes, the bank's honest kernel) of each task the section times."""
    from kpipe.data.kernelbench import select_problems, shrink_sizes
    from kpipe.gym.bank import solutions_for

    tasks = []
    for level, problem_id in [GYM_TINY_TASK] if tiny else GYM_TASKS:
        reference = select_problems("main", [level], {level: [problem_id]})[0].code
        legit = next(s.source for s in solutions_for(level, problem_id) if s.variant == "legit")
        tasks.append((f"L{level}_{problem_id}", shrink_sizes(reference, 48) if tiny else reference, legit))
    return tasks


def gym_run_protocol(tiny: bool) -> Any:
    """The RL run's protocol (`kpipe.train.rl.gym_protocol`: the paper's trials, the eager baseline, PR profiled);
    on the CPU, the gym tests' few trials."""
    from kpipe.gym import Protocol
    from kpipe.train.rl import gym_protocol
    from kpipe.train.rl_config import RLConfig

    protocol = gym_protocol(RLConfig(), None)
    if not tiny:
        return protocol
    return Protocol.from_dict({**protocol.to_dict(), "correct_trials": 2, "perf_trials": 3, "warmup": 1,
                               "device": "cpu", "timeout_s": 60})


def spread(values: list[float]) -> dict[str, float | None]:
    """Median, min and max (None for none: no evaluation was timed)."""
    import statistics

    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def gym_condition(tasks: list[tuple[str, str, str]], protocol: Any, evaluations: int) -> dict[str, Any]:
    """Each task's kernel `evaluations` times, one at a time, through a fresh pool of one worker (the run's
    `GymPool`, reference runs reused): the reference is timed in this condition too, and no other evaluation
    shares the GPU, so what changes between conditions is the engine alone."""
    from kpipe.gym.serve.pool import GymPool

    figures: dict[str, Any] = {}
    with GymPool(protocol, workers=1, per_gpu=1, progress=False) as pool:
        for name, reference, candidate in tasks:
            results = [pool.evaluate(reference, candidate) for _ in range(evaluations)]
            timed = [r for r in results if r.status == "pass" and r.candidate_ms]
            figures[name] = {"statuses": [r.status for r in results],
                             "candidate_ms": spread([r.candidate_ms for r in timed]),
                             "speedup": spread([r.speedup_eager for r in timed if r.speedup_eager]),
                             "eager_ms": spread([r.eager_ms for r in timed if r.eager_ms]),
                             "wall_s": spread([r.wall_s for r in results])}
    return figures


def drift_pct(value: float | None, baseline: float | None) -> float | None:
    """How far `value` is from `baseline`, in per cent of it (None where either is missing)."""
    return None if value is None or not baseline else (value / baseline - 1) * 100


def gym_drifts(conditions: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Each engine condition's drift of every task's median candidate ms and speedup from the condition without
    vLLM."""
    base = conditions.get("none", {})
    return {condition: {task: {measure: drift_pct(figures[measure]["median"], base.get(task, {}).get(measure, {})
                                                  .get("median"))
                               for measure in ("candidate_ms", "speedup")}
                        for task, figures in conditions[condition].items()}
            for condition in GYM_CONDITIONS[1:] if condition in conditions}


def gym_figures(data: dict[str, Any]) -> dict[str, Any]:
    """gym_beside_vllm's ledger figures: each engine condition's drift of the median candidate ms and speedup
    (the task that moved most), and the engine's memory."""
    picked: dict[str, Any] = {}
    for condition, tasks in data.get("drift_pct", {}).items():
        name = condition.removeprefix("vllm_")
        for measure, key in (("candidate_ms", f"gym_drift_{name}_pct"), ("speedup", f"gym_speedup_drift_{name}_pct")):
            drifts = [figures[measure] for figures in tasks.values() if figures[measure] is not None]
            picked[key] = max(drifts, key=abs, default=None)
    picked |= {"gym_neighbour_engine_gib": data.get("engine_startup", {}).get("engine_awake_gib"),
               "gym_neighbour_asleep_gib": data.get("engine_asleep", {}).get("engine_asleep_gib")}
    return picked


class NeighbourEngine:
    """kpipe's engine at the 8B's shapes (dummy weights, RL's arguments with `rl.vllm_sleep`) in a process of its
    own beside this one's KernelGym pool, put state by state through `ask`: awake and idle once started,
    decoding one batch again and again (``decode``), asleep at level 2 (``sleep``). Commands go down its stdin,
    each answered by one JSON line on a pipe of its own (vLLM writes its log to stdout and stderr)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.child: subprocess.Popen[str] | None = None
        self.replies: Any = None
        self.scratch = tempfile.TemporaryDirectory(prefix="kpipe-neighbour-")

    def start(self, limit_s: float) -> dict[str, Any]:
        """Start the engine's process; its first answer once the engine is awake, the batch prefilled."""
        read_fd, write_fd = os.pipe()
        spec_path = Path(self.scratch.name) / "spec.json"
        spec_path.write_text(json.dumps({**self.spec, "task": "neighbour", "reply_fd": write_fd,
                                         "result": str(Path(self.scratch.name) / "result.json"),
                                         "cold": not _started_engines}))
        _started_engines.append("neighbour")
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": vllm_cache_root()}
        self.child = subprocess.Popen([sys.executable, "-m", "checks.gpu.paper_units", str(spec_path)], cwd=ROOT,
                                      env=env, stdin=subprocess.PIPE, text=True, pass_fds=(write_fd,))
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        return self.reply(limit_s)

    def ask(self, command: str, limit_s: float) -> dict[str, Any]:
        assert self.child is not None and self.child.stdin is not None
        self.child.stdin.write(command + "\n")
        self.child.stdin.flush()
        return self.reply(limit_s)

    def reply(self, limit_s: float) -> dict[str, Any]:
        """The engine's next answer; an error if its process ends first or `limit_s` passes."""
        import select

        deadline = time.monotonic() + limit_s
        while not select.select([self.replies], [], [], 1.0)[0]:
            if self.child is None or self.child.poll() is not None:
                raise RuntimeError(f"the neighbour engine's process exited {self.child and self.child.returncode} "
                                   f"(its log is above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the neighbour engine did not answer within {limit_s:.0f} s")
        line = self.replies.readline()
        if not line:
            raise RuntimeError("the neighbour engine's process closed its answers (its log is above)")
        return json.loads(line)

    def __enter__(self) -> NeighbourEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        """Ask the engine to stop; kill it and whatever it started if it has not within 30 s."""
        if self.child is not None:
            stdin = self.child.stdin
            with contextlib.suppress(OSError, ValueError):  # its process already gone
                if stdin is not None:
                    stdin.write("stop\n")
                    stdin.close()
            try:
                self.child.wait(30)
            except subprocess.TimeoutExpired:
                stop_process_tree(self.child.pid)
                self.child.wait()
        if self.replies is not None:
            self.replies.close()
        self.scratch.cleanup()


def gym_beside_vllm(report: Report, args: argparse.Namespace) -> None:
    """A fixed honest kernel of a GEMM task and of a bandwidth-bound task, each evaluated N times through the
    run's KernelGym pool on a GPU with no vLLM, beside an 8B engine (another process) awake and idle, decoding
    a batch, and asleep at level 2: candidate ms and speedup of each, their drift from no vLLM, the engine's
    memory; then which of these conditions the RL run evaluates in."""
    from kpipe.train.rl_config import RLConfig

    if device().type == "cpu":  # the bank's kernels under Triton's interpreter (the pool's children inherit it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    tasks, protocol = gym_tasks(args.tiny), gym_run_protocol(args.tiny)
    evaluations = 2 if args.tiny else args.gym_evaluations
    batch, prompt, tokens = (8, 16, 16) if args.tiny else (args.gym_decode_batch, args.prompt_tokens,
                                                           args.gym_decode_tokens)
    report.line(f"KernelGym on {card()}: the bank's honest kernel of {', '.join(name for name, _, _ in tasks)} "
                f"({'shrunk to 48 on the CPU' if args.tiny else 'at KernelBench main sizes'}), {evaluations} "
                f"evaluations each, one at a time, through a fresh `GymPool` of one worker a condition (its reference "
                f"run reused, as the run's pool does, and timed in the same condition) under the RL run's protocol "
                f"(`kpipe.train.rl.gym_protocol`: eager baseline, PR profiled). The engine: kpipe's `VLLMEngine` "
                f"with RL's arguments and sleep mode, dummy weights of the 8B, gpu_memory_utilization "
                f"{args.gym_gpu_memory_utilization}, in a process of its own; while decoding it generates {batch} "
                f"sequences of {tokens} tokens (ignore_eos) from the same {prompt}-token prompts (the prefix cache "
                f"serves them), call after call. Drift = median of the condition / median without vLLM - 1.")
    report.table("step", "figures", "wall s")
    conditions: dict[str, dict[str, Any]] = {}

    def measure(condition: str) -> None:
        figures = step(report, condition, args.gym_step_limit_s, lambda: gym_condition(tasks, protocol, evaluations))
        if figures is not None:
            conditions[condition] = figures

    measure("none")
    if vllm_version() is None:
        report.line("", "vLLM is not installed here: the conditions beside an engine were skipped (the device "
                        "installs it, docs/vllm-on-the-device.md).")
    else:
        path, _ = model_dir(args.tiny)
        spec = {"model": str(path), "utilization": args.gym_gpu_memory_utilization,
                "max_model_len": 2048 if args.tiny else RLConfig().max_context_tokens,
                "batch": batch, "prompt_tokens": prompt, "decode_tokens": tokens}
        with NeighbourEngine(spec) as engine:
            limit = args.gym_step_limit_s
            if step(report, "engine_startup", args.gym_engine_limit_s, lambda: engine.start(args.gym_engine_limit_s)):
                measure("vllm_awake")
                if step(report, "engine_decoding", limit, lambda: engine.ask("decode", limit)):
                    measure("vllm_decoding")
                    if step(report, "engine_asleep", limit, lambda: engine.ask("sleep", limit)):
                        measure("vllm_asleep")
    report.data["drift_pct"] = drifts = gym_drifts(conditions)
    report.save()
    gym_table(report, conditions, drifts)
    for condition, figures in conditions.items():
        for task, task_figures in figures.items():
            report.expect(set(task_figures["statuses"]) == {"pass"}, f"{condition}: every evaluation of {task} passes")
    report.line("", GYM_RUN_CONDITION)


def gym_table(report: Report, conditions: dict[str, dict[str, Any]], drifts: dict[str, Any]) -> None:
    """The conditions side by side: a row a condition and task."""
    def cell(figures: dict[str, float | None], spec: str) -> str:
        if figures["median"] is None:
            return "-"
        return f"{figures['median']:{spec}} ({figures['min']:{spec}}-{figures['max']:{spec}})"

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:+.1f}"

    report.line("", "| condition | task | statuses | candidate ms, median (min-max) | speedup vs eager | eager ms | "
                    "drift of candidate ms % | drift of speedup % |", "|---|---|---|---|---|---|---|---|")
    for condition, figures in conditions.items():
        for task, task_figures in figures.items():
            drift = drifts.get(condition, {}).get(task, {})
            report.line(f"| {condition} | {task} | {', '.join(task_figures['statuses'])} | "
                        f"{cell(task_figures['candidate_ms'], '.4g')} | {cell(task_figures['speedup'], '.3f')} | "
                        f"{cell(task_figures['eager_ms'], '.4g')} | {pct(drift.get('candidate_ms'))} | "
                        f"{pct(drift.get('speedup'))} |")
    engine = {**report.data.get("engine_startup", {}), **report.data.get("engine_asleep", {})}
    if engine:
        decode = report.data.get("engine_asleep", {}).get("decode", {})
        report.line("", f"The engine: {engine.get('engine_awake_gib', 0):.1f} GiB of the GPU awake, "
                        f"{engine.get('engine_asleep_gib', float('nan')):.1f} GiB asleep, KV cache "
                        f"{engine.get('kv_capacity_tokens', 0):,} tokens, started in "
                        f"{engine.get('startup_s', 0):.0f} s; "
                        f"it decoded {decode.get('output_tokens_per_s', float('nan')):,.0f} tokens/s beside the "
                        f"evaluations.")


GYM_RUN_CONDITION = (
    "**What the run does about it.** The paper's run (config/paper.yaml: `rl.engine: vllm` in the trainer's process, "
    "`rl.vllm_sleep`, `rl.async: eval`) evaluates in the `vllm_awake` condition: `VLLMEngine.generate` hands a "
    "turn's answers to the agent loop's `EvaluationStream` only once `LLM.chat` has returned them all "
    "(`kpipe.llm.vllm_engine`), so KernelGym judges them while the engine is awake and idle, its weights and KV "
    "cache held; it sleeps only for the update, when nothing is evaluated. It never evaluates while vLLM decodes. "
    "Where a run's generation does overlap KernelGym on one GPU (`rl.engine: hf` with `async: eval` or "
    "`off_policy_1`: HF hands each sequence over at its EOS), nothing pauses the decoder: the timing lease stops "
    "KernelGym's own children only, and the least of two windows absorbs a slowdown of one window, not a "
    "decoder's steady one; `vllm_decoding` measures what that costs (docs/kernelgym.md, \"Windows on a shared "
    "GPU\")."
)


def child_neighbour(spec: dict[str, Any]) -> dict[str, Any]:
    """`NeighbourEngine`'s process: the engine started and its batch prefilled, then each command from stdin
    (``decode``: generate the batch call after call until the next command; ``sleep``: level 2; ``stop``)
    answered by one JSON line on the reply pipe."""
    import queue
    import threading

    from kpipe.train.rl_config import RLConfig
    from kpipe.train.rollouts import vllm_engine_args

    replies = os.fdopen(spec["reply_fd"], "w", buffering=1)
    decoded: dict[str, Any] = {}
    commands: queue.Queue[str] = queue.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("stop")  # the check's process is gone

    before = gpu_used_gib()
    started = time.perf_counter()
    cfg = RLConfig(engine="vllm", vllm_sleep=True, vllm_gpu_memory_utilization=spec["utilization"],
                   max_context_tokens=spec["max_model_len"])
    engine = FixedLengthEngine(spec["model"], name="paper-units", seed=0,
                               **{**vllm_engine_args(cfg, 1), "load_format": "dummy"})
    startup_s = time.perf_counter() - started
    prompts = [token_prompt(spec["prompt_tokens"], 40_000 + i) for i in range(spec["batch"])]
    generate_tokens(engine, prompts, 1, seed=0)  # the prompts' prefill, into the prefix cache
    threading.Thread(target=read_commands, name="commands", daemon=True).start()
    replies.write(json.dumps({"startup_s": startup_s, "compile_cache": "cold" if spec["cold"] else "warm",
                              "engine_awake_gib": gpu_used_gib() - before, "gpu_used_gib": gpu_used_gib(),
                              "kv_capacity_tokens": kv_capacity(engine.llm), "card": card()}) + "\n")
    for command in iter(commands.get, "stop"):
        if command == "decode":
            calls, tokens, started = 0, 0, time.perf_counter()
            while commands.empty():
                outputs = generate_tokens(engine, prompts, spec["decode_tokens"], seed=calls + 1)
                tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
                calls += 1
                if calls == 1:  # decoding for sure, its first call's one-off costs behind it
                    replies.write(json.dumps({"batch": len(prompts), "first_call_s": time.perf_counter() - started,
                                              "gpu_used_gib": gpu_used_gib()}) + "\n")
                    tokens, started = 0, time.perf_counter()
            seconds = time.perf_counter() - started
            decoded = {"calls_beside_the_gym": calls - 1, "output_tokens": tokens, "seconds": seconds,
                       "output_tokens_per_s": tokens / seconds if seconds else None}
        elif command == "sleep":
            engine.sleep()
            replies.write(json.dumps({"engine_asleep_gib": gpu_used_gib() - before, "gpu_used_gib": gpu_used_gib(),
                                      "decode": decoded}) + "\n")
    return {}


CHILD_TASKS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"batch": child_batch, "replay": child_replay,
                                                                       "neighbour": child_neighbour}


def figures(report_json: dict[str, Any]) -> dict[str, Any]:
    """The units `kpipe plan --cost` reads (config/cost_units.yaml's names where one matches), for the ledger."""
    sections = report_json["sections"]
    trainer_data = sections.get("trainer", {}).get("data", {})
    batch = sections.get("vllm_batch", {}).get("data", {})
    replay = sections.get("vllm_replay", {}).get("data", {}).get("replay", {})
    switch = sections.get("push_switch", {}).get("data", {})
    lengths = [figures for name, figures in trainer_data.items() if name.startswith("trainer_") and "tokens" in figures]
    picked: dict[str, Any] = {}
    for length in lengths:
        picked |= {f"train_tokens_per_s_{length['tokens']}": length["tokens_per_s"],
                   f"train_mfu_{length['tokens']}": length["mfu"]}
    longest = max(lengths, key=lambda figures: figures["tokens"], default={})
    picked |= {"optimizer_step_s": longest.get("optimizer_step_s"),
               "optimizer_copy_gb_per_s": longest.get("optimizer_copy_gb_per_s"),
               "train_gpu_peak_gib": longest.get("gpu_peak_gib"), "train_host_peak_gib": longest.get("host_peak_gib")}
    sft = sections.get("sft_long", {}).get("data", {}).get("sft_train", {})
    picked |= {"sft_sample_tokens": float(sft["tokens"]) if "tokens" in sft else None,
               "sft_tokens_per_s": sft.get("tokens_per_s"), "sft_mfu": sft.get("mfu"), "sft_step_s": sft.get("step_s"),
               "sft_optimizer_step_s": sft.get("optimizer_step_s"), "sft_gpu_peak_gib": sft.get("gpu_peak_gib"),
               "sft_host_peak_gib": sft.get("host_peak_gib")}
    engines = [batch.get(name, {}) for name in ("standalone", "kpipe_engine")]
    cold = next((engine for engine in engines if engine.get("compile_cache") == "cold"), {})
    picked |= {"vllm_startup_s": cold.get("startup_s"),
               "standalone_tokens_per_s": engines[0].get("output_tokens_per_s"),
               "kpipe_engine_tokens_per_s": engines[1].get("output_tokens_per_s"),
               "kpipe_vs_standalone": batch.get("comparison", {}).get("kpipe_vs_standalone"),
               "kv_capacity_tokens": float(engines[1]["kv_capacity_tokens"]) if "kv_capacity_tokens" in engines[1] else None,
               "prefill_tokens_per_s": replay.get("prefill", {}).get("prefill_tokens_per_s")}
    turns = replay.get("turns", [])
    for number, turn in enumerate(turns, 1):
        picked[f"replay_tokens_per_s_turn{number}"] = turn["output_tokens_per_s"]
    efficiencies = [turn["bandwidth_efficiency"] for turn in turns if turn.get("bandwidth_efficiency") is not None]
    if efficiencies:
        picked["decode_bandwidth_efficiency"] = sum(efficiencies) / len(efficiencies)
    for low in replay.get("low_batch", []):
        picked[f"seconds_per_token_batch{low['batch']}"] = low["seconds_per_token"]
    cycles = [figures for name, figures in switch.items() if name.startswith("cycle_")]
    if cycles:
        picked |= {"push_s": max(c["push_s"] for c in cycles),
                   "weight_sync_bytes_per_s": min(c["push_gb_per_s"] for c in cycles) * 1e9,
                   "sleep_wake_s": max(c["sleep_wake_s"] for c in cycles),
                   "asleep_residue_gib": max(c["asleep_residue_gib"] for c in cycles)}
    agreements = [figures for name, figures in switch.items() if name.startswith("agreement_") and name[-1].isdigit()]
    if agreements:
        picked["push_mrs_kept_fraction"] = min(a["mrs_kept"] / a["sequences"] for a in agreements)
    picked |= gym_figures(sections.get("gym_beside_vllm", {}).get("data", {}))
    rl_step_data = sections.get("rl_step", {}).get("data", {})
    picked |= {f"rl_step_{phase}": seconds for phase, seconds in rl_step_data.get("phases", {}).items()}
    return {key: round(value, 4) for key, value in picked.items() if isinstance(value, float) and math.isfinite(value)}


SMOKE_CONFIGS = ("config/paper.yaml", "config/paper_smoke.yaml", "config/paper_smoke_1gpu.yaml")
# the phases issue 63 holds to the plan (within 25 %); the push and sleep/wake are reported beside them: one step
# has no push (the engine loads the SFT model) and its one sleep is a fraction of a second. Where the run counted
# its rows' tokens, the forward and backward passes are held at those rows (forward_backward_at_rows_s) and their
# seconds at the plan's guessed rows are reported
COMPARED_PHASES = ("rollout_s", "forward_backward_s", "optimizer_s", "step_s")
PHASE_TOLERANCE = 0.25


def step_phases(means: Any) -> dict[str, float]:
    """An RL iteration's phases from its metrics' means over its steps (train_metrics: one row a name and
    step, grouped by name). The trainer's forward and backward passes are `forward_backward_s`: the old
    log-probs and the update, its optimizer steps apart (the plan's `training_mfu` term)."""
    phases = {name: float(means[name]) for name in ("rollout_s", "gen_s", "eval_s", "log_probs_s", "update_s",
                                                    "optimizer_s", "push_s", "sleep_wake_s", "step_s") if name in means}
    if {"log_probs_s", "update_s", "optimizer_s"} <= set(phases):
        phases["forward_backward_s"] = phases["log_probs_s"] + phases["update_s"] - phases["optimizer_s"]
    return phases


def trained_rows_read(means: Any) -> tuple[float, float] | tuple[()]:
    """(tokens, rows) the update trained, from an RL iteration's metric means: `trained_row_tokens` where the run
    counted it, else its trained rows at the mean row's length (runs before the metric); () where neither
    is known (the plan then holds every row to the update's passes)."""
    if "trained_rows" not in means or "rows" not in means or "row_tokens" not in means:
        return ()
    rows = float(means["trained_rows"])
    if "trained_row_tokens" in means:
        return float(means["trained_row_tokens"]), rows
    return rows * float(means["row_tokens"]) / float(means["rows"]), rows


def job_cards(logs: Path) -> set[str]:
    """The cards a run's GPU jobs name in their logs (kpipe.infra.jobs logs them as each job starts)."""
    marker = ": GPU(s) "
    return {card.strip() for log in logs.rglob("*.log") for line in log.read_text(errors="replace").splitlines()
            if marker in line and " kpipe INFO rule " in line for card in line.split(marker, 1)[1].split(",")}


def rl_step(report: Report, args: argparse.Namespace) -> None:
    """Issue 63's RL step at the paper's shapes, read from a finished run of the one-GPU smoke under Snakemake
    (docs/cost.md, "The smoke run on one GPU"; run here, on the machine that ran it): each phase against
    `kpipe plan --cost` for the same config and card."""
    import pandas as pd

    from kpipe.infra.config import load_config
    from kpipe.report.cost import format_comparison, load_units, plan_cost, rl_rows_train_seconds

    root = Path(args.smoke_dir).resolve()
    config = load_config(str(ROOT / "config" / "config.yaml"), *(str(ROOT / name) for name in SMOKE_CONFIGS))
    parts = sorted((root / "results" / "train_metrics" / "stage=rl" / f"rl-{config['run']}").glob("run=*/iter=*/*.parquet"))
    if not parts:
        raise CheckFailed(f"no RL metrics of run {config['run']!r} under {root}: run the smoke first (docs/cost.md)")
    cards = job_cards(root / "logs")
    here = card()
    if cards and cards != {here}:
        raise CheckFailed(f"the run's jobs ran on {', '.join(sorted(cards))}, this is {here}: report on that machine")
    kind = gpu_kind(here) or "h200"
    units = load_units(ROOT / "config" / "cost_units.yaml")
    plan = plan_cost(config, units, 1, kind)
    predicted = dict(next(stage for stage in plan.stages if stage.name == "rl").phases)
    by_step = pd.concat(pd.read_parquet(part) for part in parts)
    metrics = by_step.groupby("name")["value"].mean()
    measured = step_phases(metrics)
    # the trainer's units held to the rows the run trained (a random policy's answers and the byte tokenizer's
    # contexts are not the plan's guesses): issue 63's "once the units are the measured ones"
    at_rows = "row_tokens" in metrics and metrics["rows"] > 0 and "forward_backward_s" in measured
    trained = trained_rows_read(metrics)
    if at_rows:
        predicted["forward_backward_at_rows_s"] = rl_rows_train_seconds(
            config, units, kind, float(metrics["row_tokens"]), float(metrics["rows"]), *trained)
        measured["forward_backward_at_rows_s"] = measured["forward_backward_s"]
    compared = tuple(phase for phase in COMPARED_PHASES if not (at_rows and phase == "forward_backward_s"))
    compared += ("forward_backward_at_rows_s",) if at_rows else ()
    report.line(f"`snakemake --cores 16 --configfile {' '.join(SMOKE_CONFIGS)} --until rl_iter` on {here}: the "
                f"random 8B (byte tokenizer) after its SFT, {config['rl']['prompts_per_step']} prompt x "
                f"{config['rl']['rollouts_per_prompt']} rollouts x {config['rl']['max_turns']} turns x "
                f"{config['rl']['max_tokens']:,} tokens in a {config['rl']['max_context_tokens']:,}-token context, "
                f"vLLM colocated (sleep mode), KernelGym in the loop, the memory plan the card allows. Measured: "
                f"the run's train_metrics (one row a phase) and Snakemake's benchmark files; predicted: "
                f"`kpipe plan --cost ... --gpus 1 --gpu-kind {kind}` with config/cost_units.yaml.")
    report.data.update(phases=measured, predicted=predicted, card=here, rows=float(metrics.get("rows", 0)),
                       row_tokens=float(metrics.get("row_tokens", math.nan)),
                       response_tokens_mean=float(metrics.get("response_tokens_mean", 0)),
                       kept_frac_mrs=float(metrics.get("kept_frac_mrs", math.nan)),
                       mismatch_abs_log_w=float(metrics.get("mismatch_abs_log_w", math.nan)))
    report.table("phase", "predicted s", "measured s", "predicted / measured", "within 25 %")
    for phase in (*compared, *(p for p in COMPARED_PHASES if p not in compared), "gen_s", "eval_s", "log_probs_s",
                  "update_s", "push_s", "sleep_wake_s"):
        if phase not in predicted and phase not in measured:
            continue
        guess, seen = predicted.get(phase), measured.get(phase)
        ratio = guess / seen if guess is not None and seen else None
        within = ratio is not None and abs(ratio - 1) <= PHASE_TOLERANCE
        report.row(phase, "-" if guess is None else f"{guess:.3g}", "not run" if seen is None else f"{seen:.3g}",
                   "-" if ratio is None else f"{ratio:.2f}",
                   ("yes" if within else "NO") if phase in compared else "reported")
        if phase in compared:
            report.expect(within, f"{phase}: predicted {guess} s against {seen} s measured, not within 25 %")
    tokens = report.data["row_tokens"]
    read = (f"{tokens:,.0f} tokens in all, read at {tokens / measured['forward_backward_s']:,.0f} tokens/s by the "
            f"forward and backward passes" if math.isfinite(tokens) and measured.get("forward_backward_s")
            else "their tokens not recorded (row_tokens: runs before it was a metric)")
    if trained:
        counted = "counted" if "trained_row_tokens" in metrics else "estimated at the mean row's length"
        read += (f"; the update trained {trained[1]:.1f} of them a step, {trained[0]:,.0f} tokens ({counted}): MRS and "
                 f"PRS drop the others after the log-prob pass, so the plan holds every row to one forward and the "
                 f"trained ones to the update's forward and backward")
    report.line("", f"{report.data['rows']:.0f} rows (a row a turn: its context and answer; {read}), answers of "
                    f"{report.data['response_tokens_mean']:,.0f} tokens on average; MRS kept {report.data['kept_frac_mrs']:.0%} of rows against the engine's "
                    f"log-probs, over the steps (mean |log w| {report.data['mismatch_abs_log_w']:.2g}).",
                "", "Each step: the first after vLLM loaded the SFT model, each later one after the trainer's push "
                    "(`kpipe.train.rollouts.feed_vllm`); MRS holds vLLM's log-probs of its samples to the trainer's "
                    "(Eq. 6: a sequence's mean log ratio within 1e-3, no token's ratio under 1e-4).", "")
    report.table("step", "push s", "sleep and wakes s", "rows", "row tokens", "trained rows", "MRS kept", "mean |log w|")
    steps = by_step.pivot_table(index="step", columns="name", values="value")
    report.data["steps"] = {}
    for step_number, values in steps.iterrows():
        figures = {name: float(values[name]) for name in ("push_s", "sleep_wake_s", "rows", "row_tokens", "trained_rows",
                                                          "kept_frac_mrs", "mismatch_abs_log_w")
                   if name in values and pd.notna(values[name])}
        report.data["steps"][int(step_number)] = figures
        report.row(int(step_number), *(f"{figures[name]:.3g}" if name in figures else "-" for name in
                                       ("push_s", "sleep_wake_s", "rows", "row_tokens", "trained_rows")),
                   f"{figures['kept_frac_mrs']:.0%}" if "kept_frac_mrs" in figures else "-",
                   f"{figures['mismatch_abs_log_w']:.2g}" if "mismatch_abs_log_w" in figures else "-")
    report.line("", "Each job, predicted against Snakemake's benchmark files (`kpipe plan --cost ... --measured logs`):",
                "", "```", format_comparison(plan, root / "logs"), "```")


SECTIONS = (Section("optimizer_numerics", 90, optimizer_numerics), Section("trainer", 420, trainer),
            Section("sft_long", 300, sft_long), Section("vllm_batch", 330, vllm_batch), Section("vllm_replay", 240, vllm_replay),
            Section("push_switch", 240, push_switch), Section("gym_beside_vllm", 360, gym_beside_vllm),
            Section("rl_step", 60, rl_step, in_suite=False))


def engine_child(spec_path: Path) -> None:
    """A child of `run_engine_child`: its task on the spec, the figures into the spec's result file."""
    spec = json.loads(spec_path.read_text())
    Path(spec["result"]).write_text(json.dumps(CHILD_TASKS[spec["task"]](spec)))


if __name__ == "__main__":
    engine_child(Path(sys.argv[1]))
