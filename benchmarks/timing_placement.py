#!/usr/bin/env python
"""Does a kernel's timed median depend on where its tensors landed in GPU memory, or on the process?

    . scripts/device_env.sh && python benchmarks/timing_placement.py --tasks L2_12,L2_86,L2_9

kpipe times each candidate in a fresh child process; on the H100 the medians of the same Triton
GEMM kernel spread 4-10 % between evaluations while, within one process, variants of the timing
method agreed within 1-2 % (docs/gpu-results/kernelbench_side_by_side_2026-11-25_H100.md). This
separates the two candidate causes, for each task's bank legit kernel:

- **placement**: in one process, the model and inputs are built anew `--builds` times, each after
  a dummy allocation of a different size (so the tensors land elsewhere), and timed with kpipe's
  ``time_forward`` (kgym-3 region); then the *same* build is timed `--builds` times more (the
  method's own repeatability);
- **process**: `--processes` fresh interpreters each build once and time once.

Prints each set's medians and max/min. Spread across builds ≈ across processes ≫ same build:
placement. Across processes ≫ across builds: something per process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from noise_runs import loaded_pairs  # noqa: E402


def measure(tasks: list[str], builds: int, same: int, trials: int) -> dict[str, Any]:
    """In this process: per task, `builds` fresh builds then `same` re-timings of the last one."""
    import torch

    from kpipe.gym.protocol import Protocol
    from kpipe.gym.timing import Clocks, l2_flush_buffer, time_forward, timed_region

    protocol = Protocol()
    clocks = Clocks("cuda")
    l2 = l2_flush_buffer(protocol, "cuda")
    out: dict[str, Any] = {}
    for pair in loaded_pairs(tasks):

        def timed(model: Any, input_sets: list[Any]) -> float:
            result = time_forward(model, input_sets, trials, protocol.warmup, clocks, l2, set(), lambda outs: [], **timed_region(protocol))
            ordered = sorted(result["ms"])
            return ordered[len(ordered) // 2]

        across_builds, same_build = [], []
        for b in range(builds):
            shift = torch.empty((b + 1) * 37 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # moves what comes next
            model, input_sets = pair.candidate_model(), pair.input_sets(2)
            with torch.no_grad():
                model(*input_sets[0])
            torch.cuda.synchronize()
            across_builds.append(timed(model, input_sets))
            if b == builds - 1:
                same_build = [timed(model, input_sets) for _ in range(same)]
            del model, input_sets, shift
            torch.cuda.empty_cache()
        out[pair.task] = {"across_builds": across_builds, "same_build": same_build}
    return out


def spread(values: list[float]) -> str:
    return f"{max(values) / min(values):.3f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="L2_12,L2_86,L2_9")
    parser.add_argument("--builds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    if args.child:
        print(json.dumps(measure(tasks, 1, 0, args.trials)))
        return
    started = time.monotonic()
    here = measure(tasks, args.builds, args.builds, args.trials)
    across_processes: dict[str, list[float]] = {task: [] for task in tasks}
    for _ in range(args.processes):
        done = subprocess.run([sys.executable, __file__, "--child", "--tasks", args.tasks, "--trials", str(args.trials)],
                              capture_output=True, text=True, check=True)
        for task, row in json.loads(done.stdout.strip().splitlines()[-1]).items():
            across_processes[task] += row["across_builds"]
    lines = ["| task | same build, re-timed | max/min | fresh builds, one process | max/min | fresh processes | max/min |",
             "|---|---|---|---|---|---|---|"]
    for task in tasks:
        same, builds, processes = here[task]["same_build"], here[task]["across_builds"], across_processes[task]
        lines.append(f"| {task} | {', '.join(f'{v:.3f}' for v in same)} | {spread(same)} | {', '.join(f'{v:.3f}' for v in builds)} | "
                     f"{spread(builds)} | {', '.join(f'{v:.3f}' for v in processes)} | {spread(processes)} |")
    lines.append(f"\nmedian ms of {args.trials} timed trials each (kgym-3 region); whole run {time.monotonic() - started:.0f} s")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
