#!/usr/bin/env python
"""What a timing window's sketch costs a call: the torch form against the Triton kernel, on one GPU.

    PYTHONPATH=src python benchmarks/sketch_cost.py [--sizes 20,24,26]

Both children of a KernelGym evaluation sketch every output of every timed call
(``kpipe.gym.candidate.trial_data.sketch``), so its time is most of a window's fixed cost on a large
output, and that cost's noise is read as the candidate's time. For outputs of 2^k float32 elements
(KernelBench's L1_40 and L1_88 write 2^26) it prints the milliseconds a call of ``sketch_by_torch``
(kgym-19) and ``sketch_by_kernel`` (kgym-20) take, CUDA events around 20 back-to-back calls after a
warm-up (the kernel's compilation outside them), the spread over 5 such runs, the kernel's effective
read bandwidth, and the largest difference between the two forms relative to the bound's scale.
Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kpipe.gym.candidate.sketch_kernel import sketch_by_kernel
from kpipe.gym.candidate.trial_data import SKETCH_PERIOD, sketch_by_torch, sketch_signs

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
    print(f"# sketch cost a call, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| elements | torch form ms (min-max) | kernel ms (min-max) | ratio | kernel read GB/s | max |diff| / sqrt(V) |")
    print("|---|---|---|---|---|---|")
    for power in (int(p) for p in args.sizes.split(",")):
        output = torch.randn(1 << power, device="cuda")
        signs = sketch_signs(min(output.numel(), SKETCH_PERIOD), 7, "cuda")
        by_torch, by_kernel = per_call_ms(sketch_by_torch, output, signs), per_call_ms(sketch_by_kernel, output, signs)
        a, b = sketch_by_torch(output, signs, 1e-2, 1e-2), sketch_by_kernel(output, signs, 1e-2, 1e-2)
        scale = float(a[-1].sqrt())
        gap = float((a[:-1] - b[:-1]).abs().max()) / scale
        bandwidth = output.numel() * 4 / (statistics.median(by_kernel) * 1e-3) / 1e9
        print(f"| 2^{power} | {statistics.median(by_torch):.3f} ({min(by_torch):.3f}-{max(by_torch):.3f}) "
              f"| {statistics.median(by_kernel):.3f} ({min(by_kernel):.3f}-{max(by_kernel):.3f}) "
              f"| {statistics.median(by_torch) / statistics.median(by_kernel):.1f}x | {bandwidth:.0f} | {gap:.2e} "
              f"(V {float(a[-1]):.4g} against {float(b[-1]):.4g}) |")


if __name__ == "__main__":
    main()
