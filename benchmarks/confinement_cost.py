#!/usr/bin/env python
"""Benchmark: what confining candidates (kpipe.gym.confine.sandbox) costs KernelGym's throughput.

    . scripts/device_env.sh && python benchmarks/confinement_cost.py [--rounds 2]

Workload: the side-by-side's ten tasks (``benchmarks/kernelbench_side_by_side.py``: the bank's
legit kernels at full KernelBench ``main`` sizes), 5 correctness + 100 timed trials, eager
baseline, one pool worker, each task's reference run once per worker (the pool's default): one pass, pool start
included. Each run is its own process with new empty compile caches, so every run is cold.
Confined and unconfined (``KPIPE_GYM_UNCONFINED=1``) runs alternate, ``--rounds`` times each,
on the same GPU in one call. Prints evaluations/min per run, the ratio of the medians, and each
run's statuses (they must not differ). When $OUT is set, records its report $OUT/confinement_cost.md
and ledger line (``kpipe.infra.ledger``), with the runs' data in confinement_cost.json.

On a CPU (``--shrink 48``: sizes divided down, the Triton interpreter) it is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kpipe.infra import ledger

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def one_pass(shrink: int, trials: int) -> dict[str, object]:
    """This process: one pool, one pass over the tasks; seconds with the pool's start."""
    from kernelbench_side_by_side import TASKS, bank_pairs

    from kpipe.gym import Protocol
    from kpipe.gym.serve.pool import GymPool

    pairs = bank_pairs(TASKS, shrink)
    protocol = Protocol(baseline="eager", correct_trials=5, perf_trials=trials, timeout_s=300)
    started = time.monotonic()
    with GymPool(protocol, workers=1, progress=False) as pool:
        start_s = time.monotonic() - started
        results = pool.evaluate_many([(p["reference"], p["candidate"]) for p in pairs])
    seconds = time.monotonic() - started
    return {"seconds": seconds, "start_s": start_s, "evaluations": len(results),
            "statuses": {p["task"]: r.status for p, r in zip(pairs, results)},
            "speedups": {p["task"]: r.speedup_eager for p, r in zip(pairs, results)}}


def run_design(confined: bool, shrink: int, trials: int) -> dict[str, object]:
    caches = {name: tempfile.mkdtemp(prefix="cold-") for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    env = {**os.environ, **caches, "KPIPE_GYM_UNCONFINED": "" if confined else "1"}
    try:
        run = subprocess.run([sys.executable, __file__, "--one-pass", "--shrink", str(shrink), "--trials", str(trials)],
                             capture_output=True, text=True, env=env, timeout=900)
    finally:
        for path in caches.values():
            shutil.rmtree(path, ignore_errors=True)
    if run.returncode != 0:
        raise RuntimeError(f"a {'confined' if confined else 'unconfined'} pass failed:\n{run.stderr[-3000:]}")
    return {"confined": confined, **json.loads(run.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shrink", type=int, default=0)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--one-pass", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_pass:
        print(json.dumps(one_pass(args.shrink, args.trials)))
        return
    runs = []
    lines = ["# What confining candidates costs KernelGym's throughput", "",
             f"`benchmarks/confinement_cost.py --rounds {args.rounds} --shrink {args.shrink} --trials {args.trials}`", "",
             "| run | design | evaluations | seconds (pool start) | evaluations/min |", "|---|---|---|---|---|"]
    for round_ in range(args.rounds):
        for confined in (False, True):
            run = run_design(confined, args.shrink, args.trials)
            runs.append(run)
            rate = 60 * run["evaluations"] / run["seconds"]
            lines.append(f"| {round_ + 1} | {'confined' if confined else 'unconfined'} | {run['evaluations']} | "
                         f"{run['seconds']:.1f} ({run['start_s']:.1f}) | {rate:.2f} |")
            print(lines[-1], flush=True)
    rate = {c: statistics.median(60 * r["evaluations"] / r["seconds"] for r in runs if r["confined"] == c) for c in (False, True)}
    same = all(r["statuses"] == runs[0]["statuses"] for r in runs)
    lines += ["", f"median evaluations/min: unconfined {rate[False]:.2f}, confined {rate[True]:.2f} "
                  f"(confined/unconfined = {rate[True] / rate[False]:.3f}); statuses identical in every run: {same}",
              "", "statuses: " + json.dumps(runs[0]["statuses"])]
    print("\n".join(lines[-3:]))
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        (out / "confinement_cost.json").write_text(json.dumps(runs, indent=1))
        figures = {"per_min_unconfined": round(rate[False], 2), "per_min_confined": round(rate[True], 2),
                   "confined_over_unconfined": round(rate[True] / rate[False], 3), "same_statuses": same}
        ledger.record("confinement_cost", "\n".join(lines) + "\n", figures, ledger.local_device(), results=out)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
