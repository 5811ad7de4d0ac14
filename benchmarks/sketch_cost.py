#!/usr/bin/env python
"""What a timing window's sketch costs a call: the torch form against the Triton kernel, on one GPU.

    PYTHONPATH=src python benchmarks/sketch_cost.py [--sizes 20,24,26]

Both children of a KernelGym evaluation sketch every output of every timed call
(``kpipe.gym.candidate.trial_data.sketch``), so its time is most of a window's fixed cost on a large
output, and that cost's noise is read as the candidate's time. For outputs of 2^k float32 elements
(KernelBench's L1_40 and L1_88 write 2^26) it prints the milliseconds a call of ``sketch_by_torch``
(the protocol's default ``window_sketch: torch``) and ``sketch_by_kernel`` (``window_sketch: kernel``) take, CUDA events around 20 back-to-back calls after a
warm-up (the kernel's compilation outside them), the spread over 5 such runs, the kernel's effective
read bandwidth, and the largest difference between the two forms relative to the bound's scale.
Figures only: nothing here asserts a time. With ``$OUT``, its report ``sketch_cost.md`` and ledger line.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from kpipe.gym.candidate.sketch_kernel import sketch_by_kernel
from kpipe.gym.candidate.trial_data import SKETCH_PERIOD, sketch_by_torch, sketch_signs
from kpipe.infra import ledger

CALLS = 20
RUNS = 5


def per_call_ms(form, output: torch.Tensor, signs: torch.Tensor) -> list[float]:
    """Milliseconds a call over `RUNS` runs of `CALLS` back-to-back calls."""
    form(output, signs, 1e-2, 1e-2)
    torch.cuda.synchronize()
    runs = []
    for _ in range(RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            form(output, signs, 1e-2, 1e-2)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / CALLS)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,20,24,26", help="log2 of the outputs' elements, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sketch_cost: needs a CUDA GPU (the kernel's form runs only there)")
    lines = [f"# A timing window's sketch a call, {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             f"`benchmarks/sketch_cost.py --sizes {args.sizes}`: CUDA events around {CALLS} back-to-back calls, "
             f"median (min-max) of {RUNS} runs, float32 outputs.", "",
             "| elements | torch form ms (min-max) | kernel ms (min-max) | ratio | kernel read GB/s | max |diff| / sqrt(V) |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    figures: dict[str, float] = {}
    for power in (int(p) for p in args.sizes.split(",")):
        output = torch.randn(1 << power, device="cuda")
        signs = sketch_signs(min(output.numel(), SKETCH_PERIOD), 7, "cuda")
        by_torch, by_kernel = per_call_ms(sketch_by_torch, output, signs), per_call_ms(sketch_by_kernel, output, signs)
        a, b = sketch_by_torch(output, signs, 1e-2, 1e-2), sketch_by_kernel(output, signs, 1e-2, 1e-2)
        gap = float((a[:-1] - b[:-1]).abs().max()) / float(a[-1].sqrt())
        torch_ms, kernel_ms = statistics.median(by_torch), statistics.median(by_kernel)
        figures.update({f"torch_ms_2^{power}": round(torch_ms, 4), f"kernel_ms_2^{power}": round(kernel_ms, 4)})
        lines.append(f"| 2^{power} | {torch_ms:.3f} ({min(by_torch):.3f}-{max(by_torch):.3f}) "
                     f"| {kernel_ms:.3f} ({min(by_kernel):.3f}-{max(by_kernel):.3f}) | {torch_ms / kernel_ms:.1f}x "
                     f"| {output.numel() * 4 / (kernel_ms * 1e-3) / 1e9:.0f} | {gap:.2e} "
                     f"(V {float(a[-1]):.4g} against {float(b[-1]):.4g}) |")
        print(lines[-1], flush=True)
    if os.environ.get("OUT"):
        ledger.record("sketch_cost", "\n".join(lines) + "\n", figures, ledger.local_device(), results=Path(os.environ["OUT"]))


if __name__ == "__main__":
    main()
