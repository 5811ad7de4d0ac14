"""Benchmark: the warm forked pool vs a fresh interpreter per evaluation, same candidates.

Candidates: the bank's legit level-1 kernels (``kpipe.gym.bank.list_solutions("legit")``),
each a distinct evaluation (a comment makes every repeat a new cache key; no cache is used).
Every design runs one worker (one GPU, one task) and the same protocol. Triton compilation is
excluded by a warm-up pass over every candidate first (its kernels land in Triton's on-disk
cache for every design).

Designs, each with the reference re-run per evaluation (the protocol's default: the baseline
is timed next to each candidate) and with the reference run reused per worker
(``reuse_reference``: what an RL step with n rollouts per prompt amortises):

- ``fresh``: ``kpipe.gym.evaluate`` with a new Python interpreter per child process;
- ``pool``: ``kpipe.gym.serve.pool.GymPool``: children forked from a warm zygote.

Every candidate is evaluated ``--per-task`` times in a row (distinct rollouts of one prompt).

Reported per design: evaluations per minute (per GPU: one worker), the median wall time of an
evaluation, and the median overhead beyond the work the protocol must do, where the work is
the time the children spend inside ``run_child`` (measured in the pool's forked children: the
fresh design runs the same code on the same inputs) and overhead = wall time - that work
(interpreter start-up and imports, fork, IPC, loading and judging the children's results).
The median time of each phase of the children (``kpipe.gym.candidate.child.Phase``) shows where the
work goes.

    PYTHONPATH=$PWD/src python benchmarks/gym_pool.py [--per-task 2] [--perf-trials 100]

On CPU it runs the Triton interpreter with tiny sizes. Writes $OUT/gym_pool.md when $OUT is set
(after each design, so a run cut short keeps what it measured) and, at the end, its ledger line
(``kpipe.infra.ledger``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

if not os.environ.get("CUDA_VISIBLE_DEVICES") and "--cpu" in sys.argv:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from kpipe.data.kernelbench import select_problems, shrink_sizes  # noqa: E402
from kpipe.gym.bank import SHRUNK_CAP, list_solutions  # noqa: E402
from kpipe.gym.protocol import Protocol  # noqa: E402
from kpipe.infra import ledger  # noqa: E402

WORK_SUFFIX = "bench.json"
WORK_ROOT = Path(tempfile.gettempdir())


def candidates(cpu: bool) -> list[tuple[str, str, str]]:
    """(name, reference, candidate) for every legit level-1 kernel of the bank."""
    level1 = [s for s in list_solutions("legit") if s.level == 1]
    problems = {p.problem_id: p for p in select_problems("main", [1], {1: [s.problem_id for s in level1]})}
    jobs = []
    for solution in level1:
        reference = problems[solution.problem_id].code
        jobs.append((solution.key, shrink_sizes(reference, SHRUNK_CAP) if cpu else reference, solution.source))
    return jobs


def phase_group(name: str) -> str:
    """'candidate correctness trial 3' -> 'candidate correctness trial': one row per kind."""
    return re.sub(r"\s+\d+$", "", name)


def timed_run_child() -> None:
    """Patch the core's run_child and Phase (in the pool's zygote, so in every forked child)
    to record the child's own duration and the duration of each of its phases."""
    import kpipe.gym.candidate.child as child

    original_run, original_phase = child.run_child, child.Phase.__call__
    marks: list[tuple[str, float]] = []

    def phase(self: child.Phase, name: str) -> None:
        marks.append((name, time.monotonic()))
        original_phase(self, name)

    def run_child(job: dict) -> None:
        marks[:] = [(f"{job['role']} start-up (CUDA, profiler init)", time.monotonic())]
        try:
            original_run(job)
        finally:
            end = time.monotonic()
            phases: dict[str, float] = defaultdict(float)
            for (name, at), (_, until) in zip(marks, marks[1:] + [("", end)]):
                phases[phase_group(name)] += until - at
            record = {"work_s": end - marks[0][1], "phases": phases}
            (WORK_ROOT / f"{Path(job['workdir']).name}.{WORK_SUFFIX}").write_text(json.dumps(record))

    child.Phase.__call__ = phase  # type: ignore[method-assign]
    child.run_child = run_child


