"""The paper run's unit costs at the 8B architecture (issue 54), on the GPUs present: what `kpipe plan
--cost` multiplies by the config's counts (config/cost_units.yaml, docs/cost.md). Qwen3-8B-Base's shapes
are built from its config (``kpipe.train.tiny_model``'s ``qwen3-8b`` preset), random weights: memory, time
and mechanics are real, learning is not measured.

    # vLLM installed into /tmp/site as docs/vllm-on-the-device.md says, then:
    export PYTHONPATH=$PWD/src:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \\
        VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
    KPIPE_COMMIT=abc1234 python3 -m checks.gpu paper_units          # training then rollout, ~7 min
    python -m checks.gpu paper_units --tiny                         # the same code on a nano model (CPU test)

Sections (each step under its own time limit, the report saved after each, so a cut-off run keeps what it
measured):

1. ``training``: a forward+backward+AdamW step of the repo's RL trainer settings (fp32 weights under bf16
   autocast, activation checkpointing, fused AdamW) on one sequence of rl.micro_batch_tokens (32,768). The
   8B with fp32 AdamW state (16 bytes a parameter, 131 GB) does not fit one H200 beside its activations, so
   it measures K1 and K2 of the 36 layers at full width (with the embeddings and head) and extrapolates
   linearly per layer to 36: *an assumption the report states*. Tokens/s, MFU (6 N tokens plus attention,
   over 989 TFLOP/s bf16 dense), peak memory, model build seconds.
2. ``rollout``: vLLM with ``load_format="dummy"`` (kpipe's engine arguments: processed log-probs,
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

TITLE = "Unit costs of the paper's run at the 8B architecture: training, vLLM rollout, weight push"
FULL_LAYERS = 36  # Qwen3-8B
H100_H200_BF16_DENSE_FLOPS = 989e12  # the published dense bf16 peak of both (SXM): MFU's denominator


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--tiny", action="store_true", help="a nano model and short lengths: the CPU test")
    parser.add_argument("--layers", default="2,4", help="K1,K2 layers of the 36 measured at full width")
    parser.add_argument("--seq-len", type=int, default=32768, help="training tokens per step (rl.micro_batch_tokens)")
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


def training_flops(params: int, layers: int, hidden: int, tokens: int) -> float:
    """One forward+backward of `tokens` causal tokens: 6 N t for the weights plus causal attention,
    12 L d t^2 / 2 (recomputation by activation checkpointing not counted: MFU's convention)."""
    return 6.0 * params * tokens + 6.0 * layers * hidden * tokens * tokens


def extrapolate(small: tuple[int, float], large: tuple[int, float], layers: int) -> float:
    """Seconds at `layers` from two measured (layers, seconds) points, linear per layer. Where noise
    made the larger model no slower (no per-layer cost to read), the larger point's seconds per
    layer, embeddings and head included, scaled up: an overestimate, never a negative time."""
    (k1, t1), (k2, t2) = small, large
    if t2 <= t1:
        return t2 / k2 * layers
    return t1 + (t2 - t1) / (k2 - k1) * (layers - k1)


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


def train_steps(config: Any, seq_len: int, steps: int = 2) -> dict[str, Any]:
    """Build `config` (fp32 weights), then one warm-up and `steps` timed forward+backward+AdamW steps."""
    import torch
    from accelerate import Accelerator
    from transformers import Qwen3ForCausalLM

    reset_peak()
    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
    started = time.perf_counter()
    with torch.device(device()):
        model = Qwen3ForCausalLM(config)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=torch.cuda.is_available())
    build_s = time.perf_counter() - started
    ids = torch.randint(0, config.vocab_size, (1, seq_len), device=device())

    def one() -> None:
        with accelerator.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    one()
    started = time.perf_counter()
    for _ in range(steps):
        one()
    step_s = (time.perf_counter() - started) / steps
    params = model.num_parameters()
    del model, optimizer
    figures = {"layers": config.num_hidden_layers, "parameters": params, "build_s": build_s, "step_s": step_s,
               "tokens_per_s": seq_len / step_s, "peak_gib": peak_gib()}
    reset_peak()
    return figures


