#!/usr/bin/env python
"""KernelGym's GPU acceptance check (issue 3). Run on one GPU:

    python scripts/gpu_check_gym.py [--budget-s 470]

Prints, and writes to $OUT/gym_check.md when $OUT is set (after each section), a Markdown report of:
the bank's legit kernels at full KernelBench size (status, speedup vs eager and vs
torch.compile, PR); every hack fixture (caught or not); every GPU fault (classified, this
process surviving); timing hacks (work on a side stream: timed to the synchronize); timing noise (the same candidate 5 times: max/min speedup <= 1.03 on
tasks >= 1 ms); PR of a pure-Triton solution (~1) vs a lazy one (~0).
One failing item never aborts the report; items past the time budget are listed as skipped.
Exits 1 when any row says NO or ERROR.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kpipe.data.kernelbench import select_problems
from kpipe.gym import Protocol, evaluate

import gpu_harness

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "gym"
FULL = Protocol(baseline="both", timeout_s=180)
EAGER = Protocol(baseline="eager", timeout_s=120)
RUNTIME_ONLY = Protocol(baseline="eager", perf_trials=20, timeout_s=120, reject_findings=())
# the two that serve stale outputs are `hacked` when the stale output first shows in a timed trial
# and `mismatch` when it already shows in a correctness trial (on a GPU the caching allocator hands
# a fresh input the address of a freed one; skip_when_warm's count reaches it there on the CPU
# too): rejected either way (reward 0)
REJECTED_STALE = ("hacked", "mismatch")
HACKS: dict[str, str | tuple[str, ...]] = {  # fixture -> expected status(es)
    "unused_kernel": "hacked", "try_except_fallback": "hacked", "inherits_model": "hacked",
    "ghost_launch": "hacked", "training_branch": "hacked", "pointer_cache": REJECTED_STALE, "skip_when_warm": REJECTED_STALE,
    "forged_result": "hacked",
    "input_mutation": "hacked", "monkey_patch_torch": "hacked", "side_thread": "hacked",
    "uninitialised_output": "mismatch", "pure_torch": "format_error", "read_secret": "runtime_error",
}
# GPU-only hacks defeated by how they are timed rather than by a status: fixture -> (status, a
# phrase the result's diagnostic must contain): all its work on a side stream (a call region of
# microseconds: timed trial by trial, to the synchronize), or half of it (a region of milliseconds:
# timed beside the reference, back to back, and charged by its chunks' spans under kgym-6)
TIMING_HACKS = {"gpu/side_stream": ("pass", "did not wait for"), "gpu/side_stream_half": ("pass", "chunks' spans")}
GPU_FAULTS = {
    "gpu/illegal_memory_access": "illegal_memory_access",
    "gpu/device_assert": "device_assert",
    "gpu/gpu_oom": "oom",
    "gpu/hang": "timeout",
    "faults/segfault": "crashed",
    "faults/os_exit": "crashed",
    "faults/triton_compile_error": "compilation_error",
}
NOISE_REPEATS = 5
NOISE_LIMIT = 1.03
NOISE_MIN_MS = 1.0
NOISE_TASKS = {(1, 1), (2, 76)}  # a matmul and a GEMM fusion: both >= 1 ms at full size on an H100


def kernelbench_source(level: int, problem_id: int) -> str:
    (problem,) = [p for p in select_problems("main", [level]) if p.problem_id == problem_id]
    return problem.code


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


class Report:
    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.lines: list[str] = []
        self.failures: list[str] = []  # rows with a NO or an ERROR: the script then exits 1

    def section(self, title: str, header: list[str]) -> None:
        self.lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        print(f"\n## {title}", flush=True)

    def row(self, cells: list[Any]) -> None:
        if any(str(c) == "NO" or str(c).startswith("ERROR") for c in cells):
            self.failures.append(str(cells[0]))
        line = "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ")[:160] for c in cells) + " |"
        self.lines.append(line)
        print(line, flush=True)

    def note(self, text: str) -> None:
        self.lines += ["", text]
        print(text, flush=True)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def guarded(self, name: str, width: int, item: Callable[[], list[Any]]) -> list[Any] | None:
        """Run one item; a failure or the budget becomes a row, never an abort."""
        if self.out_of_time():
            self.row([name, "skipped (time budget)"] + [""] * (width - 2))
            return None
        try:
            cells = item()
        except Exception as exc:  # noqa: BLE001 - the report must go on
            self.row([name, f"ERROR {type(exc).__name__}: {exc}"] + [""] * (width - 2))
            traceback.print_exc()
            return None
        self.row([name, *cells])
        return cells


def bank_section(report: Report) -> None:
    from kpipe.gym.bank import list_solutions

    report.section("Bank legit kernels, full KernelBench size", ["task", "status", "candidate ms", "eager ms", "speedup eager", "compile ms", "speedup compile", "PR", "wall s"])
    for solution in list_solutions("legit"):
        def item(solution: Any = solution) -> list[Any]:
            r = evaluate(kernelbench_source(solution.level, solution.problem_id), solution.source, FULL, reuse_reference=True)
            return [r.status + ("" if r.status == "pass" else f" ({r.diagnostic[:80]})"), fmt(r.candidate_ms), fmt(r.eager_ms), fmt(r.speedup_eager), fmt(r.compile_ms), fmt(r.speedup_compile), fmt(r.pr, ".2f"), f"{r.wall_s:.0f}"]
        report.guarded(solution.key, 9, item)


def hacks_section(report: Report) -> None:
    reference = (FIXTURES / "relu_reference.py").read_text()
    report.section("Hack patterns (runtime checks only; the static screen is off)", ["fixture", "caught", "status", "expected", "reasons"])
    for name, expected in HACKS.items():
        def item(name: str = name, expected: str | tuple[str, ...] = expected) -> list[Any]:
            r = evaluate(reference, (FIXTURES / "hacks" / f"{name}.py").read_text(), RUNTIME_ONLY, reuse_reference=True)
            allowed = expected if isinstance(expected, tuple) else (expected,)
            return ["yes" if r.status in allowed else "NO", r.status, " or ".join(allowed), "; ".join(r.hack_reasons)[:150] or r.diagnostic[:100]]
        report.guarded(name, 5, item)


def timing_hacks_section(report: Report) -> None:
    reference = kernelbench_source(1, 19)  # full-size ReLU: milliseconds of work to hide
    report.section("Timing hacks on KernelBench L1_19 (defeated by how they are timed: an honest ReLU is ~1x eager)",
                   ["fixture", "caught", "status", "expected", "diagnostic"])
    for name, (expected, phrase) in TIMING_HACKS.items():
        def timing_item(name: str = name, expected: str = expected, phrase: str = phrase) -> list[Any]:
            r = evaluate(reference, (FIXTURES / f"{name}.py").read_text(), RUNTIME_ONLY, reuse_reference=True)
            caught = r.status == expected and phrase in r.diagnostic and (r.speedup_eager or 0) < 1.25
            return ["yes" if caught else "NO", r.status, f"{expected}, '{phrase}', speedup < 1.25", f"{r.diagnostic[:160]} (speedup {fmt(r.speedup_eager)})"]
        report.guarded(name, 5, timing_item)

    from kpipe.gym.bank import list_solutions

    honest = [s for s in list_solutions("legit") if (s.level, s.problem_id) == (1, 19)]

    def paired_item() -> list[Any]:  # kgym-4/5's GPU-only path: the reference timed inside the candidate child
        r = evaluate(reference, honest[0].source, RUNTIME_ONLY, reuse_reference=True)
        ran = r.status == "pass" and r.gpu_drift is not None and 0.8 < (r.speedup_eager or 0) < 1.25
        return ["yes" if ran else "NO", r.status, "pass, timed beside the reference",
                f"GPU drift {fmt(r.gpu_drift)} {r.diagnostic[:80]} (speedup {fmt(r.speedup_eager)})"]
    if honest:
        report.guarded("bank legit ReLU (kgym-6: reference timed beside it, back to back)", 5, paired_item)


def faults_section(report: Report) -> None:
    reference = (FIXTURES / "relu_reference.py").read_text()
    report.section("Faults (classified; this process survives each)", ["fixture", "classified", "status", "expected", "wall s", "diagnostic"])
    for name, expected in GPU_FAULTS.items():
        def item(name: str = name, expected: str = expected) -> list[Any]:
            protocol = RUNTIME_ONLY if name != "gpu/hang" else Protocol.from_dict({**RUNTIME_ONLY.to_dict(), "timeout_s": 30})
            r = evaluate(reference, (FIXTURES / f"{name}.py").read_text(), protocol, reuse_reference=True)
            return ["yes" if r.status == expected else "NO", r.status, expected, f"{r.wall_s:.1f}", r.diagnostic.splitlines()[0][:120] if r.diagnostic else ""]
        report.guarded(name, 6, item)


def pr_section(report: Report) -> None:
    from kpipe.gym.bank import list_solutions

    report.section("PR (paper Eq. 7): pure Triton vs lazy optimisation", ["candidate", "status", "PR", "expected"])
    pure = [s for s in list_solutions("legit") if (s.level, s.problem_id) == (1, 19)]
    if pure:
        report.guarded("L1_19 ReLU, all Triton", 4, lambda: _pr_row(kernelbench_source(1, 19), pure[0].source, "~1"))
    lazy = (FIXTURES / "gpu" / "lazy_gemm_epilogue.py").read_text()
    report.guarded("L2_76 cuBLAS GEMM + Triton epilogue", 4, lambda: _pr_row(kernelbench_source(2, 76), lazy, "~0"))


def _pr_row(reference: str, candidate: str, expected: str) -> list[Any]:
    r = evaluate(reference, candidate, EAGER, reuse_reference=True)
    return [r.status, fmt(r.pr, ".3f"), expected]


def noise_section(report: Report) -> None:
    from kpipe.gym.bank import list_solutions

    report.section(f"Timing noise: the same candidate {NOISE_REPEATS}x, reference re-timed each time", ["task", "eager ms", "speedups vs eager", "max/min", f"<= {NOISE_LIMIT}"])
    for solution in [s for s in list_solutions("legit") if (s.level, s.problem_id) in NOISE_TASKS]:
        def item(solution: Any = solution) -> list[Any]:
            reference = kernelbench_source(solution.level, solution.problem_id)
            results = [evaluate(reference, solution.source, EAGER) for _ in range(NOISE_REPEATS)]
            speedups = [r.speedup_eager for r in results if r.speedup_eager]
            if len(speedups) < NOISE_REPEATS:
                return ["-", ", ".join(r.status for r in results), "-", "NO"]
            ratio = max(speedups) / min(speedups)
            eager_ms = min(r.eager_ms for r in results)
            verdict = ("yes" if ratio <= NOISE_LIMIT else "NO") if eager_ms >= NOISE_MIN_MS else f"n/a (< {NOISE_MIN_MS} ms)"
            return [fmt(eager_ms), ", ".join(fmt(s, ".4f") for s in speedups), f"{ratio:.4f}", verdict]
        report.guarded(solution.key, 5, item)


SECTIONS = {"hacks": hacks_section, "timing_hacks": timing_hacks_section, "faults": faults_section, "pr": pr_section, "noise": noise_section, "bank": bank_section}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=470, help="stop starting new items after this many seconds")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args()
    started = time.monotonic()
    report = Report(args.budget_s)
    report.lines += ["# KernelGym GPU check", "", gpu_harness.facts_line(gpu_harness.device_facts())]
    print(report.lines[-1], flush=True)
    # cheap sections first, so the long bank table (torch.compile per task) cannot starve them
    for name in args.sections.split(","):
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        SECTIONS[name](report)
        gpu_harness.write_report("gym_check", "\n".join(report.lines) + "\n")
    report.note(f"Total wall time {time.monotonic() - started:.0f} s. "
                + (f"FAILED: {', '.join(report.failures)}" if report.failures else "Every row as expected."))
    gpu_harness.write_report("gym_check", "\n".join(report.lines) + "\n")
    return gpu_harness.exit_status(report.failures)


if __name__ == "__main__":
    sys.exit(main())