def collect_work(since: float) -> tuple[float, dict[str, float]]:
    """Work seconds and per-phase seconds of the children that finished since `since`."""
    total, phases = 0.0, defaultdict(float)
    for path in WORK_ROOT.glob(f"kgym-*.{WORK_SUFFIX}"):
        if path.stat().st_mtime >= since:
            record = json.loads(path.read_text())
            total += record["work_s"]
            for name, seconds in record["phases"].items():
                phases[name] += seconds
        path.unlink(missing_ok=True)
    return total, phases


def interpreter_start_s() -> float:
    """Median wall time of a fresh interpreter importing what a child imports."""
    times = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch, triton, kpipe.gym.candidate.child"], check=True)
        times.append(time.monotonic() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=2, help="evaluations of each candidate in a row, per design")
    parser.add_argument("--perf-trials", type=int, default=100)
    parser.add_argument("--cpu", action="store_true", help="force the CPU interpreter (tiny sizes)")
    args = parser.parse_args()

    from kpipe.gym.judge import evaluation
    from kpipe.gym.serve.pool import GymPool

    device = evaluation.resolve_device(Protocol())
    cpu = device == "cpu"
    protocol = Protocol(perf_trials=5 if cpu else args.perf_trials, warmup=1 if cpu else 10, baseline="eager",
                        correct_trials=2 if cpu else 5, timeout_s=300)
    jobs = candidates(cpu)
    kind = evaluation.device_kind(device)
    print(f"{len(jobs)} level-1 bank kernels on {kind}, {args.per_task} evaluation(s) of each per design", flush=True)
    start_up = interpreter_start_s()
    print(f"fresh interpreter importing torch, triton, kpipe.gym.candidate.child: {start_up:.2f} s", flush=True)

    # the pool's children time run_child: a sitecustomize on PYTHONPATH patches it in the zygote
    hook_dir = WORK_ROOT / f"kgym-bench-{os.getpid()}"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('KGYM_BENCH_TIMING'):\n"
        "    import sys; sys.path.insert(0, os.environ['KGYM_BENCH_DIR'])\n"
        "    from gym_pool import timed_run_child; timed_run_child()\n"
    )
    os.environ.update(KGYM_BENCH_TIMING="1", KGYM_BENCH_DIR=str(Path(__file__).resolve().parent),
                      PYTHONPATH=os.pathsep.join([str(hook_dir), os.environ.get("PYTHONPATH", "")]))

    # the fresh path runs the child module as __main__, which no hook reaches: its work is the
    # pool's measured work on the same candidate, repeat and reference setting (same code and inputs)
    work_of: dict[tuple[str, int, bool], float] = {}
    phase_times: dict[bool, dict[str, list[float]]] = {False: defaultdict(list), True: defaultdict(list)}

    def run_design(name: str, reuse: bool, evaluate_one) -> dict[str, float]:
        walls, overheads = [], []
        for key, reference, candidate in jobs:
            for repeat in range(args.per_task):
                since = time.time() - 1
                started = time.monotonic()
                result = evaluate_one(reference, f"{candidate}\n# bench {name} {reuse} {repeat}\n")
                wall = time.monotonic() - started
                measured, phases = collect_work(since)
                if name == "pool":
                    for phase, seconds in phases.items():
                        phase_times[reuse][phase].append(seconds)
                work = work_of.setdefault((key, repeat, reuse), measured)
                walls.append(wall)
                overheads.append(wall - work)
                print(f"  {name:5s} reuse={reuse!s:5s} {key:12s} {result.status:10s} wall {wall:6.2f} s  "
                      f"work {work:6.2f} s  overhead {wall - work:5.2f} s", flush=True)
        return {"evals_per_min": 60 * len(walls) / sum(walls), "overhead_s": statistics.median(overheads),
                "wall_s": statistics.median(walls)}

    print("warm-up (Triton compilation, excluded)", flush=True)
    for _, reference, candidate in jobs:
        evaluation.evaluate(reference, candidate + "\n# warm-up\n", protocol)
    collect_work(0)
    rows: dict[tuple[str, bool], dict[str, float]] = {}
    for reuse in (False, True):
        with GymPool(protocol, workers=1, progress=False, reuse_reference=reuse) as pool:
            rows[("pool", reuse)] = run_design("pool", reuse, pool.evaluate)
        write_report(report(rows, phase_times, jobs, protocol, kind, start_up, args.per_task))
        evaluation._reference_cache.clear()  # the fresh design starts as cold as the new pool
        rows[("fresh", reuse)] = run_design(
            "fresh", reuse, lambda r, c, reuse=reuse: evaluation.evaluate(r, c, protocol, reuse_reference=reuse))
        write_report(report(rows, phase_times, jobs, protocol, kind, start_up, args.per_task))
    text = report(rows, phase_times, jobs, protocol, kind, start_up, args.per_task)
    print(text)
    if os.environ.get("OUT"):
        figures = {f"per_min_{name}_{'reused' if reuse else 'rerun'}": round(row["evals_per_min"], 1)
                   for (name, reuse), row in rows.items()}
        ledger.record("gym_pool", text + "\n", figures, ledger.device_label(kind, 1), results=Path(os.environ["OUT"]))


