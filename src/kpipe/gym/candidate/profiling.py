"""Profiling-based rewards' input (paper Eq. 7): the share of device time spent in the
candidate's own Triton kernels, from the torch profiler on a GPU or host clocks on a CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from kpipe.gym.candidate import instrument
from kpipe.gym.candidate.timing import Clocks


def profile_cuda(forward: Callable[[], Any], launched: set[str], runs: int = 3) -> dict[str, Any]:
    """Paper Eq. 7: PR = device time of the launched Triton kernels (exact names) / total CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            forward()
        torch.cuda.synchronize()
    return profile_summary(cuda_time_per_name(prof.events(), runs), launched | instrument.COMPILED_NAMES, "cuda")


def cuda_time_per_name(events: Iterable[Any], runs: int) -> dict[str, float]:
    """Mean device ms per run of every CUDA event by name. Eq. 7's T_total is "the overall CUDA execution
    time", so memcpy and memset count too: a kernel that adds copies is charged for them."""
    from torch.autograd import DeviceType

    per_name: dict[str, float] = {}
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        name = getattr(event, "trace_name", None) or event.name  # trace_name: not shortened
        per_name[name] = per_name.get(name, 0.0) + event.time_range.elapsed_us() / 1e3 / runs
    return per_name


def profile_cpu(forward: Callable[[], Any], clocks: Clocks, runs: int = 2) -> dict[str, Any]:
    """CPU estimate (no GPU profile under the interpreter): host time inside Triton launches
    / host time of the whole forward."""
    per_kernel: dict[str, float] = {}
    total = 0.0
    for _ in range(runs):
        with instrument.recording() as log:
            t0 = clocks.perf_counter()
            forward()
            total += clocks.perf_counter() - t0
        for name, seconds in log.per_kernel_seconds.items():
            per_kernel[name] = per_kernel.get(name, 0.0) + seconds * 1e3 / runs
    generated_ms = sum(per_kernel.values())
    other_ms = max(total * 1e3 / runs - generated_ms, 0.0)
    if other_ms > 0:
        per_kernel["(host: torch ops and Python)"] = other_ms
    return profile_summary(per_kernel, {n for n in per_kernel if not n.startswith("(")}, "cpu")


def profile_summary(per_kernel_ms: dict[str, float], generated: set[str], kind: str) -> dict[str, Any]:
    total = sum(per_kernel_ms.values())
    generated_ms = sum(ms for name, ms in per_kernel_ms.items() if name in generated)
    kernels = sorted(per_kernel_ms.items(), key=lambda kv: -kv[1])
    return {
        "kind": kind,
        "pr": generated_ms / total if total > 0 else None,
        "kernels": [{"name": n, "ms": ms, "generated": n in generated} for n, ms in kernels],
    }
