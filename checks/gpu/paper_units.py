"""The paper run's unit costs at the 8B architecture (issue 54), on the GPUs present: what `kpipe plan
--cost` multiplies by the config's counts (config/cost_units.yaml, docs/cost.md). Qwen3-8B-Base's shapes
are built from its config (``kpipe.train.tiny_model``'s ``qwen3-8b`` preset), random weights: memory, time
and mechanics are real, learning is not measured.

    # vLLM installed into /tmp/site as docs/vllm-on-the-device.md says, then:
    export PYTHONPATH=$PWD/src:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \\
        VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu paper_units optimizer_numerics trainer   # one call, ~8 min
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu paper_units rollout                      # vLLM, ~6 min
    python -m checks.gpu paper_units --tiny                         # the same code on a nano model (CPU test)

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
3. ``rollout``: vLLM with ``load_format="dummy"`` (kpipe's engine arguments: processed log-probs,
   max_model_len 32,768): start-up seconds; prefill tokens/s (a batch of prompts, one output token);
   decode tokens/s (a batch of sequences decoding with ``ignore_eos``: the paper's 8,192 tokens a turn
   cut to --decode-tokens to fit the call); then the weight push of a bf16 HF copy of the same
   architecture through ``kpipe.train.rollouts.push_weights_to_vllm`` (seconds) and MRS's log-prob
   agreement of the trainer's own samples after the push (``mismatch_keep`` at RLConfig's thresholds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from checks.gpu.harness import Report, Section

TITLE = "Unit costs of the paper's run at the 8B architecture: the one-GPU trainer, vLLM rollout, weight push"
H100_H200_BF16_DENSE_FLOPS = 989e12  # the published dense bf16 peak of both (SXM): MFU's denominator


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--tiny", action="store_true", help="a nano model and short lengths: the CPU test")
    parser.add_argument("--trainer-lengths", default="32768,8192",
                        help="micro-batch tokens the trainer section times, in order (rl.micro_batch_tokens: 32,768)")
    parser.add_argument("--trainer-steps", type=int, default=5, help="steps a micro-batch length (the first warms up)")
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="tokens a chunk of the LM head's log-probs")
    parser.add_argument("--prefill-len", type=int, default=8192, help="prompt tokens per sequence for prefill")
    parser.add_argument("--batch", type=int, default=64, help="sequences per rollout batch")
    parser.add_argument("--decode-tokens", type=int, default=1024, help="decoded tokens per sequence (paper: 8,192)")
    parser.add_argument("--step-limit-s", type=int, default=150, help="hard limit of each measured step")


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
    report.row(name, json.dumps(figures, default=lambda v: round(v, 4) if isinstance(v, float) else str(v)),
               f"{time.perf_counter() - started:.1f}")
    report.save()
    print(f"[paper_units] {name}: {figures}", flush=True)
    return figures


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


def save_architecture(out: Path, tiny: bool) -> Path:
    """Config and byte tokenizer only: vLLM's `load_format="dummy"` makes random weights of the shapes."""
    from kpipe.train.tiny_model import byte_tokenizer_for, tiny_config

    size = "nano" if tiny else "qwen3-8b"
    tokenizer = byte_tokenizer_for(size)  # 151,936 ids that all decode at 8B
    config = tiny_config(size, len(tokenizer), tokenizer.eos_token_id,
                         tokenizer.pad_token_id)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def rollout(report: Report, args: argparse.Namespace) -> None:
    """vLLM (dummy weights) start-up, prefill and decode tokens/s; weight push seconds and MRS agreement."""
    try:
        import vllm
    except ImportError:
        report.line("vLLM is not installed here: section skipped (the device installs it, docs/vllm-on-the-device.md).")
        return
    import torch

    from kpipe.train.rl_config import RLConfig
    from kpipe.train.rollouts import push_weights_to_vllm, vllm_engine_args

    cfg = RLConfig()
    work = Path(tempfile.mkdtemp(prefix="kpipe-paper-units-"))
    path = save_architecture(work / "qwen3-8b", args.tiny)
    engine_args = {**vllm_engine_args(cfg, 1), "gpu_memory_utilization": 0.6, "load_format": "dummy",
                   "max_model_len": 2048 if args.tiny else cfg.max_context_tokens}
    report.line(f"vLLM {vllm.__version__}, `LLM({engine_args})`; {args.batch} sequences a batch, prefill "
                f"{args.prefill_len} prompt tokens each, decode {args.decode_tokens} tokens each (the paper: up to "
                f"8,192 a turn; cut to fit the call).")
    report.table("step", "figures", "wall s")
    held: dict[str, Any] = {}

    def start() -> dict[str, Any]:
        reset_peak()
        started = time.perf_counter()
        held["llm"] = vllm.LLM(model=str(path), seed=0, **engine_args)
        return {"startup_s": time.perf_counter() - started}

    def generate(prompt_len: int, max_tokens: int) -> tuple[float, list[Any]]:
        prompts = [{"prompt_token_ids": [(i * 7 + j) % 250 for j in range(prompt_len)]} for i in range(args.batch)]
        params = vllm.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=0)
        started = time.perf_counter()
        outputs = held["llm"].generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started, outputs

    def prefill() -> dict[str, Any]:
        generate(16, 1)  # warm-up
        seconds, _ = generate(args.prefill_len, 1)
        return {"prompt_tokens": args.batch * args.prefill_len, "seconds": seconds,
                "prefill_tokens_per_s": args.batch * args.prefill_len / seconds}

    def decode() -> dict[str, Any]:
        seconds, outputs = generate(16, args.decode_tokens)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        held["samples"] = outputs[: min(8, len(outputs))]
        return {"sequences": args.batch, "decoded_tokens": tokens, "seconds": seconds,
                "decode_tokens_per_s": tokens / seconds, "gpu_used_gib": gpu_used_gib()}

    def push() -> dict[str, Any]:
        from transformers import AutoConfig, Qwen3ForCausalLM

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # made in bf16 directly: an fp32 8B would take 33 GB more
        try:
            with torch.device(device()):
                model = Qwen3ForCausalLM(AutoConfig.from_pretrained(path)).eval()
        finally:
            torch.set_default_dtype(default_dtype)
        held["model"] = model

        class Engine:  # push_weights_to_vllm takes kpipe's engine, which holds `llm`
            llm = held["llm"]

        started = time.perf_counter()
        push_weights_to_vllm(Engine(), model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"push_s": time.perf_counter() - started, "parameters": model.num_parameters()}

    def agreement() -> dict[str, Any]:
        from kpipe.train.rl_batch import mismatch_keep

        model = held["model"]
        _, outputs = generate(16, 256 if not args.tiny else 16)
        outputs = outputs[:8]
        train_logp, rollout_logp = [], []
        for output in outputs:
            prompt, response = list(output.prompt_token_ids), list(output.outputs[0].token_ids)
            ids = torch.tensor([prompt + response], device=device())
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            train_logp.append(torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0].cpu())
            rollout_logp.append([next(iter(d.values())).logprob for d in output.outputs[0].logprobs])
        keep, log_w = mismatch_keep(train_logp, rollout_logp, cfg)
        return {"sequences": len(outputs), "mrs_kept": int(keep.sum()), "log_w_abs_max": float(log_w.abs().max()),
                "mrs_delta": cfg.mrs_delta, "mrs_token_veto": cfg.mrs_token_veto}

    limit = args.step_limit_s
    if step(report, "engine_startup", limit, start) is None:
        return
    step(report, "prefill", limit, prefill)
    step(report, "decode", limit, decode)
    if step(report, "weight_push", limit, push) is not None:
        step(report, "push_agreement", limit, agreement)
    report.line("", f"Peak GPU memory of this process: {peak_gib():.1f} GiB (vLLM's KV cache is preallocated: "
                f"gpu_memory_utilization {engine_args['gpu_memory_utilization']}).")


