"""GPU check of kpipe's SFT step: throughput and model FLOPs utilisation (MFU) of a
Qwen3-0.6B-sized model built from config (random weights, no download), bf16 autocast over fp32
master weights, fused AdamW: exactly `kpipe.train.sft.train_step`, the step `train_sft` runs.

    PYTHONPATH=src PYTHONUNBUFFERED=1 python scripts/gpu_check_sft.py            # ~3-4 minutes on one H100

Model FLOPs per token (stated, as the report does):
    F(L) = 6·N + 6·n_layers·L·d_attn
N = parameters that do matmuls per token (all but the input embedding; with tied embeddings the
lm_head matmul counts once), L = sequence length, d_attn = n_heads·head_dim. The second term is
causal attention (QKᵀ and AV, forward 2·L·d_attn per token per layer, ×3 for forward+backward).
The PaLM-paper convention counts attention without the causal halving (12·n_layers·L·d_attn);
both are reported. MFU = tokens/s · F(L) / peak, peak = 989 TFLOP/s (H100/H200 SXM, bf16 dense).

Then a short end-to-end `train_sft` run (build → train → checkpoint → HF export) on the same
model size, to show the whole path works on a GPU. Writes $OUT/sft_check.md (+ .json) when
$OUT is set; exit status 1 when a part failed or the best MFU misses the 35 % target.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import gpu_harness  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100 SXM / H200 dense bf16 tensor-core peak
MFU_TARGET = 0.35


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters used in a matmul for every token: everything but the input embedding lookup."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    return total if tied else total - embedding.numel()


def flops_per_token(n_matmul: int, n_layers: int, d_attn: int, seq_len: int, causal: bool = True) -> float:
    attention = (6 if causal else 12) * n_layers * seq_len * d_attn
    return 6 * n_matmul + attention


def environment() -> dict:
    """The device facts every check reports, and what decides attention's speed here."""
    import accelerate
    import transformers

    info = {
        **gpu_harness.device_facts(), "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
        "sdpa_flash": torch.backends.cuda.flash_sdp_enabled(),
        "sdpa_cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "sdpa_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
    }
    return info


def synthetic_samples(n: int, seq_len: int, vocab: int, prompt_fraction: float, seed: int) -> list:
    """Random token sequences; the first `prompt_fraction` of each is context (no loss), like an SFT turn."""
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="4096,8192", help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--micro-tokens", type=int, default=8192, help="padded tokens per micro-batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end train_sft run")
    parser.add_argument("--budget-s", type=float, default=200, help="skip remaining parts after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check_sft: no CUDA device")
    t0 = time.perf_counter()

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from kpipe.train.sft import SFTConfig, build_optimizer, compile_blocks
    from kpipe.train.tiny_model import build_byte_tokenizer, tiny_config

    env = environment()
    print(json.dumps(env, indent=2))
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
    cfg = SFTConfig(base_model="(from config)", lr=1e-5)
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(build_optimizer(model, cfg))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    model.train()
    print(f"model: {n_total / 1e6:.1f}M parameters, {n_matmul / 1e6:.1f}M in per-token matmuls; attention {env['device']}")

    variants = [(int(L), False) for L in args.seq_lens.split(",")]
    if not args.no_compile:
        variants += [(int(L), True) for L in args.seq_lens.split(",")]
    results = []
    compiled = False
    for seq_len, use_compile in variants:
        if time.perf_counter() - t0 > args.budget_s:
            results.append({"seq_len": seq_len, "compile": use_compile, "skipped": "time budget"})
            continue
        if use_compile and not compiled:
            compile_blocks(accelerator.unwrap_model(model))
            compiled = True
        micro = max(args.micro_tokens, seq_len)
        row = {"seq_len": seq_len, "compile": use_compile, "micro_batch_tokens": micro, "batch": args.batch}
        try:
            row.update(measure(accelerator, model, optimizer, scheduler, seq_len, args.batch, micro,
                               args.warmup + (2 if use_compile else 0), args.steps, tokenizer.pad_token_id))
            f_causal = flops_per_token(n_matmul, config.num_hidden_layers, d_attn, seq_len, causal=True)
            f_palm = flops_per_token(n_matmul, config.num_hidden_layers, d_attn, seq_len, causal=False)
            row["gflop_per_token"] = f_causal / 1e9
            row["mfu"] = row["tokens_per_s"] * f_causal / PEAK_BF16_FLOPS
            row["mfu_palm"] = row["tokens_per_s"] * f_palm / PEAK_BF16_FLOPS
        except torch.OutOfMemoryError as error:
            row["error"] = f"OOM: {str(error).splitlines()[0]}"
        except Exception as error:  # a failing variant (e.g. compile) must not hide the others' numbers
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        torch.cuda.empty_cache()
        print(json.dumps(row))
        results.append(row)

    del model, optimizer, scheduler
    accelerator.free_memory()
    torch.cuda.empty_cache()
    e2e: dict = {"skipped": "--no-e2e"} if args.no_e2e else {}
    if not args.no_e2e:
        if time.perf_counter() - t0 > args.budget_s:
            e2e = {"skipped": "time budget"}
        else:
            with tempfile.TemporaryDirectory() as work:
                try:
                    e2e = end_to_end(Path(work), seq_chars=4096)
                except Exception as error:
                    e2e = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    print(json.dumps({"end_to_end": e2e}))
    return report(env, n_total, n_matmul, config, results, e2e, time.perf_counter() - t0)


