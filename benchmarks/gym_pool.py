"""Benchmark: the warm forked pool vs a fresh interpreter per evaluation, same candidates.

Candidates: the bank's legit level-1 kernels (``kpipe.gym.bank.list_solutions("legit")``),
each a distinct evaluation (a comment makes every repeat a new cache key; no cache is used).
Both designs run one worker (one GPU, one task) and the same protocol. Triton compilation is
excluded by a warm-up pass over every candidate first (its kernels land in Triton's on-disk
cache for both designs).

Reported per design: evaluations per minute (per GPU: one worker) and the overhead per
evaluation beyond the work the protocol must do, where the work is the time the children
spend inside ``run_child`` (measured in the pool's forked children; the fresh design runs the
same code on the same inputs) and overhead = wall time of the evaluation - that work
(interpreter start-up and imports, fork, IPC, judging).

    PYTHONPATH=src python benchmarks/gym_pool.py [--repeats 3] [--perf-trials 100]

On CPU it runs the Triton interpreter with tiny sizes. Writes $OUT/gym_pool.md when $OUT is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("CUDA_VISIBLE_DEVICES") and "--cpu" in sys.argv:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from kpipe.data.kernelbench import select_problems, shrink_sizes  # noqa: E402
from kpipe.gym.bank import SHRUNK_CAP, list_solutions  # noqa: E402
from kpipe.gym.protocol import Protocol  # noqa: E402

WORK_FILE = "work_s"


def candidates(cpu: bool) -> list[tuple[str, str, str]]:
    """(name, reference, candidate) for every legit level-1 kernel of the bank."""
    level1 = [s for s in list_solutions("legit") if s.level == 1]
    problems = {p.problem_id: p for p in select_problems("main", [1], {1: [s.problem_id for s in level1]})}
    jobs = []
    for solution in level1:
        reference = problems[solution.problem_id].code
        jobs.append((solution.key, shrink_sizes(reference, SHRUNK_CAP) if cpu else reference, solution.source))
    return jobs


def timed_run_child() -> None:
    """Wrap the core's run_child (in every child, both designs) to record its own duration."""
    import kpipe.gym.child as child

    original = child.run_child

    def run_child(job: dict) -> None:
        started = time.monotonic()
        try:
            original(job)
        finally:
            with open(Path(job["workdir"]) / ".." / f"{Path(job['workdir']).name}.{WORK_FILE}", "w") as f:
                f.write(str(time.monotonic() - started))

    child.run_child = run_child


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="evaluations of each candidate per design")
    parser.add_argument("--perf-trials", type=int, default=100)
    parser.add_argument("--cpu", action="store_true", help="force the CPU interpreter (tiny sizes)")
    args = parser.parse_args()

    from kpipe.gym import evaluation
    from kpipe.gym.pool import GymPool

    device = evaluation.resolve_device(Protocol())
    cpu = device == "cpu"
    protocol = Protocol(perf_trials=5 if cpu else args.perf_trials, warmup=1 if cpu else 10, baseline="eager",
                        correct_trials=2 if cpu else 5, timeout_s=300)
    jobs = candidates(cpu)
    print(f"{len(jobs)} level-1 bank kernels on {evaluation.device_kind(device)}, {args.repeats} repeats per design", flush=True)

    # the pool's children time run_child: a sitecustomize on PYTHONPATH patches it in the zygote
    hook_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kgym-bench-{os.getpid()}"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('KGYM_BENCH_TIMING'):\n"
        "    import sys; sys.path.insert(0, os.environ['KGYM_BENCH_DIR'])\n"
        "    from gym_pool import timed_run_child; timed_run_child()\n"
    )
    bench_dir = str(Path(__file__).resolve().parent)
    os.environ.update(KGYM_BENCH_TIMING="1", KGYM_BENCH_DIR=bench_dir,
                      PYTHONPATH=os.pathsep.join([str(hook_dir), os.environ.get("PYTHONPATH", "")]))
    import tempfile

    work_root = Path(tempfile.gettempdir())

    def work_seconds(since: float) -> float:
        total = 0.0
        for path in work_root.glob(f"kgym-*.{WORK_FILE}"):
            if path.stat().st_mtime >= since:
                total += float(path.read_text())
            path.unlink(missing_ok=True)
        return total

    # the fresh path runs the child module as __main__, which no hook reaches: its work is the
    # pool children's measured work on the same candidate and repeat (same code, same inputs)
    work_of: dict[tuple[str, int], float] = {}

    def run_design(name: str, evaluate_one) -> dict[str, float]:
        walls, overheads = [], []
        for repeat in range(args.repeats):
            for key, reference, candidate in jobs:
                since = time.time() - 1
                started = time.monotonic()
                result = evaluate_one(reference, f"{candidate}\n# bench {name} {repeat}\n")
                wall = time.monotonic() - started
                measured = work_seconds(since)
                work = work_of.setdefault((key, repeat), measured)
                walls.append(wall)
                overheads.append(wall - work)
                print(f"  {name:6s} {key:12s} {result.status:10s} wall {wall:6.2f} s  overhead {wall - work:5.2f} s", flush=True)
        return {"evals_per_min": 60 * len(walls) / sum(walls), "overhead_s": statistics.median(overheads),
                "wall_s": statistics.median(walls)}

    print("warm-up (Triton compilation, excluded)", flush=True)
    for _, reference, candidate in jobs:
        evaluation.evaluate(reference, candidate + "\n# warm-up\n", protocol)
    work_seconds(0)
    with GymPool(protocol, workers=1, progress=False) as pool:
        pooled = run_design("pool", pool.evaluate)
    fresh = run_design("fresh", lambda r, c: evaluation.evaluate(r, c, protocol))
    ratio = pooled["evals_per_min"] / fresh["evals_per_min"]
    lines = [
        f"# KernelGym pool benchmark ({evaluation.device_kind(device)}, {time.strftime('%Y-%m-%d')})",
        "",
        f"{len(jobs)} level-1 bank kernels x {args.repeats} repeats, one worker, protocol: "
        f"{protocol.correct_trials} correctness trials, {protocol.perf_trials} timed trials, baseline eager.",
        "",
        "| design | evaluations / min / GPU | median wall per evaluation (s) | median overhead beyond run_child (s) |",
        "|---|---|---|---|",
        f"| fresh interpreter per child | {fresh['evals_per_min']:.1f} | {fresh['wall_s']:.2f} | {fresh['overhead_s']:.2f} |",
        f"| warm pool (forked children) | {pooled['evals_per_min']:.1f} | {pooled['wall_s']:.2f} | {pooled['overhead_s']:.2f} |",
        "",
        f"throughput ratio pool / fresh: **{ratio:.2f}x**",
    ]
    report = "\n".join(lines)
    print(report)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gym_pool.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