def figures(report_json: dict[str, Any]) -> dict[str, Any]:
    """The units `kpipe plan --cost` reads, for the ledger."""
    trainer_data = report_json["sections"].get("trainer", {}).get("data", {})
    rollout_data = report_json["sections"].get("rollout", {}).get("data", {})
    lengths = [figures for name, figures in trainer_data.items() if name.startswith("trainer_") and "tokens" in figures]
    picked: dict[str, Any] = {}
    for length in lengths:
        picked |= {f"train_tokens_per_s_{length['tokens']}": length["tokens_per_s"],
                   f"train_mfu_{length['tokens']}": length["mfu"]}
    longest = max(lengths, key=lambda figures: figures["tokens"], default={})
    picked |= {"optimizer_step_s": longest.get("optimizer_step_s"),
               "optimizer_copy_gb_per_s": longest.get("optimizer_copy_gb_per_s"),
               "train_gpu_peak_gib": longest.get("gpu_peak_gib"), "train_host_peak_gib": longest.get("host_peak_gib"),
               "vllm_startup_s": rollout_data.get("engine_startup", {}).get("startup_s"),
               "prefill_tokens_per_s": rollout_data.get("prefill", {}).get("prefill_tokens_per_s"),
               "decode_tokens_per_s": rollout_data.get("decode", {}).get("decode_tokens_per_s"),
               "weight_push_s": rollout_data.get("weight_push", {}).get("push_s")}
    return {key: round(value, 4) for key, value in picked.items() if isinstance(value, float) and math.isfinite(value)}


SECTIONS = (Section("optimizer_numerics", 90, optimizer_numerics), Section("trainer", 420, trainer),
            Section("rollout", 330, rollout))
