#!/usr/bin/env python
"""KernelGym against KernelBench's own harness: same GPU, same kernels, same trial counts, one run.

    . scripts/device_env.sh && python benchmarks/kernelbench_side_by_side.py --anchors anchors/kernelbench_harness

Workload: the bank's legit kernels for L1_1, L1_40, L1_88 and the level-2 fusions at full
KernelBench ``main`` sizes; 5 correctness + 100 timed trials; eager baseline. Harnesses:

- **kb-inproc**: KernelBench's ``eval_kernel_against_ref`` in this process, one sample after another
  (no isolation: the floor of what the harness costs);
- **kb-spawn**: the same call in a fresh ``multiprocessing`` spawn process per sample, as
  KernelBench's ``scripts/eval_from_generations.py`` runs it;
- **kpipe**: KernelGym's pool (what ``kpipe gym eval-batch --workers 1 --baseline eager`` and every
  pipeline stage use), full protocol: isolation, hacking checks, profiling, fresh inputs. Run
  ``--kpipe-runs`` times for the run-to-run spread.

Prints evaluations/min per harness, per-task verdicts and speedups side by side, each harness's
eager time against KernelBench's published H100 baseline (vendored), kpipe's spread, and the
GPU memory kpipe's worker held. The harness files stay outside ``src/kpipe``: pass the folder
that holds them (``../shared/anchors/kernelbench_harness`` in this workplace; copy it into the
tree to take it to a GPU machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TASKS = ["L1_1", "L1_40", "L1_88", "L2_9", "L2_12", "L2_14", "L2_59", "L2_63", "L2_76", "L2_86"]
PUBLISHED = ROOT / "src/kpipe/data/files/kernelbench/timing/H100_Modal/baseline_time_torch.json"


def kernelbench_package(anchors: Path) -> Path:
    """A `kernelbench` package of the harness files (upstream's `__init__` needs litellm; the
    harness only needs `utils.get_gpu_vendor`)."""
    root = Path(tempfile.mkdtemp(prefix="kb-harness-"))
    package = root / "kernelbench"
    package.mkdir()
    for name in ("eval.py", "timing.py", "dataset.py"):
        shutil.copy(anchors / name, package / name)
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text("def get_gpu_vendor(device=None):\n    return 'nvidia'\n")
    return root


def kb_evaluate(package_root: str, reference: str, candidate: str, build_dir: str) -> dict[str, Any]:
    """One sample through KernelBench, as its batch script calls it."""
    if package_root not in sys.path:
        sys.path.insert(0, package_root)
    import torch
    from kernelbench.eval import eval_kernel_against_ref

    started = time.monotonic()
    result = eval_kernel_against_ref(reference, candidate, num_correct_trials=5, num_perf_trials=100, measure_performance=True,
                                     backend="triton", check_for_excessive_speedup=True, build_dir=build_dir,
                                     device=torch.device("cuda:0"))
    wall = time.monotonic() - started
    if result is None:
        return {"compiled": False, "correct": False, "wall_s": wall}
    # KernelExecResult's comment says microseconds; timing.py reports milliseconds (2.66 for L1_1)
    return {"compiled": result.compiled, "correct": result.correctness, "runtime_ms": result.runtime if result.runtime > 0 else None,
            "ref_ms": result.ref_runtime if result.ref_runtime > 0 else None, "wall_s": wall,
            "metadata": {k: str(v)[:200] for k, v in (result.metadata or {}).items()}}


def bank_pairs(tasks: list[str]) -> list[dict[str, str]]:
    from kpipe.data.kernelbench import select_problems
    from kpipe.gym.bank import list_solutions

    problems = {(p.level, p.problem_id): p for p in select_problems("main", [1, 2])}
    legit = {f"L{s.level}_{s.problem_id}": s for s in list_solutions("legit")}
    pairs = []
    for task in tasks:
        solution = legit[task]
        problem = problems[(solution.level, solution.problem_id)]
        pairs.append({"task": task, "file": f"{problem.name}.py", "level": solution.level,
                      "reference": problem.code, "candidate": solution.source})
    return pairs


def run_kb_inproc(pairs: list[dict[str, str]], package_root: Path) -> tuple[list[dict[str, Any]], float]:
    started = time.monotonic()
    rows = []
    for pair in pairs:
        with tempfile.TemporaryDirectory() as build:
            try:
                rows.append(kb_evaluate(str(package_root), pair["reference"], pair["candidate"], build))
            except Exception as exc:  # noqa: BLE001 - a row, not an abort
                rows.append({"correct": False, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows, time.monotonic() - started


def run_kb_spawn(pairs: list[dict[str, str]], package_root: Path, timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    context = mp.get_context("spawn")
    started = time.monotonic()
    rows = []
    for pair in pairs:
        with tempfile.TemporaryDirectory() as build, context.Pool(1) as pool:
            try:
                rows.append(pool.apply_async(kb_evaluate, (str(package_root), pair["reference"], pair["candidate"], build)).get(timeout=timeout_s))
            except Exception as exc:  # noqa: BLE001
                rows.append({"correct": False, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows, time.monotonic() - started


def run_kpipe(pairs: list[dict[str, str]], tag: int) -> tuple[list[dict[str, Any]], float, float, dict[str, Any]]:
    """(rows, seconds including pool start, pool start seconds, memory)."""
    from kpipe.gym import Protocol
    from kpipe.gym.pool import GymPool

    protocol = Protocol(baseline="eager", correct_trials=5, perf_trials=100, timeout_s=300)
    started = time.monotonic()
    with GymPool(protocol, workers=1, progress=False) as pool:
        start_s = time.monotonic() - started
        results = pool.evaluate_many([(p["reference"], p["candidate"] + f"\n# run {tag}\n") for p in pairs])
        memory = gpu_memory_by_pid()
    rows = [{"correct": r.status == "pass", "status": r.status, "runtime_ms": r.candidate_ms, "ref_ms": r.eager_ms,
             "speedup": r.speedup_eager, "wall_s": r.wall_s, "diagnostic": r.diagnostic[:200]} for r in results]
    return rows, time.monotonic() - started, start_s, memory


def gpu_memory_by_pid() -> dict[str, Any]:
    """What each process holds on the GPU now (the worker between evaluations)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return {line.split(",")[0].strip(): int(line.split(",")[1]) for line in out.strip().splitlines() if "," in line}


