"""kpipe's SFT step on one GPU: throughput and model FLOPs utilisation (MFU) of a Qwen3-0.6B-sized
model built from config (random weights, no download), bf16 autocast over fp32 master weights, fused
AdamW: exactly `kpipe.train.sft.train_step`, the step `train_sft` runs.

    python3 -m checks.gpu sft            # ~3-4 minutes on one H100

Model FLOPs per token (stated, as the report does):
    F(L) = 6·N + 6·n_layers·L·d_attn
N = parameters that do matmuls per token (all but the input embedding; with tied embeddings the
lm_head matmul counts once), L = sequence length, d_attn = n_heads·head_dim. The second term is
causal attention (QKᵀ and AV, forward 2·L·d_attn per token per layer, ×3 for forward+backward).
The PaLM-paper convention counts attention without the causal halving (12·n_layers·L·d_attn);
both are reported. MFU = tokens/s · F(L) / peak, peak = 989 TFLOP/s (H100/H200 SXM, bf16 dense).

Then (section ``end_to_end``) a short `train_sft` run (build → train → checkpoint → HF export) on the
same model size, to show the whole path works on a GPU. Fails when a part failed or the best MFU
misses the 35 % target.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from checks.gpu.harness import CheckFailed, Report, Section  # noqa: E402

TITLE = "SFT step on one GPU: Qwen3-0.6B-sized model (random weights), bf16 autocast, fused AdamW"

PEAK_BF16_FLOPS = 989e12  # H100 SXM / H200 dense bf16 tensor-core peak
MFU_TARGET = 0.35


def matmul_params(model: Any) -> int:
    """Parameters used in a matmul for every token: everything but the input embedding lookup."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    return total if tied else total - embedding.numel()


def flops_per_token(n_matmul: int, n_layers: int, d_attn: int, seq_len: int, causal: bool = True) -> float:
    attention = (6 if causal else 12) * n_layers * seq_len * d_attn
    return 6 * n_matmul + attention


def environment() -> dict:
    """What decides attention's speed here (the harness reports the device's facts)."""
    import accelerate
    import torch
    import transformers

    info = {
        "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
        "sdpa_flash": torch.backends.cuda.flash_sdp_enabled(),
        "sdpa_cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "sdpa_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
    }
    return info


def synthetic_samples(n: int, seq_len: int, vocab: int, prompt_fraction: float, seed: int) -> list:
    """Random token sequences; the first `prompt_fraction` of each is context (no loss), like an SFT turn."""
    import torch

    from kpipe.train.samples import IGNORE_INDEX, Sample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        ids = torch.randint(0, vocab, (seq_len,), generator=generator).tolist()
        cut = int(prompt_fraction * seq_len)
        samples.append(Sample(f"synthetic-{i}", ids, [IGNORE_INDEX] * cut + ids[cut:]))
    return samples


def measure(accelerator, model, optimizer, scheduler, seq_len: int, batch: int, micro_tokens: int,
            warmup: int, steps: int, pad_id: int) -> dict:
    """Median step time of `steps` timed optimizer steps after `warmup` untimed ones."""
    import torch

    from kpipe.train.sft import train_step

    vocab = model.config.vocab_size
    samples = synthetic_samples(batch, seq_len, vocab, prompt_fraction=0.2, seed=seq_len)
    ids = list(range(batch))
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        values = train_step(accelerator, model, optimizer, scheduler, samples, ids, micro_tokens, 1.0, pad_id)
        losses.append(values["loss"])
        if i >= warmup:
            times.append(values["step_s"])
    step_s = statistics.median(times)
    return {"step_s": step_s, "tokens_per_step": batch * seq_len, "tokens_per_s": batch * seq_len / step_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "loss_first": losses[0], "loss_last": losses[-1]}


