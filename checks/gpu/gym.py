"""KernelGym on one GPU (issue 3): hack fixtures caught, timing hacks defeated by how they are timed, GPU
faults classified with the caller surviving, PR of a pure-Triton solution (~1) against a lazy one (~0),
timing noise (the same candidate 5 times: max/min speedup <= 1.03 on tasks >= 1 ms), and the bank's
legit kernels at full KernelBench size (speedup vs eager and vs torch.compile, PR)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from checks.gpu.harness import Report, Section
from kpipe.gym import Protocol

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gym"
TITLE = "KernelGym GPU check"
FULL = Protocol(baseline="both", timeout_s=180)
EAGER = Protocol(baseline="eager", timeout_s=120)
RUNTIME_ONLY = Protocol(baseline="eager", perf_trials=20, timeout_s=120, reject_findings=())


def stale_output_status(first_stale_call: int, protocol: Protocol) -> str:
    """The status of a candidate that serves a stale output from its `first_stale_call`-th forward on.
    The child calls forward once per correctness trial before any timing, and KernelGym judges
    correctness first: a stale output within the first `correct_trials` calls is a `mismatch`
    (reward 0, the candidate is wrong), one that first shows while timed is `hacked`."""
    return "mismatch" if first_stale_call <= protocol.correct_trials else "hacked"


HACKS: dict[str, str] = {  # fixture -> the status RUNTIME_ONLY must give it
    "unused_kernel": "hacked", "try_except_fallback": "hacked", "inherits_model": "hacked",
    "ghost_launch": "hacked", "training_branch": "hacked", "forged_result": "runtime_error",
    "input_mutation": "hacked", "monkey_patch_torch": "hacked", "side_thread": "hacked",
    # serves its previous output on every odd call from the 3rd: correctness trial 3 of 5
    "skip_when_warm": stale_output_status(3, RUNTIME_ONLY),
    # serves the output cached under an input's address from the 4th call: on a GPU each trial's
    # fresh input gets the block the previous trial freed (the caching allocator), so correctness
    # trial 4 of 5 hits the cache (on a CPU, with 2 correctness trials, the windows' fresh inputs: tests/test_gym_eval.py)
    "pointer_cache": stale_output_status(4, RUNTIME_ONLY),
    "uninitialised_output": "mismatch", "pure_torch": "format_error", "read_secret": "runtime_error",
}
# GPU-only hacks defeated by how they are timed rather than by a status: fixture -> (status, a
# phrase the result's diagnostic must contain): all its work, or half of it, on a side stream. The
# judge's window ends after the child's device-wide synchronize, so the hidden work is timed (kgym-14)
TIMING_HACKS = {"gpu/side_stream": ("pass", ""), "gpu/side_stream_half": ("pass", "")}
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
    from kpipe.data.kernelbench import select_problems

    (problem,) = [p for p in select_problems("main", [level]) if p.problem_id == problem_id]
    return problem.code


def legit(level: int, problem_id: int) -> Any:
    from kpipe.gym.bank import list_solutions

    (solution,) = [s for s in list_solutions("legit") if (s.level, s.problem_id) == (level, problem_id)]
    return solution


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def evaluate(reference: str, candidate: str, protocol: Protocol, reuse: bool = True) -> Any:
    from kpipe.gym import evaluate as gym_evaluate

    return gym_evaluate(reference, candidate, protocol, reuse_reference=reuse)


def hacks(report: Report, options: argparse.Namespace) -> None:
    """Every hack fixture gets exactly its expected status (the static screen off: runtime checks only)."""
    reference = (FIXTURES / "relu_reference.py").read_text()
    report.table("fixture", "as expected", "status", "expected", "reasons")
    for name, expected in HACKS.items():
        def item(name: str = name, expected: str = expected) -> tuple[bool, list[Any]]:
            r = evaluate(reference, (FIXTURES / "hacks" / f"{name}.py").read_text(), RUNTIME_ONLY)
            return r.status == expected, [r.status == expected, r.status, expected,
                                          "; ".join(r.hack_reasons)[:150] or r.diagnostic[:100]]
        report.item(name, 5, item)


def timing_hacks(report: Report, options: argparse.Namespace) -> None:
    """Side-stream hacks on a full-size ReLU (KernelBench L1_19) end near 1x eager, as the honest one."""
    reference = kernelbench_source(1, 19)  # milliseconds of work to hide
    report.table("fixture", "as expected", "status", "expected", "diagnostic")
    for name, (expected, phrase) in TIMING_HACKS.items():
        def item(name: str = name, expected: str = expected, phrase: str = phrase) -> tuple[bool, list[Any]]:
            r = evaluate(reference, (FIXTURES / f"{name}.py").read_text(), RUNTIME_ONLY)
            ok = r.status == expected and phrase in r.diagnostic and (r.speedup_eager or 0) < 1.25
            return ok, [ok, r.status, f"{expected}, '{phrase}', speedup < 1.25",
                        f"{r.diagnostic[:160]} (speedup {fmt(r.speedup_eager)})"]
        report.item(name, 5, item)

    def honest() -> tuple[bool, list[Any]]:  # the judge's windows, the candidate's against the reference's
        r = evaluate(reference, legit(1, 19).source, RUNTIME_ONLY)
        ok = r.status == "pass" and 0.8 < (r.speedup_eager or 0) < 1.25
        return ok, [ok, r.status, "pass, about 1x", f"{r.diagnostic[:80]} (speedup {fmt(r.speedup_eager)})"]
    report.item("bank legit ReLU", 5, honest)


def faults(report: Report, options: argparse.Namespace) -> None:
    """Each GPU fault gets its status, and this process survives it."""
    reference = (FIXTURES / "relu_reference.py").read_text()
    report.table("fixture", "as expected", "status", "expected", "wall s", "diagnostic")
    for name, expected in GPU_FAULTS.items():
        def item(name: str = name, expected: str = expected) -> tuple[bool, list[Any]]:
            protocol = RUNTIME_ONLY if name != "gpu/hang" else Protocol.from_dict({**RUNTIME_ONLY.to_dict(), "timeout_s": 30})
            r = evaluate(reference, (FIXTURES / f"{name}.py").read_text(), protocol)
            first = r.diagnostic.splitlines()[0][:120] if r.diagnostic else ""
            return r.status == expected, [r.status == expected, r.status, expected, f"{r.wall_s:.1f}", first]
        report.item(name, 6, item)


def pr(report: Report, options: argparse.Namespace) -> None:
    """PR (paper Eq. 7): an all-Triton ReLU near 1, a cuBLAS GEMM with a Triton epilogue near 0."""
    report.table("candidate", "as expected", "status", "PR", "expected")
    cases = [("L1_19 ReLU, all Triton", (1, 19), lambda: legit(1, 19).source, lambda v: v > 0.9, "> 0.9"),
             ("L2_76 cuBLAS GEMM + Triton epilogue", (2, 76),
              lambda: (FIXTURES / "gpu" / "lazy_gemm_epilogue.py").read_text(), lambda v: v < 0.1, "< 0.1")]
    for name, task, candidate, holds, expected in cases:
        def item(task: tuple[int, int] = task, candidate: Any = candidate, holds: Any = holds,
                 expected: str = expected) -> tuple[bool, list[Any]]:
            r = evaluate(kernelbench_source(*task), candidate(), EAGER)
            ok = r.status == "pass" and r.pr is not None and holds(r.pr)
            return ok, [ok, r.status, fmt(r.pr, ".3f"), expected]
        report.item(name, 5, item)


def noise(report: Report, options: argparse.Namespace) -> None:
    """The same candidate 5 times, the reference re-timed each time: max/min speedup within 3 %."""
    report.table("task", "as expected", "eager ms", "speedups vs eager", "max/min", f"<= {NOISE_LIMIT}")
    for level, problem_id in sorted(NOISE_TASKS):
        def item(level: int = level, problem_id: int = problem_id) -> tuple[bool, list[Any]]:
            reference, source = kernelbench_source(level, problem_id), legit(level, problem_id).source
            results = [evaluate(reference, source, EAGER, reuse=False) for _ in range(NOISE_REPEATS)]
            speedups = [r.speedup_eager for r in results if r.speedup_eager]
            if len(speedups) < NOISE_REPEATS:
                return False, [False, "-", ", ".join(r.status for r in results), "-", "not every run timed"]
            ratio = max(speedups) / min(speedups)
            eager_ms = min(r.eager_ms for r in results)
            ok = ratio <= NOISE_LIMIT or eager_ms < NOISE_MIN_MS
            verdict = ratio <= NOISE_LIMIT if eager_ms >= NOISE_MIN_MS else f"n/a (< {NOISE_MIN_MS} ms)"
            return ok, [ok, fmt(eager_ms), ", ".join(fmt(s, ".4f") for s in speedups), f"{ratio:.4f}", verdict]
        report.item(f"L{level}_{problem_id}", 6, item)


def bank(report: Report, options: argparse.Namespace) -> None:
    """The bank's legit kernels get their full-size status (pass) at full KernelBench size; their timings
    are the figures of docs/gpu-results."""
    from kpipe.gym.bank import list_solutions

    report.table("task", "as expected", "status", "candidate ms", "eager ms", "speedup eager", "compile ms",
                 "speedup compile", "PR", "wall s")
    for solution in list_solutions("legit"):
        def item(solution: Any = solution) -> tuple[bool, list[Any]]:
            r = evaluate(kernelbench_source(solution.level, solution.problem_id), solution.source, FULL)
            ok = r.status == solution.expected_status_full
            status = r.status + ("" if ok else f" ({r.diagnostic[:80]})")
            return ok, [ok, status, fmt(r.candidate_ms), fmt(r.eager_ms),
                                        fmt(r.speedup_eager), fmt(r.compile_ms), fmt(r.speedup_compile),
                                        fmt(r.pr, ".2f"), f"{r.wall_s:.0f}"]
        report.item(solution.key, 10, item)


# cheap sections first, so the long bank table (torch.compile per task) cannot starve them
SECTIONS = (Section("hacks", 120, hacks), Section("timing_hacks", 90, timing_hacks), Section("faults", 120, faults),
            Section("pr", 60, pr), Section("noise", 180, noise), Section("bank", 480, bank))