def speedup(row: dict[str, Any]) -> float | None:
    if row.get("speedup"):
        return row["speedup"]
    if row.get("ref_ms") and row.get("runtime_ms"):
        return row["ref_ms"] / row["runtime_ms"]
    return None


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", type=Path, default=ROOT.parent / "shared" / "anchors" / "kernelbench_harness")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--harnesses", default="kb-inproc,kb-spawn,kpipe")
    parser.add_argument("--kpipe-runs", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args()
    pairs = bank_pairs(args.tasks.split(","))
    package_root = kernelbench_package(args.anchors)
    harnesses = args.harnesses.split(",")
    published = json.loads(PUBLISHED.read_text())
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    results: dict[str, list[dict[str, Any]]] = {}
    lines = [f"# KernelGym vs KernelBench's harness — {time.strftime('%Y-%m-%d')}, {gpu}", "",
             f"{len(pairs)} tasks (bank legit kernels, full KernelBench main sizes), 5 correctness + 100 timed trials, eager baseline.", "",
             "| harness | evaluations | seconds | evaluations/min/GPU |", "|---|---|---|---|"]

    def report_rate(name: str, rows: list[dict[str, Any]], seconds: float, note: str = "") -> None:
        results[name] = rows
        lines.append(f"| {name}{note} | {len(rows)} | {seconds:.0f} | {60 * len(rows) / seconds:.1f} |")
        print(lines[-1], flush=True)
        if os.environ.get("OUT"):  # what is measured so far survives a cut-off run
            Path(os.environ["OUT"], "kernelbench_side_by_side.partial.json").write_text(json.dumps({"rates": lines, "rows": results}, default=str))

    if "kb-spawn" in harnesses:  # first: nothing warmed by the other harnesses
        rows, seconds = run_kb_spawn(pairs, package_root, args.timeout_s)
        report_rate("kb-spawn", rows, seconds)
    if "kb-inproc" in harnesses:
        rows, seconds = run_kb_inproc(pairs, package_root)
        report_rate("kb-inproc", rows, seconds)
    memory: dict[str, Any] = {}
    if "kpipe" in harnesses:
        for run in range(args.kpipe_runs):
            rows, seconds, start_s, memory = run_kpipe(pairs, run)
            report_rate(f"kpipe run {run + 1}", rows, seconds, f" (pool start {start_s:.0f} s included)")
    names = list(results)
    lines += ["", "## Per task: verdict, speedup vs eager, eager ms (published H100 eager ms)", "",
              "| task | published eager ms | " + " | ".join(f"{n}: ok / speedup / eager ms" for n in names) + " |",
              "|---|---|" + "---|" * len(names)]
    for i, pair in enumerate(pairs):
        entry = published[f"level{pair['level']}"].get(pair["file"], {})
        cells = []
        for name in names:
            row = results[name][i]
            ratio = f" ({row['ref_ms'] / entry['mean']:.2f}x pub)" if row.get("ref_ms") and entry.get("mean") else ""
            cells.append(f"{'pass' if row.get('correct') else 'FAIL ' + str(row.get('status') or row.get('error') or row.get('metadata', ''))[:60]}"
                         f" / {fmt(speedup(row))} / {fmt(row.get('ref_ms'))}{ratio}")
        lines.append(f"| {pair['task']} | {fmt(entry.get('mean'))} | " + " | ".join(c.replace('|', '/') for c in cells) + " |")
    kpipe_runs = [n for n in names if n.startswith("kpipe")]
    if len(kpipe_runs) > 1:
        spreads = []
        for i, pair in enumerate(pairs):
            values = [speedup(results[n][i]) for n in kpipe_runs]
            if all(values):
                spreads.append(f"{pair['task']} {max(values) / min(values):.3f}")  # type: ignore[arg-type, type-var]
        lines += ["", "kpipe run-to-run speedup max/min: " + ", ".join(spreads)]
    if memory:
        lines += ["", f"GPU memory by process after kpipe's last batch, pool still open (MiB by pid; this benchmark's own process holds what kb-inproc left): {memory}"]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kernelbench_side_by_side.md").write_text(text)
        Path(os.environ["OUT"], "kernelbench_side_by_side.json").write_text(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