def end_to_end(work: Path, seq_chars: int) -> dict:
    """A short real train_sft run of the 0.6B-sized model on synthetic trajectories, with checkpoints."""
    from kpipe.train.sft import SFTConfig, train_sft
    from kpipe.train.tiny_model import build_tiny_model

    started = time.perf_counter()
    base = build_tiny_model(work / "base", seed=0, size="qwen3-0.6b")
    text = ("@triton.jit\ndef kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):\n    pid = tl.program_id(0)\n" * 200)
    rows = [{"run": "gpu-check", "stage": "coldstart", "iteration": 0, "task_id": f"t{i}", "sample": 0, "turn": 1,
             "prompt_messages": [{"role": "user", "content": text[: seq_chars // 4]}],
             "response": text[: seq_chars - seq_chars // 4], "status": "pass", "correct": True, "hacked": False}
            for i in range(8)]
    cfg = SFTConfig.from_dict(dict(base_model=str(base), run="gpu-check", lr=1e-5, batch_size=4, epochs=1,
                                   max_length=seq_chars + 64, micro_batch_tokens=2 * (seq_chars + 64),
                                   keep_last=1, warmup_ratio=0.0))
    result = train_sft(cfg, rows, work / "run", work / "metrics.parquet")
    return {"steps": result.steps, "final_loss": result.final_loss, "model_dir_files": sorted(
        p.name for p in result.model_dir.iterdir()), "wall_s": time.perf_counter() - started}


def add_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--seq-lens", default="4096,8192", help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--micro-tokens", type=int, default=8192, help="padded tokens per micro-batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")


def throughput(report: Report, args: argparse.Namespace) -> None:
    """Every variant (sequence length, with and without torch.compile) runs, and the best reaches 35 % MFU."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from kpipe.train.trainer_memory import PLANS, build_optimizer
    from kpipe.train.sft import SFTConfig, compile_blocks
    from kpipe.train.tiny_model import build_byte_tokenizer, tiny_config

    if not torch.cuda.is_available():
        raise CheckFailed("no CUDA device")
    env = environment()
    tokenizer = build_byte_tokenizer()
    config = tiny_config("qwen3-0.6b", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    accelerator = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    with torch.device(accelerator.device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    n_total = sum(p.numel() for p in model.parameters())
    n_matmul = matmul_params(model)
    d_attn = config.num_attention_heads * config.head_dim
    model = accelerator.prepare(model)
    sft_defaults = SFTConfig(base_model="(from config)", lr=1e-5)
    optimizer = accelerator.prepare(build_optimizer(PLANS["gpu"], model.parameters(), sft_defaults.lr,
                                                    sft_defaults.betas, sft_defaults.weight_decay))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    model.train()
    report.line(
        f"- transformers {env['transformers']}, accelerate {env['accelerate']}; attention: sdpa (flash backend "
        f"enabled: {env['sdpa_flash']}, cuDNN: {env['sdpa_cudnn']}); flash_attn package installed: {env['flash_attn_installed']}",
        f"- model: {n_total / 1e6:.1f}M parameters; N = {n_matmul / 1e6:.1f}M in per-token matmuls; "
        f"{config.num_hidden_layers} layers, d_attn = {d_attn}, vocab {config.vocab_size}",
        "- FLOPs/token F(L) = 6·N + 6·n_layers·L·d_attn (causal attention); MFU = tokens/s · F(L) / 989 TFLOP/s. "
        "`mfu_palm` counts attention without the causal halving (12·n_layers·L·d_attn).",
        "- step = kpipe.train.sft.train_step (length-grouped micro-batches, token-mean loss, grad clip 1.0); "
        "median of the timed steps after warm-up")
    report.table("seq len", "compile", "batch", "micro tokens", "step s", "tokens/s", "GFLOP/token", "MFU",
                 "MFU (PaLM)", "peak GiB", "loss first→last")
    lengths = [int(length) for length in args.seq_lens.split(",")]
    variants = [(length, False) for length in lengths] + ([] if args.no_compile else [(length, True) for length in lengths])
    results = []
    for seq_len, use_compile in variants:
        if use_compile and not any(r["compile"] for r in results):
            compile_blocks(accelerator.unwrap_model(model))
        row: dict[str, Any] = {"seq_len": seq_len, "compile": use_compile, "batch": args.batch,
                               "micro_batch_tokens": max(args.micro_tokens, seq_len)}
        results.append(row)
        if report.out_of_time():
            report.row(seq_len, use_compile, *["-"] * 8, "not run (time budget)", ok=False)
            continue
        try:
            row.update(measure(accelerator, model, optimizer, scheduler, seq_len, args.batch, row["micro_batch_tokens"],
                               args.warmup + (2 if use_compile else 0), args.steps, tokenizer.pad_token_id))
        except Exception as error:  # noqa: BLE001 - a failing variant (e.g. compile) must not hide the others' numbers
            report.row(seq_len, use_compile, *["-"] * 8, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}", ok=False)
            continue
        finally:
            torch.cuda.empty_cache()
        flops = [flops_per_token(n_matmul, config.num_hidden_layers, d_attn, seq_len, causal=c) for c in (True, False)]
        row.update(gflop_per_token=flops[0] / 1e9, mfu=row["tokens_per_s"] * flops[0] / PEAK_BF16_FLOPS,
                   mfu_palm=row["tokens_per_s"] * flops[1] / PEAK_BF16_FLOPS)
        report.row(seq_len, use_compile, args.batch, row["micro_batch_tokens"], f"{row['step_s']:.3f}",
                   f"{row['tokens_per_s']:,.0f}", f"{row['gflop_per_token']:.2f}", f"{100 * row['mfu']:.1f}%",
                   f"{100 * row['mfu_palm']:.1f}%", f"{row['peak_mem_gib']:.1f}", f"{row['loss_first']:.3f}→{row['loss_last']:.3f}")
    report.data.update(env=env, parameters=n_total, matmul_parameters=n_matmul, results=results)
    del model, optimizer, scheduler
    accelerator.free_memory()
    torch.cuda.empty_cache()
    best = max((r for r in results if "mfu" in r), key=lambda r: r["mfu"], default=None)
    if best is None:
        raise CheckFailed("no variant ran")
    report.line("", f"Best: {100 * best['mfu']:.1f}% MFU at L={best['seq_len']}, compile={best['compile']}.")
    report.expect(best["mfu"] >= MFU_TARGET, f"best MFU {100 * best['mfu']:.1f}% misses the {MFU_TARGET:.0%} target")


def train_sft_end_to_end(report: Report, args: argparse.Namespace) -> None:
    """build 0.6B → 2 steps → checkpoint → HF export runs on the GPU."""
    with tempfile.TemporaryDirectory() as work:
        e2e = end_to_end(Path(work), seq_chars=4096)
    report.data.update(e2e)
    report.line(f"`train_sft` (build 0.6B → 2 steps → checkpoint → HF export): `{json.dumps(e2e)}`")


SECTIONS = (Section("throughput", 180, throughput), Section("end_to_end", 60, train_sft_end_to_end))
