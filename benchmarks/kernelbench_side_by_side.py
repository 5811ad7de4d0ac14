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
  pipeline stage use), full protocol: isolation, hacking checks, profiling, fresh inputs; one pool,
  the reference run once per task and reused (``reuse_reference=True``), every candidate
  evaluated ``--kpipe-repeats`` times (the run-to-run spread), each evaluation's seconds by phase
  (parent and children: ``KPIPE_GYM_TRACE``) and its GPU memory;
- **probe** (A/B of the timing method, no pool; runs before kpipe, which takes what is left of
  the budget): a fresh process per cuBLAS setting (``CUBLAS_WORKSPACE_CONFIG`` unset, as
  KernelBench and kgym-3 run, and ``:4096:8``, as kgym-2's children did) times each task's eager
  reference and candidate with KernelBench's ``time_execution_with_cuda_event`` and with kpipe's
  ``time_forward`` in variants (start event behind the flush or after a host synchronize, region
  ended at the call or at the device-wide synchronize, fresh or fixed inputs, our L2 flush or
  KernelBench's, launch recording on or off), and traces one timed trial of each harness on L1_40
  with ``torch.profiler`` (the GPU timeline of the timed region).

Prints evaluations/min per harness, per-task verdicts and speedups side by side, each harness's
eager time against KernelBench's published H100 baseline (vendored), kpipe's spread, the per-phase
breakdown, the A/B table and GPU memory. Everything measured so far is written under ``$OUT`` as it
comes (a run cut off keeps it); at the end its report ``kernelbench_side_by_side.md`` and ledger line
(``kpipe.infra.ledger``: each harness's evaluations/min). ``--budget-s`` bounds the run: kpipe's repeats stop early rather
than overrun it. The harness files stay outside ``src/kpipe``: pass the folder that holds them
(``../shared/anchors/kernelbench_harness`` in this workplace; copy it into the tree to take it to
a GPU machine).
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

from kpipe.infra import ledger

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


# the reference as its own candidate (--self-candidates): the screen wants a Triton kernel, which never runs
SELF_CANDIDATE_TAIL = """

import triton


@triton.jit
def _never_launched(x_ptr):
    pass


class ModelNew(Model):
    pass
"""


def bank_pairs(tasks: list[str], shrink: int = 0, self_candidates: bool = False) -> list[dict[str, str]]:
    """The bank's legit kernel and its KernelBench reference per task (`shrink`: sizes divided
    down for a smoke run on the CPU); with `self_candidates`, the reference itself as the candidate
    (``ModelNew(Model)``): a speedup of 1 by construction, so what a harness reads beyond it is its own bias."""
    from kpipe.data.kernelbench import select_problems, shrink_sizes
    from kpipe.gym.bank import list_solutions

    problems = {(p.level, p.problem_id): p for p in select_problems("main", [1, 2])}
    legit = {f"L{s.level}_{s.problem_id}": s for s in list_solutions("legit")}
    pairs = []
    for task in tasks:
        solution = legit[task]
        problem = problems[(solution.level, solution.problem_id)]
        reference = shrink_sizes(problem.code, shrink) if shrink else problem.code
        candidate = reference + SELF_CANDIDATE_TAIL if self_candidates else solution.source
        pairs.append({"task": task, "file": f"{problem.name}.py", "level": solution.level, "reference": reference,
                      "candidate": candidate})
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


def run_kpipe(pairs: list[dict[str, str]], repeats: int, deadline: float, trace_path: Path,
              save: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """One pool; every candidate `repeats` times (a repeat is the ten tasks in order), the
    references run once and reused. Stops before a repeat that would overrun `deadline`."""
    from kpipe.gym import Protocol
    from kpipe.gym.serve.pool import GymPool

    os.environ["KPIPE_GYM_TRACE"] = str(trace_path)  # the worker inherits it; children never see it
    protocol = Protocol(**{"baseline": "eager", "correct_trials": 5, "perf_trials": 100, "timeout_s": 300, **overrides})
    out: dict[str, Any] = {"repeats": [], "repeat_s": [], "memory": []}
    started = time.monotonic()
    with GymPool(protocol, workers=1, progress=False, reuse_reference=True) as pool:
        out["start_s"] = time.monotonic() - started
        out["memory"].append({"when": "pool started", **gpu_memory_by_pid()})
        for repeat in range(repeats):
            last = out["repeat_s"][-1] if out["repeat_s"] else 0.0
            steady = out["repeat_s"][1] if len(out["repeat_s"]) > 1 else last
            if repeat and time.monotonic() + steady > deadline:
                out["stopped"] = f"after {repeat} repeats: the next would overrun the budget"
                break
            t0 = time.monotonic()
            results = pool.evaluate_many([(p["reference"], p["candidate"] + f"\n# repeat {repeat}\n") for p in pairs])
            out["repeat_s"].append(time.monotonic() - t0)
            out["repeats"].append([{"correct": r.status == "pass", "status": r.status, "runtime_ms": r.candidate_ms, "ref_ms": r.eager_ms,
                                    "speedup": r.speedup_eager, "wall_s": r.wall_s, "key": r.key, "pr": r.pr,
                                    "diagnostic": r.diagnostic[:200], "hack_reasons": r.hack_reasons} for r in results])
            out["memory"].append({"when": f"after repeat {repeat + 1}", **gpu_memory_by_pid()})
            save()
    out["seconds"] = time.monotonic() - started
    os.environ.pop("KPIPE_GYM_TRACE", None)
    return out


def read_trace(path: Path) -> dict[str, dict[str, Any]]:
    """The judge's per-evaluation records by result key."""
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            records[record["key"]] = record
    return records


PHASE_GROUPS = ("start (device init)", "prepare", "load", "build", "correctness", "eval mode", "ghost replay", "waiting at the gate",
                "timing", "re-check", "profiling", "integrity", "write result")


def grouped_phases(stats: dict[str, Any] | None, child_s: float | None) -> dict[str, float]:
    """A child's phase seconds summed by group ("candidate correctness trial 3" -> correctness),
    plus "outside" (`child_s`, the judge's seconds from the hand-over to the exit seen, minus the
    phases: the child's start after the hand-over, its exit, reading the result). The phases hold
    the seconds the child spent stopped while another child timed on its GPU; the child's own
    ``wall_s`` leaves them out (they move its deadline), so it cannot be the whole here."""
    groups: dict[str, float] = {}
    if not stats:
        return groups
    for name, seconds in stats.get("phases", []):
        group = next((g for g in PHASE_GROUPS if g in name), name)
        groups[group] = groups.get(group, 0.0) + float(seconds)
    if child_s is not None:
        groups["outside"] = float(child_s) - sum(groups.values())
    return groups


def window_table(pairs: list[dict[str, str]], kpipe: dict[str, Any], trace: dict[str, dict[str, Any]]) -> list[str]:
    """Each candidate's timing windows beside the reference windows it was handed, per task in the order of the
    repeats: the n-th candidate a reference run serves gets the stock's windows 2n-1 and 2n, so a fixed cost that
    drifts along the stock shows here, and so does its effect on the candidate's time (its calls: its least
    window less the reference's least fixed cost, ``kpipe.gym.judge.evaluation.candidate_window_ms``)."""
    lines = ["| task | repeat | calls | reference windows' fixed ms | candidate windows ms | candidate ms | eager ms |",
             "|---|---|---|---|---|---|---|"]
    for index, pair in enumerate(pairs):
        for repeat, rows in enumerate(kpipe["repeats"]):
            record = trace.get(rows[index]["key"], {}) if index < len(rows) else {}
            if "window_fixed_ms" not in record:
                continue
            fixed = ", ".join(f"{ms:.1f}" for ms in record["window_fixed_ms"])
            windows = ", ".join(f"{seconds * 1e3:.1f}" for seconds in record["window_candidate_s"])
            lines.append(f"| {pair['task']} | {repeat + 1} | {record['window_calls']} | {fixed} | {windows} | "
                         f"{fmt(record.get('candidate_ms'), '.4g')} | {fmt(record.get('eager_ms'), '.4g')} |")
    return lines


def phase_table(pairs: list[dict[str, str]], kpipe: dict[str, Any], trace: dict[str, dict[str, Any]]) -> list[str]:
    """Per evaluation: where the seconds went (parent and children) and GPU memory."""
    cols = ("start (device init)", "prepare", "load", "build", "correctness", "eval mode", "ghost replay", "waiting at the gate", "timing",
            "re-check", "profiling", "write result", "outside")
    lines = ["| task | rep | total s | ref child s | cand child s | " + " | ".join(f"cand {c}" for c in cols)
             + " | GPU used at cand start MiB | cand peak reserved MiB | judge RSS MiB |",
             "|---|---|---|---|---|" + "---|" * len(cols) + "---|---|---|"]
    sums: dict[str, list[float]] = {}
    for rep, rows in enumerate(kpipe["repeats"]):
        for pair, row in zip(pairs, rows):
            record = trace.get(row["key"], {})
            cand = record.get("candidate") or {}
            groups = grouped_phases(cand, record.get("candidate_child_s"))
            memory = cand.get("memory", {})
            ref = f"{record.get('reference_s', 0):.2f}" + (" (reused)" if record.get("reference_reused") else "")
            cells = [f"{groups.get(c, 0.0):.2f}" for c in cols]
            for c in cols:
                sums.setdefault(c, []).append(groups.get(c, 0.0))
            lines.append(f"| {pair['task']} | {rep + 1} | {row['wall_s']:.2f} | {ref} | {fmt(record.get('candidate_child_s'), '.2f')} | "
                         + " | ".join(cells) + f" | {fmt(memory.get('device_used_at_start_mb'), '.0f')} | "
                         f"{fmt(memory.get('peak_reserved_mb'), '.0f')} | {fmt(record.get('judge_rss_mb'), '.0f')} |")
    if sums:
        lines.append("| mean | | | | | " + " | ".join(f"{sum(v) / len(v):.2f}" for v in sums.values()) + " | | | |")
    return lines


def probe_main(args: argparse.Namespace) -> None:
    """In a process of its own (its cuBLAS setting fixed before CUDA starts): each task's eager
    reference and candidate timed by KernelBench's function and by kpipe's in variants; JSON to
    ``--probe-json``. Same models (seed 42, built on the host) and kpipe's input sets."""
    import torch

    sys.path.insert(0, str(kernelbench_package(args.anchors)))
    from kernelbench import timing as kb_timing
    from kpipe.gym.candidate import instrument
    from kpipe.gym.candidate.child import build_model, load_module
    from kpipe.gym.candidate.timing import Clocks, flush_l2_kernelbench, l2_flush_buffer, time_forward
    from kpipe.gym.candidate.trial_data import make_inputs, trial_seed
    from kpipe.gym.protocol import Protocol

    pairs = bank_pairs(args.tasks.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="kb-probe-"))
    clocks = Clocks("cuda")
    l2 = l2_flush_buffer(Protocol(), "cuda")
    trials, warmup = args.probe_trials, 5
    results: dict[str, Any] = {"cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "tasks": {}}

    def stats(times: list[float]) -> dict[str, float]:
        ordered = sorted(times)
        return {"median": ordered[len(ordered) // 2], "mean": sum(times) / len(times), "min": ordered[0]}

    def variants(forward: Any, input_sets: list[Any], recording: bool) -> dict[str, Any]:
        row: dict[str, Any] = {}
        times = kb_timing.time_execution_with_cuda_event(forward, input_sets[0], num_warmup=3, num_trials=trials, verbose=False,
                                                          device=torch.device("cuda:0"))
        row["kb"] = stats(times)
        with torch.no_grad():  # KernelBench times with autograd on; kpipe under no_grad
            times = kb_timing.time_execution_with_cuda_event(forward, input_sets[0], num_warmup=3, num_trials=trials, verbose=False,
                                                              device=torch.device("cuda:0"))
        row["kb under no_grad"] = stats(times)
        options = {  # the region ends at the call ("ms") and at the device-wide synchronize ("ms_synced")
            "kpipe": {},
            "kpipe, start after a host synchronize (kgym-2)": {"start_behind_flush": False},
            "kpipe, fixed inputs, KB flush": {"fresh_inputs": False, "flush": flush_l2_kernelbench},
        }
        for name, kwargs in options.items():
            timed = time_forward(forward, input_sets, trials, warmup, clocks, l2, **kwargs)
            row[name] = stats(timed["ms"])
            row[name + " (to the synchronize)"] = stats(timed["ms_synced"])
        if recording:  # what the candidate child does: every call inside a launch recording
            instrument.install()
            timed = time_forward(forward, input_sets, trials, warmup, clocks, l2, on_call=instrument.recording)
            row["kpipe + launch recording (the child's path)"] = stats(timed["ms"])
            instrument.uninstall()
        return row

    for pair in pairs:
        started = time.monotonic()
        reference = load_module(pair["reference"], f"probe_ref_{pair['task']}", workdir)
        init_inputs = reference.get_init_inputs()
        input_sets = [make_inputs(reference.get_inputs, trial_seed(42, k), "cuda") for k in range(2)]
        model = build_model(reference.Model, init_inputs, 42, "cuda")
        row: dict[str, Any] = {"eager": variants(model, input_sets, False)}
        del model
        if not args.probe_eager_only:
            candidate = load_module(pair["candidate"], f"probe_cand_{pair['task']}", workdir)
            cmodel = build_model(candidate.ModelNew, init_inputs, 42, "cuda")
            with torch.no_grad():
                cmodel(*input_sets[0])  # compile
            torch.cuda.synchronize()
            row["candidate"] = variants(cmodel, input_sets, True)
            if pair["task"] == args.profile_task:
                row["profile"] = profile_regions(cmodel, input_sets, kb_timing, clocks, l2, args.probe_out)
            del cmodel
        row["seconds"] = time.monotonic() - started
        results["tasks"][pair["task"]] = row
        del input_sets
        torch.cuda.empty_cache()
        Path(args.probe_json).write_text(json.dumps(results))


def profile_regions(model: Any, input_sets: list[Any], kb_timing: Any, clocks: Any, l2: Any, out_dir: str | None) -> dict[str, Any]:
    """One profiled timed trial per harness: the GPU timeline (kernels, memsets/copies) and the
    host's CUDA calls, relative to the trial's first activity, and the time each reported."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kpipe.gym.candidate.timing import time_forward

    def timeline(prof: Any) -> list[str]:
        rows = []
        for event in prof.events():
            name = getattr(event, "trace_name", None) or event.name
            on_gpu = event.device_type == DeviceType.CUDA
            if not on_gpu and not name.startswith(("cuda", "cu")):
                continue
            rows.append((event.time_range.start, event.time_range.end, ("GPU " if on_gpu else "host ") + name[:70]))
        if not rows:
            return []
        rows.sort()
        origin = rows[0][0]
        return [f"{start - origin:9.1f} us +{end - start:8.1f} us  {name}" for start, end, name in rows]

    summary: dict[str, Any] = {}
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        times = kb_timing.time_execution_with_cuda_event(model, input_sets[0], num_warmup=0, num_trials=1, discard_first=0,
                                                          verbose=False, device=torch.device("cuda:0"))
    summary["kb"] = {"ms": times, "timeline": timeline(prof)[-40:]}
    if out_dir:
        prof.export_chrome_trace(str(Path(out_dir) / "L1_40_trace_kb.json"))
    with profile(activities=activities) as prof:
        timed = time_forward(model, input_sets, 1, 0, clocks, l2)
    summary["kpipe"] = {"ms": timed["ms"], "ms_synced": timed["ms_synced"], "timeline": timeline(prof)[-40:]}
    if out_dir:
        prof.export_chrome_trace(str(Path(out_dir) / "L1_40_trace_kpipe.json"))
    return summary


def run_probe(args: argparse.Namespace, cublas: str | None, eager_only: bool, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """The probe in a fresh interpreter with CUBLAS_WORKSPACE_CONFIG set to `cublas` (None: unset)."""
    env = dict(os.environ)
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    if cublas:
        env["CUBLAS_WORKSPACE_CONFIG"] = cublas
    target = out_dir / f"probe_{'cublas' if cublas else 'nocublas'}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", "--anchors", str(args.anchors), "--tasks", args.tasks,
               "--probe-json", str(target), "--probe-trials", str(args.probe_trials), "--probe-out", str(out_dir)]
    if eager_only:
        command.append("--probe-eager-only")
    else:
        command += ["--profile-task", "L1_40"]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(timeout_s, 10))
        error = done.stderr[-1500:] if done.returncode else ""
    except subprocess.TimeoutExpired:
        error = f"probe cut off after {timeout_s:.0f} s"
    data = json.loads(target.read_text()) if target.exists() else {"tasks": {}}
    if error:
        data["error"] = error
    return data


def nvidia_smi(arguments: list[str]) -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    return subprocess.run(["nvidia-smi", *arguments], capture_output=True, text=True).stdout


def gpu_memory_by_pid() -> dict[str, Any]:
    """What each process holds on the GPU now (the worker between evaluations)."""
    out = nvidia_smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
    return {line.split(",")[0].strip(): int(line.split(",")[1]) for line in out.strip().splitlines() if "," in line}


def speedup(row: dict[str, Any]) -> float | None:
    if row.get("speedup"):
        return row["speedup"]
    if row.get("ref_ms") and row.get("runtime_ms"):
        return row["ref_ms"] / row["runtime_ms"]
    return None


def speedup_agreement(kb_rows: list[dict[str, Any]], kpipe_repeats: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per task, KernelBench's in-process speedup beside the median of kpipe's over its repeats, and
    their gap in per cent of KernelBench's (issue 62's bar: within 5 %). Tasks either harness failed
    are left out: there is no speedup to compare."""
    agreement = []
    for i, kb_row in enumerate(kb_rows):
        kb, ours = speedup(kb_row), [speedup(rows[i]) for rows in kpipe_repeats if i < len(rows)]
        ours = sorted(value for value in ours if value)
        if kb and ours:
            median = ours[len(ours) // 2] if len(ours) % 2 else (ours[len(ours) // 2 - 1] + ours[len(ours) // 2]) / 2
            agreement.append({"task": kb_row.get("task", str(i)), "kb": kb, "kpipe": median, "gap_pct": 100 * (median / kb - 1)})
    return agreement


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", type=Path, default=ROOT.parent / "shared" / "anchors" / "kernelbench_harness")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--harnesses", default="kb-spawn,kb-inproc,kpipe,probe")
    parser.add_argument("--kpipe-repeats", type=int, default=5)
    parser.add_argument("--kpipe-protocol", default="{}", help='protocol settings for kpipe, JSON, e.g. \'{"perf_trials": 200}\'')
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--budget-s", type=float, default=500, help="the whole run; kpipe (last) stops its repeats early rather than overrun it")
    parser.add_argument("--probe-timeout-s", type=float, default=75, help="the first probe's limit (the second gets 0.6 of it)")
    parser.add_argument("--probe-trials", type=int, default=40)
    parser.add_argument("--shrink", type=int, default=0, help="divide sizes down (a CPU smoke run of the kpipe part)")
    parser.add_argument("--self-candidates", action="store_true",
                        help="each reference as its own candidate (a speedup of 1 by construction: each harness's bias); "
                             "kpipe's hacking check off, since the reference launches no Triton kernel")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-json", help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", help=argparse.SUPPRESS)
    parser.add_argument("--probe-eager-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-task", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe_main(args)
        return
    run_started = time.monotonic()
    deadline = run_started + args.budget_s
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="kb-side-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = bank_pairs(args.tasks.split(","), args.shrink, args.self_candidates)
    kpipe_protocol = {**json.loads(args.kpipe_protocol), **({"hacking_check": False} if args.self_candidates else {})}
    package_root = kernelbench_package(args.anchors)
    harnesses = args.harnesses.split(",")
    published = json.loads(PUBLISHED.read_text())
    gpu = nvidia_smi(["--query-gpu=name", "--format=csv,noheader"]).strip() or "no GPU"
    results: dict[str, list[dict[str, Any]]] = {}
    extra: dict[str, Any] = {}
    rates: dict[str, float] = {}  # the ledger's figures: each harness's first rate
    lines = [f"# KernelGym vs KernelBench's harness — {time.strftime('%Y-%m-%d')}, {gpu}", "",
             f"{len(pairs)} tasks ({'each reference as its own candidate (a speedup of 1 by construction)' if args.self_candidates else 'bank legit kernels'}, {'sizes capped at ' + str(args.shrink) if args.shrink else 'full KernelBench main sizes'}), 5 correctness + 100 timed trials, eager baseline.", "",
             "| harness | evaluations | seconds | evaluations/min/GPU |", "|---|---|---|---|"]

    def save() -> None:  # what is measured so far survives a cut-off run
        Path(out_dir, "kernelbench_side_by_side.partial.json").write_text(json.dumps({"rates": lines, "rows": results, "extra": extra}, default=str))

    def report_rate(name: str, rows: list[dict[str, Any]], seconds: float, note: str = "") -> None:
        lines.append(f"| {name}{note} | {len(rows)} | {seconds:.0f} | {60 * len(rows) / seconds:.1f} |")
        rates.setdefault("per_min_" + name.replace(", ", "_").replace(" ", "_"), round(60 * len(rows) / seconds, 1))
        print(lines[-1], flush=True)
        save()

    if "kb-spawn" in harnesses:  # first: nothing warmed by the other harnesses
        rows, seconds = run_kb_spawn(pairs, package_root, args.timeout_s)
        results["kb-spawn"] = rows
        report_rate("kb-spawn", rows, seconds)
    if "kb-inproc" in harnesses:
        rows, seconds = run_kb_inproc(pairs, package_root)
        results["kb-inproc"] = rows
        report_rate("kb-inproc", rows, seconds)
        import torch

        torch.cuda.empty_cache()  # what KernelBench's in-process run leaves is not kpipe's
    if "probe" in harnesses:  # bounded: what is left of the budget goes to kpipe's repeats
        extra["probe_nocublas"] = run_probe(args, None, False, out_dir, args.probe_timeout_s)
        save()
        extra["probe_cublas"] = run_probe(args, ":4096:8", True, out_dir, args.probe_timeout_s * 0.6)
        save()
    trace_path = out_dir / "kpipe_trace.jsonl"
    kpipe: dict[str, Any] = {}
    if "kpipe" in harnesses:
        trace_path.unlink(missing_ok=True)
        kpipe = run_kpipe(pairs, args.kpipe_repeats, deadline, trace_path, save, kpipe_protocol)
        if kpipe_protocol:
            lines.insert(3, f"kpipe's protocol settings beyond the defaults: {json.dumps(kpipe_protocol)}")
        extra["kpipe"] = kpipe
        for r, rows in enumerate(kpipe["repeats"]):
            results[f"kpipe rep {r + 1}"] = rows
        evaluations = sum(len(rows) for rows in kpipe["repeats"])
        if evaluations:
            report_rate("kpipe, all repeats", [{}] * evaluations, kpipe["seconds"], f" (pool start {kpipe['start_s']:.0f} s included)")
            report_rate("kpipe, all repeats", [{}] * evaluations, sum(kpipe["repeat_s"]), " (pool start excluded)")
            report_rate("kpipe, repeat 1", [{}] * len(pairs), kpipe["repeat_s"][0], " (references run)")
            if len(kpipe["repeat_s"]) > 1:
                report_rate("kpipe, repeats 2+", [{}] * (evaluations - len(pairs)), sum(kpipe["repeat_s"][1:]), " (references reused)")

    names = list(results)
    lines += ["", "## Per task: verdict / speedup vs eager / eager ms (ratio to the published H100 eager ms)", "",
              "| task | published eager ms | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for i, pair in enumerate(pairs):
        entry = published[f"level{pair['level']}"].get(pair["file"], {})
        cells = []
        for name in names:
            row = results[name][i]
            ratio = f" ({row['ref_ms'] / entry['mean']:.2f}x)" if row.get("ref_ms") and entry.get("mean") else ""
            verdict = "pass" if row.get("correct") else "FAIL " + str(row.get("status") or row.get("error") or row.get("metadata", ""))[:60]
            cells.append(f"{verdict} / {fmt(speedup(row))} / {fmt(row.get('ref_ms'))}{ratio}")
        lines.append(f"| {pair['task']} | {fmt(entry.get('mean'))} | " + " | ".join(c.replace('|', '/') for c in cells) + " |")
    kpipe_runs = [n for n in names if n.startswith("kpipe")]
    if len(kpipe_runs) > 1:
        spreads = []
        for i, pair in enumerate(pairs):
            values = [speedup(results[n][i]) for n in kpipe_runs]
            cand = [results[n][i].get("runtime_ms") for n in kpipe_runs]
            if all(values):
                spreads.append(f"{pair['task']} {max(values) / min(values):.3f} (candidate ms {min(cand):.3g}-{max(cand):.3g})")  # type: ignore[type-var]
        lines += ["", f"kpipe speedup max/min over {len(kpipe_runs)} evaluations of each candidate: " + ", ".join(spreads)]
    if "kb-inproc" in results and kpipe.get("repeats"):
        kb_rows = [{**row, "task": pair["task"]} for pair, row in zip(pairs, results["kb-inproc"])]
        agreement = speedup_agreement(kb_rows, kpipe["repeats"])
        lines += ["", "## Speedup: KernelBench in-process vs kpipe (median over its repeats)", "",
                  "| task | KernelBench | kpipe | gap % |", "|---|---|---|---|"]
        lines += [f"| {a['task']} | {a['kb']:.3f} | {a['kpipe']:.3f} | {a['gap_pct']:+.1f} |" for a in agreement]
        if agreement:
            worst = max(abs(a["gap_pct"]) for a in agreement)
            within = sum(abs(a["gap_pct"]) <= 5 for a in agreement)
            lines += ["", f"{within} of {len(agreement)} tasks within 5 %; the largest gap {worst:.1f} %."]
            rates |= {"speedup_gap_max_pct": round(worst, 1), "tasks_within_5pct": within, "tasks_compared": len(agreement)}
    if kpipe:
        trace = read_trace(trace_path)
        lines += ["", "## kpipe: seconds by phase per evaluation (candidate child phases; parent = total − ref − cand child)", ""]
        lines += phase_table(pairs, kpipe, trace)
        lines += ["", "## kpipe: the timing windows (the judge's clock)", ""]
        lines += window_table(pairs, kpipe, trace)
        lines += ["", "Reference children (run once per task, reused after): seconds by phase", ""]
        for pair, row in zip(pairs, kpipe["repeats"][0] if kpipe["repeats"] else []):
            record = trace.get(row["key"], {})
            if record.get("reference"):
                groups = grouped_phases(record["reference"], record["reference"].get("child_s"))
                memory = record["reference"].get("memory", {})
                lines.append(f"- {pair['task']}: {record.get('reference_s', 0):.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in groups.items() if v >= 0.01)
                             + f"; peak reserved {fmt(memory.get('peak_reserved_mb'), '.0f')} MiB")
        used = [((trace.get(row['key'], {}).get('candidate') or {}).get('memory') or {}).get('device_used_at_start_mb')
                for rows in kpipe["repeats"] for row in rows]
        used = [u for u in used if u is not None]
        if used:
            lines += ["", f"GPU memory in use on the device when each candidate child started (its own new context included; "
                          f"the worker and zygote hold none): first {used[0]:.0f} MiB, last {used[-1]:.0f} MiB, min {min(used):.0f}, max {max(used):.0f} "
                          f"over {len(used)} evaluations"]
        lines += ["", "nvidia-smi by pid (MiB) while the pool was open: " + "; ".join(
            f"{m['when']}: " + ", ".join(f"{k}={v}" for k, v in m.items() if k != "when") for m in kpipe.get("memory", []))]
        if kpipe.get("stopped"):
            lines += ["", f"kpipe stopped {kpipe['stopped']}"]
    for key, title in (("probe_nocublas", "CUBLAS_WORKSPACE_CONFIG unset (as KernelBench and kgym-3)"), ("probe_cublas", "CUBLAS_WORKSPACE_CONFIG=:4096:8 (as kgym-2's children)")):
        probe = extra.get(key)
        if not probe:
            continue
        lines += ["", f"## Timing A/B, {title}: median ms (KernelBench's function: mean / median; the published table holds means), {args.probe_trials} trials each", ""]
        if probe.get("error"):
            lines.append(f"probe error: {probe['error'][-400:]}")
        for what in ("eager", "candidate"):
            tasks = {t: r[what] for t, r in probe.get("tasks", {}).items() if what in r}
            if not tasks:
                continue
            variants = list(next(iter(tasks.values())))
            by_task = {pair["task"]: published[f"level{pair['level']}"].get(pair["file"], {}).get("mean") for pair in pairs}
            lines += ["", f"{what}" + (" (ratio to the published H100 eager ms)" if what == "eager" else "") + ":", "",
                      "| task | " + ("published | " if what == "eager" else "") + " | ".join(variants) + " |",
                      "|---|" + ("---|" if what == "eager" else "") + "---|" * len(variants)]
            for task, row in tasks.items():
                pub = by_task.get(task) if what == "eager" else None
                ratio = (lambda ms: f" ({ms / pub:.3f}x)" if pub else "")  # noqa: E731
                cells = [f"{row[v]['mean']:.4g} / {row[v]['median']:.4g}{ratio(row[v]['mean'])}" if v.startswith("kb")
                         else f"{row[v]['median']:.4g}{ratio(row[v]['median'])}" for v in variants]
                lines.append(f"| {task} | " + (f"{fmt(pub)} | " if what == "eager" else "") + " | ".join(cells) + " |")
        for task, row in probe.get("tasks", {}).items():
            if "profile" in row:
                for harness, prof in row["profile"].items():
                    lines += ["", f"{task} profiled timed trial, {harness}: reported ms {prof.get('ms')} "
                                  f"{'(to the synchronize: ' + str(prof.get('ms_synced')) + ')' if prof.get('ms_synced') else ''}", "", "```"]
                    lines += prof.get("timeline", [])
                    lines += ["```"]
    lines += ["", f"Whole run: {time.monotonic() - run_started:.0f} s"]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    Path(out_dir, "kernelbench_side_by_side.json").write_text(json.dumps({"rows": results, "extra": extra}, default=str))
    ledger.record("kernelbench_side_by_side", text, rates, ledger.device_label(gpu, len(gpu.splitlines())), results=out_dir)


if __name__ == "__main__":
    main()