def report(rows: dict[tuple[str, bool], dict[str, float]], phase_times: dict[bool, dict[str, list[float]]],
           jobs: list, protocol: Protocol, kind: str, start_up: float, per_task: int) -> str:
    """The markdown summary of the designs measured so far."""
    lines = [
        f"# KernelGym pool benchmark ({kind}, {time.strftime('%Y-%m-%d')})",
        "",
        f"{len(jobs)} level-1 bank kernels x {per_task} evaluations in a row, one worker, protocol: "
        f"{protocol.correct_trials} correctness trials, {protocol.perf_trials} timed trials, baseline eager, "
        f"outputs compared on up to {protocol.compare_max_elements} elements. Fresh interpreter start-up "
        f"(import torch, triton, kpipe.gym.candidate.child): {start_up:.2f} s.",
        "",
        "| design | reference | evaluations / min / GPU | median wall per evaluation (s) | median overhead beyond run_child (s) |",
        "|---|---|---|---|---|",
    ]
    for (name, reuse), row in rows.items():
        label = "fresh interpreter per child" if name == "fresh" else "warm pool (forked children)"
        lines.append(f"| {label} | {'reused per worker' if reuse else 're-run per evaluation'} | "
                     f"{row['evals_per_min']:.1f} | {row['wall_s']:.2f} | {row['overhead_s']:.2f} |")
    lines.append("")
    for reuse in (False, True):
        if ("pool", reuse) in rows and ("fresh", reuse) in rows:
            ratio = rows[("pool", reuse)]["evals_per_min"] / rows[("fresh", reuse)]["evals_per_min"]
            lines.append(f"throughput ratio pool / fresh, reference {'reused' if reuse else 're-run'}: **{ratio:.2f}x**")
    lines += ["", "Median seconds per phase of the pool's children (per evaluation that ran the phase):", "",
              "| phase | reference re-run | reference reused |", "|---|---|---|"]
    for phase in sorted(set(phase_times[False]) | set(phase_times[True])):
        cells = [f"{statistics.median(phase_times[r][phase]):.3f}" if phase_times[r].get(phase) else "-" for r in (False, True)]
        lines.append(f"| {phase} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def write_report(text: str) -> None:
    """The report so far (a run stopped at the device's limit keeps what it measured)."""
    if os.environ.get("OUT"):
        ledger.write_report(Path(os.environ["OUT"]), "gym_pool", text + "\n")


if __name__ == "__main__":
    main()
