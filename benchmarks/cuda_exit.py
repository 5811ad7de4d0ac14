#!/usr/bin/env python
"""Benchmark: what a CUDA process's start and exit cost, alone and with others at once.

Every KernelGym child makes a CUDA context and tears it down when it exits, and the timing lease
passes on only after that exit (``kpipe.gym.confine.isolate``). This measures both ends on bare processes
(no sandbox, no KernelGym), so the gym's trace ("candidate: from its last phase to the exit seen")
can be set against what the driver itself costs:

    python benchmarks/cuda_exit.py --processes 1,2,8 --gib 1

Each process pins one GPU (round robin over the visible ones), makes its context, allocates
``--gib`` GiB and runs a kernel on it, then waits at a barrier; all then exit at once. Per run: the
context's making (first CUDA call) and the exit (the process's last instruction to its parent's
``waitpid`` returning), mean and max over the processes. When $OUT is set, records its report
$OUT/cuda_exit.md and ledger line (``kpipe.infra.ledger``), with the rows in cuda_exit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kpipe.infra import ledger

CHILD = """
import os, sys, time, torch
barrier = sys.argv[1]
started = time.time()
x = torch.empty(int(float(sys.argv[2]) * 2**30) // 4, device="cuda").fill_(1.0)
x.sum().item()
made = time.time()
open(barrier + ".ready." + str(os.getpid()), "w").close()
while not os.path.exists(barrier + ".go"):
    time.sleep(0.001)
print(started, made, time.time(), flush=True)
os._exit(0)
"""


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return max(1, len(out.stdout.strip().splitlines())) if out.returncode == 0 else 1


def one_run(processes: int, gib: float, gpus: int) -> dict[str, float]:
    """`processes` processes on `gpus` GPUs, all exiting at once; seconds of context making and exit."""
    barrier = tempfile.mktemp(prefix="kpipe-cuda-exit-")
    children = []
    for index in range(processes):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(index % gpus)}
        children.append(subprocess.Popen([sys.executable, "-c", CHILD, barrier, str(gib)], env=env, stdout=subprocess.PIPE, text=True))
    directory = Path(barrier).parent
    while len(list(directory.glob(Path(barrier).name + ".ready.*"))) < processes:
        if any(child.poll() is not None for child in children):
            raise SystemExit("a process failed before the barrier")
        time.sleep(0.01)
    reaped: dict[int, float] = {}

    def reap(child: subprocess.Popen[str]) -> None:
        child.wait()
        reaped[child.pid] = time.time()

    waiters = [threading.Thread(target=reap, args=(child,)) for child in children]
    for waiter in waiters:
        waiter.start()
    Path(barrier + ".go").touch()
    for waiter in waiters:
        waiter.join()
    makes, exits = [], []
    for child in children:
        started, made, leaving = map(float, child.stdout.read().split())  # type: ignore[union-attr]
        makes.append(made - started)
        exits.append(reaped[child.pid] - leaving)
    for path in directory.glob(Path(barrier).name + ".*"):
        path.unlink()
    return {"processes": processes, "context_s_mean": sum(makes) / len(makes), "context_s_max": max(makes),
            "exit_s_mean": sum(exits) / len(exits), "exit_s_max": max(exits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2,8", help="runs: how many processes at once")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB each process allocates")
    args = parser.parse_args()
    gpus = gpu_count()
    print(f"{gpus} GPUs, {args.gib:g} GiB per process")
    lines = ["# What a CUDA process's start and exit cost, alone and with others at once", "",
             f"`benchmarks/cuda_exit.py --processes {args.processes} --gib {args.gib:g}` on {gpus} GPUs", "",
             "| processes at once | context made, s (mean, max) | exit, s (mean, max) |", "|---|---|---|"]
    print("\n".join(lines[-2:]))
    rows = []
    for count in map(int, args.processes.split(",")):
        row = one_run(count, args.gib, gpus)
        rows.append(row)
        lines.append(f"| {count} | {row['context_s_mean']:.3f}, {row['context_s_max']:.3f} | "
                     f"{row['exit_s_mean']:.3f}, {row['exit_s_max']:.3f} |")
        print(lines[-1], flush=True)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        (out / "cuda_exit.json").write_text(json.dumps(rows, indent=1))
        ledger.record("cuda_exit", "\n".join(lines) + "\n", figures(rows), ledger.local_device(), results=out)


def figures(rows: list[dict[str, float]]) -> dict[str, float]:
    """The ledger's figures: mean context and exit seconds at each number of processes."""
    return {f"{what}_s_{row['processes']}": round(row[f"{what}_s_mean"], 3) for row in rows for what in ("context", "exit")}


if __name__ == "__main__":
    main()
