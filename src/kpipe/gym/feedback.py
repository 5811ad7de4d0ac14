"""Feedback text for the next turn (protocol step 9): what a kernel engineer would want to
see, bounded (it spends the policy's context), and never the reward."""

from __future__ import annotations

from typing import Any

from kpipe.gym.result import EvalResult

TOP_KERNELS = 6
STATUS_LINES = {
    "pass": "correct",
    "mismatch": "incorrect output",
    "runtime_error": "runtime error",
    "compilation_error": "compilation error",
    "timeout": "timed out",
    "crashed": "crashed",
    "oom": "out of memory",
    "resource_limit": "stopped at a resource limit",
    "format_error": "format error",
    "hacked": "rejected by the hacking check",
    "illegal_memory_access": "CUDA illegal memory access",
    "misaligned_address": "CUDA misaligned address",
    "illegal_instruction": "CUDA illegal instruction",
    "device_assert": "CUDA device-side assert",
}


def clip(text: str, limit: int) -> str:
    """Keep the head and the tail (tracebacks end with the useful line)."""
    if len(text) <= limit:
        return text
    half = max(limit // 2 - 20, 0)
    return f"{text[:half]}\n[... {len(text) - 2 * half} chars omitted ...]\n{text[-half:]}"


def format_ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.4g} ms"


def runtime_lines(result: EvalResult) -> list[str]:
    if result.candidate_ms is None:
        return []
    clock = "GPU, on the judge's clock" if result.timing_kind == "cuda" else "CPU (Triton interpreter; not GPU performance)"
    lines = [f"Runtime [{clock}]: your kernel {format_ms(result.candidate_ms)}"]
    if result.eager_ms is not None:
        lines.append(f"  PyTorch eager {format_ms(result.eager_ms)} -> speedup {result.speedup_eager:.3g}x")
    if result.compile_ms is not None:
        lines.append(f"  torch.compile {format_ms(result.compile_ms)} -> speedup {result.speedup_compile:.3g}x")
    return lines


def profile_lines(profile: dict[str, Any] | None) -> list[str]:
    if not profile or not profile.get("kernels"):
        return []
    total = sum(k["ms"] for k in profile["kernels"]) or 1.0
    what = "GPU kernel time" if profile["kind"] == "cuda" else "host time (CPU estimate)"
    lines = [f"Profile (share of {what}; * = your Triton kernels):"]
    for kernel in profile["kernels"][:TOP_KERNELS]:
        mark = "*" if kernel["generated"] else " "
        lines.append(f"  {mark} {kernel['name'][:80]}  {kernel['ms']:.4g} ms  {100 * kernel['ms'] / total:.1f}%")
    if len(profile["kernels"]) > TOP_KERNELS:
        lines.append(f"    ... {len(profile['kernels']) - TOP_KERNELS} more kernels")
    if profile.get("pr") is not None:
        lines.append(f"Your Triton kernels' share of the time: {100 * profile['pr']:.1f}%")
    return lines


def build_feedback(result: EvalResult, profile: dict[str, Any] | None, max_chars: int) -> str:
    lines = [f"Status: {result.status} ({STATUS_LINES[result.status]})"]
    if result.hack_reasons:
        lines.append("Hacking check failed: " + "; ".join(result.hack_reasons))
    if result.diagnostic:
        lines.append("Diagnostic:\n" + clip(result.diagnostic, max(max_chars // 2, 200)))
    lines.extend(runtime_lines(result))
    if result.correct:
        lines.extend(profile_lines(profile))
    informative = [f for f in result.findings if f not in result.hack_reasons]
    if informative:
        lines.append("Notes: " + "; ".join(informative[:8]))
    return clip("\n".join(lines), max_chars)
