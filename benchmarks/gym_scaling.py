#!/usr/bin/env python
"""Benchmark: KernelGym's throughput on one pass, and do GPUs add up? N evaluations through the
pool that ``kpipe gym eval-batch`` and every stage use, at G GPUs with P workers each, pool start
included, beside KernelBench's harness (one spawned process per sample) on the same workload.

    . scripts/device_env.sh && python benchmarks/gym_scaling.py --evaluations 80 --configs 1x1:20,1x4,2x4,4x4 \
        --kb-spawn 10 --anchors .device/anchors/kernelbench_harness

Workload: the side-by-side's ten tasks (bank legit kernels, full KernelBench ``main`` sizes),
cycled to ``--evaluations`` distinct candidates (a comment makes each a new cache key, so each
task's kernel is evaluated evaluations/10 times: the run-to-run spread), 5 correctness + 100 timed
trials, eager baseline, references run per evaluation (``kpipe gym eval-batch``'s default), or with
``--reuse-reference`` once per worker that judges the task (``GymPool``'s default: the pool sends a
task's candidates to the worker that has run its reference, ``kpipe.gym.serve.pool.JobQueue``). Each
configuration runs in its own process with new empty compile caches (every run cold); ``1x1`` is
the scheduling before kgym-8 (one evaluation at a time per GPU).

With ``--passes N`` each configuration's pool then judges N - 1 more passes of new candidates, warm
(the steps of an RL run on its long-lived service), reported in a table of their own. With
``--host-load N``, N busy processes run beside each configuration: how close honest launch-bound
kernels come to the host-clock re-check's bound on a loaded host (each task's lowest margin), e.g.

    python benchmarks/gym_scaling.py --reuse-reference --tasks L2_14,L1_40 --evaluations 40 --passes 2 \
        --configs 1x2 --host-load 16

Per run: evaluations/min with the pool's start, the start itself (until the first worker is
ready), per GPU the seconds its timed regions took against the run's wall time (the GPU's share
spent timing), the mean seconds of each phase, the recorded timed spans (no two may overlap on one
GPU) and per task the spread (max/min) of its candidate times and its median speedup, compared
with the first configuration's; and the rate while every worker is warm and busy, the pass's fixed
seconds beyond it (pool start, cold first evaluations, idle tail) and the one-pass ratios they
give at longer passes (``steady_rate``). When $OUT is set, records its report $OUT/gym_scaling.md and
ledger line (``kpipe.infra.ledger``), with the runs' data in gym_scaling.json and each configuration's trace
records of every pass, each with its ``pass``, in gym_scaling_trace_CONFIG.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernelbench_side_by_side import TASKS  # noqa: E402 (the side-by-side's ten tasks)

from kpipe.infra import ledger  # noqa: E402


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


def one_run(evaluations: int, gpus: int, per_gpu: int, cpu_threads: int | None, trials: int, shrink: int, reuse_reference: bool,
            tasks: list[str], passes: int = 1) -> dict[str, object]:
    """This process: a pool of `per_gpu` workers on each of `gpus` GPUs (each worker `cpu_threads`
    OMP threads, or GymPool's default share of the cores), one pass over `tasks`, then `passes` - 1
    more passes of new candidates (another cache key each) on the same, now warm, pool: what the
    steps of an RL run cost on the run's long-lived KernelGym service. The report's phases and worker
    figures are the first pass's."""
    from kernelbench_side_by_side import bank_pairs

    from kpipe.gym import Protocol
    from kpipe.gym.serve.pool import GymPool

    pairs = bank_pairs(tasks, shrink)
    jobs = [(pairs[i % len(pairs)]["reference"], pairs[i % len(pairs)]["candidate"] + f"\n# candidate {i}\n") for i in range(evaluations)]
    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    os.environ["KPIPE_GYM_TRACE"] = str(trace)
    protocol = Protocol(baseline="eager", correct_trials=5, perf_trials=trials, timeout_s=300)
    started = time.monotonic()
    with GymPool(protocol, workers=gpus, per_gpu=per_gpu, progress=False, reuse_reference=reuse_reference, cpu_threads=cpu_threads) as pool:
        start_s = time.monotonic() - started
        ready_unix = time.time()
        results = pool.evaluate_many(jobs)
        done_unix = time.time()
        workers = pool.workers()  # after the first pass, as every worker figure of the report
        later_passes, later_results = [], []
        for number in range(1, passes):
            begun = time.monotonic()
            again = pool.evaluate_many([(reference, f"{candidate}# pass {number}\n") for reference, candidate in jobs])
            later_passes.append({"seconds": time.monotonic() - begun, "statuses": sorted({r.status for r in again}),
                                 "overlapping_spans": overlapping_spans([{"device_id": r.device_id, "timed_spans": r.timed_spans}
                                                                         for r in results + later_results + again])})
            later_results += again
        cpu_threads = pool.cpu_threads
    seconds = time.monotonic() - started
    every_record = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    records = every_record[:len(jobs)]  # the first pass's
    # the share of a timing window that was its fixed cost (drawing inputs, the answer's file, polling),
    # the reference's, on the judge's clock: what the ratio of windows leaves to noise
    fixed_share = {record["candidate_hash"]: max(record["window_fixed_ms"]) / (1e3 * min(record["window_reference_s"]))
                   for record in every_record if record.get("window_fixed_ms") and record.get("window_reference_s")}
    timed: dict[str, float] = defaultdict(float)
    for result in results:
        timed[result.device_id or "?"] += sum(end - begin for begin, end in result.timed_spans)
    rows = [{"status": r.status, "device_id": r.device_id, "timed_spans": r.timed_spans, "wall_s": r.wall_s} for r in results]
    phases: dict[str, list[float]] = defaultdict(list)  # where an evaluation's seconds went, mean over the run
    for record in records:
        # the judge's side: its whole evaluation, the static screen, the candidate's run as the judge
        # waits for it (setup, the child with its waits, clean-up) and the verdict after it; what
        # the first has beyond the others and the reference is the judge's own overhead
        phases["judge: evaluation, whole"].append(record.get("wall_s", 0.0))
        phases["judge: static screen"].append(record.get("screen_s", 0.0))
        phases["judge: candidate run, whole"].append(record.get("candidate_run_s", 0.0))
        phases["judge: verdict after the child"].append(record.get("verdict_s", 0.0))
        phases["reference child"].append(record.get("reference_s", 0.0))
        phases["candidate: waiting for the timing lease"].append(record.get("candidate_lease_wait_s", 0.0))
        # the judge's side of the candidate's run: before its child had the job, the child from then
        # until its exit was seen (beyond its own phases: its start and exit), and after
        phases["judge: candidate setup, to the hand-over"].append(record.get("candidate_setup_s", 0.0))
        phases["judge: candidate clean-up, after the exit"].append(record.get("candidate_cleanup_s", 0.0))
        candidate = record.get("candidate") or {}
        if "candidate_child_s" in record and "started_unix" in candidate:
            # from the hand-over to its first phase (reading the job), and from its last phase to the
            # exit the judge saw (writing the result, its CUDA context's teardown, the sandbox's exit)
            before_first_phase_s = candidate["started_unix"] - record["candidate_handed_over_unix"]
            phases["candidate: from the hand-over to its first phase"].append(before_first_phase_s)
            phases["candidate: from its last phase to the exit seen"].append(
                record["candidate_child_s"] - before_first_phase_s - sum(phase_s for _, phase_s in candidate.get("phases", [])))
        reference = record.get("reference") or {}
        if reference.get("child_s") is not None:
            phases["reference: outside its phases (setup, start, exit, clean-up)"].append(
                reference["setup_s"] + reference["child_s"] + reference["cleanup_s"]
                - sum(phase_s for _, phase_s in reference.get("phases", [])))
        for name, phase_s in candidate.get("phases", []):
            phases[f"candidate: {name.split(' trial')[0]}"].append(phase_s)
    # every pass's evaluations (the per-task figures pool them)
    tasks = [{"task": pairs[i % len(pairs)]["task"], "pass": i // len(jobs) + 1, "status": r.status, "candidate_ms": r.candidate_ms,
              "speedup": r.speedup_eager, "eager_ms": r.eager_ms,
              "window_fixed_share": fixed_share.get(r.candidate_hash), "why": "; ".join(r.hack_reasons) or r.diagnostic[:300]}
             for i, r in enumerate(results + later_results)]
    return {"gpus": gpus, "per_gpu": per_gpu, "cpu_threads": cpu_threads, "evaluations": len(results), "reuse_reference": reuse_reference,
            "reference_runs": sum(not record.get("reference_reused") for record in records), "seconds": seconds - sum(
                later["seconds"] for later in later_passes), "start_s": start_s, "later_passes": later_passes,
            "statuses": sorted({r.status for r in results}), "timed_s_by_gpu": dict(timed), "tasks": tasks,
            "done_by_worker": [w["done"] for w in workers], "overlapping_spans": overlapping_spans(rows),
            "worker_start_s": [w["start_s"] for w in workers], "worker_start_phases": [w["start_phases"] for w in workers],
            **worker_time(records, ready_unix, done_unix),
            "mean_phase_s": {name: sum(v) / len(records) for name, v in phases.items()} if records else {},
            "challenge_rounds": challenge_rounds(every_record),
            # every pass's trace records, each with its pass (1: the cold one): the warm passes' seconds too
            "records": [{**record, "pass": 1 + index // len(jobs)} for index, record in enumerate(every_record)]}


def worker_time(records: list[dict[str, Any]], ready_unix: float, done_unix: float) -> dict[str, float]:
    """Where the workers' time went between the pool being ready and the pass's last result: the
    mean share a worker spent inside evaluations (its judge's trace), how long the workers sat
    idle at the end, waiting for the last evaluation of another (the pass's tail), how late each
    began its first evaluation (it joined the pool after the first worker), and the mean gap
    between one evaluation's end and the next one's start on a worker (the pool's round trip)."""
    by_judge: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_judge[record.get("judge_pid", 0)].append(record)
    if not by_judge or done_unix <= ready_unix:
        return {}
    window = done_unix - ready_unix
    busy = [sum(r["wall_s"] for r in rs) / window for rs in by_judge.values()]
    tails = [done_unix - max(r["started_unix"] + r["wall_s"] for r in rs) for rs in by_judge.values()]
    joins = [max(0.0, min(r["started_unix"] for r in rs) - ready_unix) for rs in by_judge.values()]
    gaps = []
    for rs in by_judge.values():
        rs = sorted(rs, key=lambda r: r["started_unix"])
        gaps += [b["started_unix"] - (a["started_unix"] + a["wall_s"]) for a, b in zip(rs, rs[1:])]
    return {"busy_share": sum(busy) / len(busy), "tail_s_mean": sum(tails) / len(tails), "tail_s_max": max(tails),
            "join_s_mean": sum(joins) / len(joins), "join_s_max": max(joins), "gap_s_mean": sum(gaps) / len(gaps) if gaps else 0.0,
            **steady_rate(by_judge)}


def steady_rate(by_judge: dict[int, list[dict[str, Any]]]) -> dict[str, float]:
    """Evaluations finished per minute while every worker is warm and busy: from the end of the last
    worker's first evaluation (every worker past its cold start) to the end of the first worker's
    last one (the first to run dry). What a pass adds to that rate is fixed: the pool's start, each
    worker's cold first evaluation and the idle tail. A pass of N evaluations at G GPUs takes
    about fixed + N / rate, so the ratio between two configurations approaches their steady rates'
    only as N grows; the fixed seconds (``one_pass_s(run, 0)``: the pass's seconds less N at this
    rate) say by how much."""
    ends = [sorted(r["started_unix"] + r["wall_s"] for r in rs) for rs in by_judge.values()]
    begin, end = max(e[0] for e in ends), min(e[-1] for e in ends)
    finished = sum(1 for e in ends for t in e if begin < t <= end)
    if end - begin < 1.0 or finished < len(ends):  # too few evaluations per worker to see a steady state
        return {}
    return {"steady_per_min": 60 * finished / (end - begin)}


def per_task(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per task: statuses, the spread (max/min) of its candidate times and of its speedups, and its
    median speedup. With several GPUs or reused references the times are on the scale of whichever
    reference run judged them (each GPU's speed); the speedups are what a run must repeat."""
    from statistics import median

    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in run["tasks"]:
        grouped[row["task"]].append(row)
    out = {}
    for task, rows in grouped.items():
        times = [r["candidate_ms"] for r in rows if r["candidate_ms"]]
        speedups = [r["speedup"] for r in rows if r["speedup"]]
        shares = [r["window_fixed_share"] for r in rows if r.get("window_fixed_share") is not None]
        out[task] = {"statuses": sorted({r["status"] for r in rows}), "runs": len(rows),
                     "fixed_share_highest": max(shares) if shares else None,
                     "ms": median(times) if times else None, "spread": max(times) / min(times) if times else None,
                     "speedup": median(speedups) if speedups else None,
                     "speedup_spread": max(speedups) / min(speedups) if speedups else None}
    return out


def kb_spawn_rate(count: int, anchors: Path, shrink: int) -> dict[str, Any]:
    """KernelBench's harness, one spawned process per sample, on the first `count` jobs' tasks."""
    from kernelbench_side_by_side import bank_pairs, kernelbench_package, run_kb_spawn

    pairs = (bank_pairs(TASKS, shrink) * (count // len(TASKS) + 1))[:count]
    rows, seconds = run_kb_spawn(pairs, kernelbench_package(anchors), 600)
    return {"evaluations": len(rows), "seconds": seconds, "correct": sum(bool(r.get("correct")) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--evaluations", type=int, default=50)
    parser.add_argument("--configs", default="1x1,1x4,2x4",
                        help="GPUSxWORKERS-PER-GPU[tTHREADS][:EVALUATIONS] runs, in order (the first is the reference); "
                             "tTHREADS: each worker's OMP threads instead of the pool's share of the cores")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--shrink", type=int, default=0, help="sizes divided down (a CPU smoke run: GPUs count CPU workers)")
    parser.add_argument("--kb-spawn", type=int, default=0, help="also run KernelBench spawned on this many of the jobs")
    parser.add_argument("--anchors", type=Path, default=ROOT.parent / "shared" / "anchors" / "kernelbench_harness")
    parser.add_argument("--reuse-reference", action="store_true", help="time each task's reference once per worker (GymPool's default)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="the side-by-side's tasks to cycle through (default: all ten)")
    parser.add_argument("--host-load", type=int, default=0,
                        help="busy processes (a pure-Python loop each) beside every configuration's run: a host loaded by "
                             "other work, as the host-clock re-check of launch-bound kernels must survive")
    parser.add_argument("--passes", type=int, default=1,
                        help="passes of new candidates on each configuration's pool (the first cold, pool start included; the "
                             "later ones on the warm pool, as an RL run's steps on its long-lived service)")
    parser.add_argument("--one-run", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        gpus, _, rest = args.one_run.partition("x")
        per_gpu, _, threads = rest.partition("t")
        print(json.dumps(one_run(args.evaluations, int(gpus), int(per_gpu), int(threads) if threads else None, args.trials, args.shrink,
                                 args.reuse_reference, args.tasks.split(","), args.passes)))
        return
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    runs: list[dict[str, Any]] = []
    lines = ([f"Beside every run: {args.host_load} busy processes (a pure-Python loop each).", ""] if args.host_load else []) + [f"References {'reused (run once per worker that judges the task)' if args.reuse_reference else 'run per evaluation'}.", "",
             "| GPUs x workers | evaluations | seconds (pool start) | evaluations/min | per GPU | x first | evaluations per worker | reference runs | timed s per GPU | workers busy | idle tail s (mean, max) | first evaluation after the pool was ready, s (mean, max) | gap between evaluations s | overlapping timed spans |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    printed = len(lines)  # with the rows printed as they come: the rest is printed at the end
    if args.kb_spawn:
        kb = kb_spawn_rate(args.kb_spawn, args.anchors, args.shrink)
        rate = 60 * kb["evaluations"] / kb["seconds"]
        lines.append(f"| KernelBench spawned | {kb['evaluations']} | {kb['seconds']:.0f} | {rate:.1f} | {rate:.1f} | | | {kb['evaluations']} | | | | | | |")
        print(lines[-1], flush=True)
    for config in args.configs.split(","):
        config, _, evaluations = config.partition(":")
        caches = {name: tempfile.mkdtemp(prefix="cold-") for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
        loaders = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.host_load)]
        try:
            run = subprocess.run([sys.executable, __file__, "--one-run", config, "--evaluations", evaluations or str(args.evaluations),
                                  "--trials", str(args.trials), "--shrink", str(args.shrink), "--tasks", args.tasks, "--passes",
                                  str(args.passes), *(["--reuse-reference"] if args.reuse_reference else [])],
                                 capture_output=True, text=True, env={**os.environ, **caches}, timeout=1800)
        finally:
            for loader in loaders:
                loader.kill()
                loader.wait()
            for path in caches.values():
                shutil.rmtree(path, ignore_errors=True)
        if run.returncode != 0:
            raise SystemExit(f"the {config} run failed:\n{run.stderr[-3000:]}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
        records = result.pop("records")
        if out:  # every evaluation's trace record (every pass's), for what the means do not show
            (out / f"gym_scaling_trace_{config}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        runs.append(result)
        rate = 60 * result["evaluations"] / result["seconds"]
        base = 60 * runs[0]["evaluations"] / runs[0]["seconds"]
        timed = ", ".join(f"{s:.0f}" for s in result["timed_s_by_gpu"].values())
        lines.append(f"| {config} | {result['evaluations']} | {result['seconds']:.0f} ({result['start_s']:.1f}) | {rate:.1f} | "
                     f"{rate / result['gpus']:.1f} | {rate / base:.2f} | {result['done_by_worker']} | {result['reference_runs']} | {timed} | "
                     f"{fmt(result.get('busy_share'), '.0%')} | {fmt(result.get('tail_s_mean'), '.1f')}, {fmt(result.get('tail_s_max'), '.1f')} | "
                     f"{fmt(result.get('join_s_mean'), '.1f')}, {fmt(result.get('join_s_max'), '.1f')} | {fmt(result.get('gap_s_mean'), '.3f')} | "
                     f"{result['overlapping_spans']} |")
        print(lines[-1], flush=True)
        if out:  # what is measured so far survives a cut-off run
            (out / "gym_scaling.json").write_text(json.dumps(runs, indent=1))
    if args.passes > 1:
        lines += ["", f"Later passes on each configuration's warm pool ({args.evaluations} new candidates each; no pool start, "
                  "references kept from the first pass): seconds, evaluations/min, x the first configuration's same pass, "
                  "statuses, overlapping timed spans over all passes:", "",
                  "| GPUs x workers | " + " | ".join(f"pass {n + 2}" for n in range(args.passes - 1)) + " |",
                  "|---|" + "---|" * (args.passes - 1)]
        for run in runs:
            cells = []
            for later, first in zip(run["later_passes"], runs[0]["later_passes"]):
                rate, base = 60 * run["evaluations"] / later["seconds"], 60 * runs[0]["evaluations"] / first["seconds"]
                cells.append(f"{later['seconds']:.0f} s, {rate:.1f}/min, **{rate / base:.2f}×**, {'/'.join(later['statuses'])}, "
                             f"{later['overlapping_spans']}")
            lines.append(f"| {label(run)} | " + " | ".join(cells) + " |")
    lines += ["", *steady_table(runs)]
    names = list(dict.fromkeys(name for run in runs for name in run["mean_phase_s"]))
    lines += ["", "Mean seconds per evaluation, by phase (the judge's trace):", "",
              "| phase | " + " | ".join(label(r) for r in runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {name} | " + " | ".join(f"{r['mean_phase_s'].get(name, 0.0):.2f}" for r in runs) + " |" for name in names]
    lines += ["", "Timing challenge rounds per evaluation (the judge stops at the first that fits the claim; kgym-13), "
              "evaluations by rounds run: " + "; ".join(f"{label(r)}: {r.get('challenge_rounds') or 'none traced'}" for r in runs)]
    starts = list(dict.fromkeys(name for run in runs for phases in run.get("worker_start_phases", []) for name in phases))
    lines += ["", "Worker start-up, seconds, mean (max) over the workers: the pool's wait from launch to ready, and its parts as the "
              "worker measured them:", "", "| | " + " | ".join(label(r) for r in runs) + " |", "|---|" + "---|" * len(runs)]
    lines.append("| launch to ready | " + " | ".join(mean_max([s for s in r.get("worker_start_s", []) if s is not None]) for r in runs) + " |")
    lines += [f"| {name} | " + " | ".join(mean_max([p[name] for p in r.get("worker_start_phases", []) if name in p]) for r in runs) + " |"
              for name in starts]
    tables = [per_task(run) for run in runs]
    lines += ["", "Per task: statuses / median candidate ms / spread of candidate ms (max/min over its runs) / median speedup "
              "(ratio to the first configuration's) / spread of speedups [/ the highest share of a timing window that was its "
              "fixed cost, on the judge's clock]:", "",
              "| task | " + " | ".join(label(r) for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for task in tables[0]:
        cells = []
        for table in tables:
            row, first = table.get(task, {}), tables[0][task]
            ratio = row["speedup"] / first["speedup"] if row.get("speedup") and first["speedup"] else None
            cells.append(f"{'/'.join(row.get('statuses', []))} / {fmt(row.get('ms'))} / {fmt(row.get('spread'), '.3f')} / "
                         f"{fmt(row.get('speedup'))} ({fmt(ratio, '.3f')}) / {fmt(row.get('speedup_spread'), '.3f')}"
                         + (f" / fixed {row['fixed_share_highest']:.2f}" if row.get("fixed_share_highest") is not None else ""))
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    unexpected = [f"- {label(run)}, pass {row['pass']}, {row['task']}: {row['status']}: {row['why']}"
                  for run in runs for row in run["tasks"] if row["status"] != "pass"]
    if unexpected:  # every candidate is a bank kernel labelled legit: anything but pass needs its reason
        lines += ["", "Evaluations that did not pass (every candidate is a legit bank kernel):", "", *unexpected]
    print("\n".join(lines[printed + len(runs) + bool(args.kb_spawn):]))
    if out:
        head = [f"# KernelGym on {args.configs}: {args.evaluations} evaluations a pass", "",
                "`benchmarks/gym_scaling.py " + " ".join(sys.argv[1:]) + "`", ""]
        kb_figure = {"per_min_kb_spawn": round(60 * kb["evaluations"] / kb["seconds"], 1)} if args.kb_spawn else {}
        ledger.record("gym_scaling", "\n".join(head + lines) + "\n", {**figures(runs), **kb_figure},
                      ledger.local_device(), results=out)


def figures(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The ledger's figures: each configuration's evaluations/min in one pass and its ratio to the first's."""
    keys = [f"{run['gpus']}x{run['per_gpu']}" for run in runs]
    keys = [key + (f"t{run.get('cpu_threads')}" if keys.count(key) > 1 else "") for key, run in zip(keys, runs)]
    rates = [60 * run["evaluations"] / run["seconds"] for run in runs]
    return {**{f"per_min_{key}": round(rate, 1) for key, rate in zip(keys, rates)},
            **{f"x_first_{key}": round(rate / rates[0], 2) for key, rate in zip(keys[1:], rates[1:])}}


def one_pass_s(run: dict[str, Any], evaluations: int) -> float | None:
    """A pass of `evaluations` on this configuration as measured: its fixed seconds (the pass's
    seconds less its evaluations at the steady rate) plus `evaluations` at that rate."""
    rate = run.get("steady_per_min")
    if not rate:
        return None
    fixed_s = run["seconds"] - 60 * run["evaluations"] / rate
    return fixed_s + 60 * evaluations / rate


def steady_table(runs: list[dict[str, Any]]) -> list[str]:
    """Each configuration's steady rate and fixed seconds (`steady_rate`), and the one-pass ratio to
    the first configuration that they give at this pass's length and at two and four times it (the
    steady rates' ratio is where they tend as passes grow)."""
    first, n = runs[0], runs[0]["evaluations"]
    lengths = [n, 2 * n, 4 * n]
    lines = ["Every worker busy: evaluations/min from the last worker's first evaluation to the first worker running dry; "
             "fixed seconds: the pass's less its evaluations at that rate (the pool's start, the cold first evaluations, the "
             "idle tail); a pass of N evaluations takes about fixed + N at the rate, which gives the one-pass ratios to the "
             "first configuration at longer passes:", "",
             "| GPUs x workers | evaluations/min, every worker busy | x first | fixed s | " +
             " | ".join(f"one pass of {length}, x first" for length in lengths) + " |", "|---|---|---|---|" + "---|" * len(lengths)]
    for run in runs:
        rate, base = run.get("steady_per_min"), first.get("steady_per_min")
        if not rate or not base:
            lines.append(f"| {label(run)} | too few evaluations per worker | | |" + " |" * len(lengths))
            continue
        ratios = [one_pass_s(first, length) / one_pass_s(run, length) for length in lengths]
        lines.append(f"| {label(run)} | {rate:.1f} | {rate / base:.2f} | {one_pass_s(run, 0):.1f} | " +
                     " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |")
    return lines


def challenge_rounds(records: list[dict[str, Any]]) -> str:
    """How many evaluations ran 1, 2, ... rounds of the timing challenge, from the judge's trace."""
    counts: dict[int, int] = defaultdict(int)
    for record in records:
        if record.get("challenge_rounds"):
            counts[int(record["challenge_rounds"])] += 1
    return ", ".join(f"{rounds}: {counts[rounds]}" for rounds in sorted(counts))


def label(run: dict[str, Any]) -> str:
    return f"{run['gpus']}x{run['per_gpu']}" + (f" ({run['cpu_threads']} threads)" if run.get("cpu_threads") else "")


def mean_max(values: list[float]) -> str:
    return f"{sum(values) / len(values):.2f} ({max(values):.2f})" if values else "-"


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