def training(report: Report, args: argparse.Namespace) -> None:
    """Training tokens/s and MFU at the paper's sequence length, K1 and K2 layers extrapolated to 36."""
    seq_len = 64 if args.tiny else args.seq_len
    k1, k2 = (1, 2) if args.tiny else (int(k) for k in args.layers.split(","))
    report.line(f"One sequence of {seq_len} tokens a step, fp32 weights under bf16 autocast, activation "
                f"checkpointing, fused AdamW. Measured at {k1} and {k2} of {FULL_LAYERS} layers at full width "
                f"(embeddings and head included); the full model's step is extrapolated linearly per layer "
                f"(assumption: layers cost alike, the rest is the intercept).")
    report.table("step", "figures", "wall s")
    small = step(report, f"train_{k1}_layers", args.step_limit_s, lambda: train_steps(architecture(args.tiny, k1), seq_len))
    large = step(report, f"train_{k2}_layers", args.step_limit_s, lambda: train_steps(architecture(args.tiny, k2), seq_len))
    if not (small and large):
        return
    full = architecture(args.tiny)
    per_layer_params = (large["parameters"] - small["parameters"]) / (k2 - k1)
    params = small["parameters"] + per_layer_params * (FULL_LAYERS - k1)
    step_s = extrapolate((k1, small["step_s"]), (k2, large["step_s"]), FULL_LAYERS)
    peak = small["peak_gib"] + (large["peak_gib"] - small["peak_gib"]) / (k2 - k1) * (FULL_LAYERS - k1)
    flops = training_flops(int(params), FULL_LAYERS, full.hidden_size, seq_len)
    report.data["full"] = {"layers": FULL_LAYERS, "parameters": params, "step_s": step_s,
                           "tokens_per_s": seq_len / step_s, "mfu": flops / step_s / H100_H200_BF16_DENSE_FLOPS,
                           "peak_gib_one_gpu_unsharded": peak, "extrapolated_from_layers": [k1, k2]}
    report.line("", f"Extrapolated to {FULL_LAYERS} layers ({params / 1e9:.2f} B parameters): "
                f"{step_s:.2f} s a step, {seq_len / step_s:,.0f} tokens/s per GPU, MFU "
                f"{report.data['full']['mfu']:.1%}; unsharded peak {peak:.0f} GiB (FSDP2 over N GPUs shards the "
                f"16 bytes a parameter of weights, grads and AdamW state).")


def save_architecture(out: Path, tiny: bool) -> Path:
    """Config and byte tokenizer only: vLLM's `load_format="dummy"` makes random weights of the shapes."""
    from kpipe.train.tiny_model import build_byte_tokenizer, tiny_config

    tokenizer = build_byte_tokenizer()
    config = tiny_config("nano" if tiny else "qwen3-8b", len(tokenizer), tokenizer.eos_token_id,
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
    training_data = report_json["sections"].get("training", {}).get("data", {})
    rollout_data = report_json["sections"].get("rollout", {}).get("data", {})
    picked = {"train_tokens_per_s_8b": training_data.get("full", {}).get("tokens_per_s"),
              "train_mfu_8b": training_data.get("full", {}).get("mfu"),
              "vllm_startup_s": rollout_data.get("engine_startup", {}).get("startup_s"),
              "prefill_tokens_per_s": rollout_data.get("prefill", {}).get("prefill_tokens_per_s"),
              "decode_tokens_per_s": rollout_data.get("decode", {}).get("decode_tokens_per_s"),
              "weight_push_s": rollout_data.get("weight_push", {}).get("push_s")}
    return {key: round(value, 4) for key, value in picked.items() if isinstance(value, float) and math.isfinite(value)}


SECTIONS = (Section("training", 150, training), Section("rollout", 330, rollout))
