#!/usr/bin/env python
"""Benchmark: do GPUs add up? One pass of N evaluations through ``kpipe gym eval-batch``'s pool at
1, 2, 4 ... GPUs, pool start included, and where each worker's time went.

    . scripts/device_env.sh && python benchmarks/gym_scaling.py --evaluations 40 --gpus 1,2

Workload: the side-by-side's ten tasks (bank legit kernels, full KernelBench ``main`` sizes),
cycled to ``--evaluations`` distinct candidates (a comment makes each a new cache key), 5
correctness + 100 timed trials, eager baseline, references run per evaluation (the protocol's
default). Each GPU count runs in its own process with new empty compile caches (every run cold).

Per run: evaluations/min with the pool's start, the start itself, per GPU the seconds its
evaluations took (from the judge's trace, ``KPIPE_GYM_TRACE``) against the run's wall time (a
worker busy far less than the wall time waited on something serial: the dispatcher, a lock), and
the mean seconds of each phase (a phase that grows with the GPU count is contended). Also checks
the recorded timed spans: no two timed regions overlap on one GPU. Writes $OUT/gym_scaling.md (+ .json) when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def overlapping_spans(rows: list[dict[str, object]]) -> int:
    """Pairs of timed regions that overlap on one GPU (by the candidate's device id)."""
    by_gpu: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        for start, end in row["timed_spans"]:  # type: ignore[union-attr]
            by_gpu[str(row["device_id"])].append((start, end))
    count = 0
    for spans in by_gpu.values():
        spans.sort()
        count += sum(1 for (_, end), (start, _) in zip(spans, spans[1:]) if start < end)
    return count


def one_run(evaluations: int, gpus: int, trials: int, shrink: int) -> dict[str, object]:
    """This process: a pool of `gpus` workers, one pass."""
    from kernelbench_side_by_side import TASKS, bank_pairs

    from kpipe.gym import Protocol
    from kpipe.gym.pool import GymPool

    pairs = bank_pairs(TASKS, shrink)
    jobs = [(pairs[i % len(pairs)]["reference"], pairs[i % len(pairs)]["candidate"] + f"\n# candidate {i}\n") for i in range(evaluations)]
    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    os.environ["KPIPE_GYM_TRACE"] = str(trace)
    protocol = Protocol(baseline="eager", correct_trials=5, perf_trials=trials, timeout_s=300)
    started = time.monotonic()
    with GymPool(protocol, workers=gpus, progress=False, reuse_reference=False) as pool:
        start_s = time.monotonic() - started
        results = pool.evaluate_many(jobs)
        workers = pool.workers()
    seconds = time.monotonic() - started
    records = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    wall_by_key = {record["key"]: record["wall_s"] for record in records}
    busy: dict[str, float] = defaultdict(float)
    for result in results:
        busy[result.device_id or "?"] += wall_by_key.get(result.key, 0.0)
    rows = [{"status": r.status, "device_id": r.device_id, "timed_spans": r.timed_spans, "wall_s": r.wall_s} for r in results]
    phases: dict[str, list[float]] = defaultdict(list)  # where an evaluation's seconds went, mean over the run
    for record in records:
        phases["reference child"].append(record.get("reference_s", 0.0))
        for name, phase_s in (record.get("candidate") or {}).get("phases", []):
            phases[f"candidate: {name.split(' trial')[0]}"].append(phase_s)
    return {"gpus": gpus, "evaluations": len(results), "seconds": seconds, "start_s": start_s,
            "statuses": sorted({r.status for r in results}), "busy_s_by_gpu": dict(busy),
            "done_by_worker": [w["done"] for w in workers], "overlapping_spans": overlapping_spans(rows),
            "mean_phase_s": {name: sum(v) / len(records) for name, v in phases.items()} if records else {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--evaluations", type=int, default=40)
    parser.add_argument("--gpus", default="1,2", help="GPU counts to run, each a pool of that many workers")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--shrink", type=int, default=0, help="sizes divided down (a CPU smoke run: --gpus counts CPU workers)")
    parser.add_argument("--one-run", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.evaluations, args.one_run, args.trials, args.shrink)))
        return
    runs = []
    lines = ["| GPUs | evaluations | seconds (pool start) | evaluations/min | x one GPU | evaluations per worker | busy s per GPU | overlapping timed spans |",
             "|---|---|---|---|---|---|---|---|"]
    for gpus in [int(g) for g in args.gpus.split(",")]:
        caches = {name: tempfile.mkdtemp(prefix="cold-") for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
        run = subprocess.run([sys.executable, __file__, "--one-run", str(gpus), "--evaluations", str(args.evaluations),
                              "--trials", str(args.trials), "--shrink", str(args.shrink)],
                             capture_output=True, text=True, env={**os.environ, **caches}, timeout=1800)
        if run.returncode != 0:
            raise SystemExit(f"the {gpus}-GPU run failed:\n{run.stderr[-3000:]}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
        runs.append(result)
        rate = 60 * result["evaluations"] / result["seconds"]
        base = 60 * runs[0]["evaluations"] / runs[0]["seconds"]
        busy = ", ".join(f"{s:.0f}" for s in result["busy_s_by_gpu"].values())
        lines.append(f"| {gpus} | {result['evaluations']} | {result['seconds']:.0f} ({result['start_s']:.1f}) | {rate:.1f} | "
                     f"{rate / base:.2f} | {result['done_by_worker']} | {busy} | {result['overlapping_spans']} |")
        print(lines[-1], flush=True)
    names = list(dict.fromkeys(name for run in runs for name in run["mean_phase_s"]))
    lines += ["", "Mean seconds per evaluation, by phase (the judge's trace):", "",
              "| phase | " + " | ".join(f"{r['gpus']} GPU(s)" for r in runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {name} | " + " | ".join(f"{r['mean_phase_s'].get(name, 0.0):.2f}" for r in runs) + " |" for name in names]
    print("\n".join(lines[len(runs) + 2:]))
    print("statuses: " + json.dumps([r["statuses"] for r in runs]))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gym_scaling.md").write_text("\n".join(lines) + "\n")
        Path(os.environ["OUT"], "gym_scaling.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