def report(env: dict, n_total: int, n_matmul: int, config, results: list[dict], e2e: dict, wall_s: float) -> int:
    """Print and write the report; the exit status: 1 when a part failed or the best MFU misses 35 %."""
    lines = [
        "# SFT step on one GPU: Qwen3-0.6B-sized model (random weights), bf16 autocast, fused AdamW", "",
        f"- {gpu_harness.facts_line(env)}, transformers {env['transformers']}, accelerate {env['accelerate']}",
        f"- attention: sdpa (flash backend enabled: {env['sdpa_flash']}, cuDNN: {env['sdpa_cudnn']}); "
        f"flash_attn package installed: {env['flash_attn_installed']}",
        f"- model: {n_total / 1e6:.1f}M parameters; N = {n_matmul / 1e6:.1f}M in per-token matmuls; "
        f"{config.num_hidden_layers} layers, d_attn = {config.num_attention_heads * config.head_dim}, "
        f"vocab {config.vocab_size}",
        "- FLOPs/token F(L) = 6·N + 6·n_layers·L·d_attn (causal attention); MFU = tokens/s · F(L) / 989 TFLOP/s. "
        "`mfu_palm` counts attention without the causal halving (12·n_layers·L·d_attn).",
        "- step = kpipe.train.sft.train_step (length-grouped micro-batches, token-mean loss, grad clip 1.0); "
        "median of the timed steps after warm-up", "",
        "| seq len | compile | batch | micro tokens | step s | tokens/s | GFLOP/token | MFU | MFU (PaLM) | peak GiB | loss first→last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "tokens_per_s" in r:
            lines.append(f"| {r['seq_len']} | {r['compile']} | {r['batch']} | {r['micro_batch_tokens']} | {r['step_s']:.3f} "
                         f"| {r['tokens_per_s']:,.0f} | {r['gflop_per_token']:.2f} | {100 * r['mfu']:.1f}% "
                         f"| {100 * r['mfu_palm']:.1f}% | {r['peak_mem_gib']:.1f} | {r['loss_first']:.3f}→{r['loss_last']:.3f} |")
        else:
            lines.append(f"| {r['seq_len']} | {r['compile']} | - | - | - | - | - | - | - | - | "
                         f"{r.get('error') or r.get('skipped')} |")
    best = max((r for r in results if "mfu" in r), key=lambda r: r["mfu"], default=None)
    if best is not None:
        verdict = "meets" if best["mfu"] >= MFU_TARGET else "misses"
        lines += ["", f"Best: {100 * best['mfu']:.1f}% MFU at L={best['seq_len']}, compile={best['compile']} "
                      f"({verdict} the 35% target)."]
    lines += ["", f"End-to-end train_sft (build 0.6B → 2 steps → checkpoint → HF export): `{json.dumps(e2e)}`",
              "", f"Wall time of this check: {wall_s:.0f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    gpu_harness.write_report("sft_check", text, {"env": env, "results": results, "end_to_end": e2e})
    failures = [f"L={r['seq_len']} compile={r['compile']}: {r['error']}" for r in results if "error" in r]
    failures += [f"end-to-end train_sft: {e2e['error']}"] if "error" in e2e else []
    failures += [f"best MFU {100 * best['mfu']:.1f}% misses the {MFU_TARGET:.0%} target"] if best and best["mfu"] < MFU_TARGET else []
    return gpu_harness.exit_status(failures)


if __name__ == "__main__":
    sys.exit(main())
