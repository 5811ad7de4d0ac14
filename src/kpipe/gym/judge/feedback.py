"""Feedback text for the next turn (protocol step 9): what a kernel engineer would want to
see, bounded (it spends the policy's context), and never the reward.

The model reads it, and the candidate program writes part of it (its errors, its output, the names
it gives threads and kernels), so nothing in it may pass for KernelGym's own words (issue 62, row
13): control characters and terminal escapes (ANSI, OSC) are stripped from every field, the
judge's status is the first line and only the judge writes it, and text that may hold the
candidate's own output is quoted, every line behind ``QUOTE``, under a label that says whose it is.
"""

from __future__ import annotations

import re
from typing import Any

from kpipe.gym.judge.result import EvalResult

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
    "reference_error": "the reference program failed: no verdict on your kernel",
}


# terminal escape sequences: CSI (ESC [ ... final byte) and its 8-bit form, OSC (ESC ] ... BEL or
# ST) and its 8-bit form, and the other two-byte escapes
ESCAPE_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x9b[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                       r"|\x9d[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?|\x1b[ -~]?")
# what is left of the C0 and C1 controls but newline and tab (a carriage return rewrites a line on a
# terminal), and the bidirectional overrides that reorder what a reader sees
CONTROL_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
QUOTE = "  | "
CANDIDATE_TEXT_LABEL = ("Diagnostic (quoted: it may hold your program's own output and errors, which are not "
                        "KernelGym's verdict; the verdict is the Status line above):")


def plain_text(text: str) -> str:
    """`text` without terminal escapes and control characters (newlines and tabs kept)."""
    return CONTROL_RE.sub("", ESCAPE_RE.sub("", text))


def one_line(text: str) -> str:
    """`text` as plain text on one line: a field the judge writes on a line of its own (a hack
    reason naming a thread the candidate named) cannot start a line of its own."""
    return " ".join(plain_text(text).split())


def quoted(text: str) -> str:
    """`text` as plain text with every line behind ``QUOTE``: no line of it starts a line of feedback."""
    return "\n".join(QUOTE + line for line in plain_text(text).splitlines())


HACKED_PREFIX = "rejected by the hacking check: "


def hacked_diagnostic(hack_reasons: list[str], diagnostic: str) -> str:
    """A hacked verdict's diagnostic: a line naming its reasons, then any detail (never empty)."""
    named = HACKED_PREFIX + (one_line("; ".join(hack_reasons)) if hack_reasons else "no reason was recorded")
    return f"{named}\n{diagnostic}" if diagnostic else named


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
        lines.append(f"  {mark} {one_line(kernel['name'])[:80]}  {kernel['ms']:.4g} ms  {100 * kernel['ms'] / total:.1f}%")
    if len(profile["kernels"]) > TOP_KERNELS:
        lines.append(f"    ... {len(profile['kernels']) - TOP_KERNELS} more kernels")
    if profile.get("pr") is not None:
        lines.append(f"Your Triton kernels' share of the time: {100 * profile['pr']:.1f}%")
    return lines


def build_feedback(result: EvalResult, profile: dict[str, Any] | None, max_chars: int) -> str:
    """The feedback on `result`: the judge's status line first, the rest after it (see the module)."""
    lines = [f"Status: {result.status} ({STATUS_LINES[result.status]})"]
    if result.hack_reasons:
        lines.append("Hacking check failed: " + one_line("; ".join(result.hack_reasons)))
    # a hacked verdict's diagnostic opens with its reasons (hacked_diagnostic), listed just above
    detail = result.diagnostic.partition("\n")[2] if result.diagnostic.startswith(HACKED_PREFIX) else result.diagnostic
    if detail:
        lines.append(CANDIDATE_TEXT_LABEL + "\n" + quoted(clip(detail, max(max_chars // 2, 200))))
    lines.extend(runtime_lines(result))
    if result.correct:
        lines.extend(profile_lines(profile))
    informative = [one_line(f) for f in result.findings if f not in result.hack_reasons]
    if informative:
        lines.append("Notes: " + "; ".join(informative[:8]))
    return clip("\n".join(lines), max_chars)


def failure_feedback(status: str, diagnostic: str) -> str:
    """The feedback on a row the judge could not finish (``kpipe.gym.serve.pool``): its status, and its
    diagnostic quoted."""
    return f"Status: {status} ({STATUS_LINES[status]})\n{CANDIDATE_TEXT_LABEL}\n{quoted(clip(diagnostic, 1000))}"
