"""Confined candidates on a GPU (issues 25, 52): every attack of the attack tests (``ATTACK_TESTS``) fails on the
GPU, a candidate's limits hold there without breaking CUDA (``limits``), and confinement costs KernelGym no throughput. (The bank's 66 pairs through the confined pool,
with their expected statuses, are the ``pool`` section of ``gym_paths``: candidates run confined by
default.)"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from checks.gpu.harness import Report, Section

ROOT = Path(__file__).resolve().parents[2]
TITLE = "Confined candidates on a GPU"


def run_logged(report: Report, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run `argv` in the repository, its output printed and its tail kept in the report."""
    done = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    print(done.stdout + done.stderr, flush=True)
    report.line("", f"`{' '.join(argv[1:])}`: exit {done.returncode}", "", "```",
                *(done.stdout + done.stderr).strip().splitlines()[-25:], "```")
    return done.returncode


# what tests/test_gym_confinement.py's service path (`kpipe gym serve`) imports beyond the device's image:
# without them that test fails for want of a module, which is no attack let through
SERVICE_MODULES = ("fastapi", "uvicorn")
# every attack test: escapes and leaks (issue 25), forged results, judge tampering, the scratch directory (issue 52)
ATTACK_TESTS = sorted(str(path.relative_to(ROOT)) for pattern in ("test_gym_confinement.py", "test_gym_forgery.py", "test_gym_attack*.py")
                      for path in (ROOT / "tests").glob(pattern))
# the same attacks through the run's KernelGym service in a Snakemake run: needs the project's install
# on the device (`python -m checks.gpu dag setup` first, in the same warm call or machine)
WORKFLOW_ATTACK_TEST = "tests/test_workflow_attacks.py"
ATTACK_WORKERS = 6  # of a device's 16 cores


def attacks(report: Report, options: argparse.Namespace) -> None:
    """Every attack, through `kpipe gym eval`, `eval-batch`, `kpipe gym serve` and the run's service in a
    Snakemake run, with the candidates on the GPU."""
    import importlib.util

    missing = [name for name in SERVICE_MODULES if importlib.util.find_spec(name) is None]
    report.expect(not missing, f"cannot check the service path: {', '.join(missing)} missing (carry their wheels in .whl/)")
    if missing:
        return
    # serially they took more than the 424 s left in a device call (every `kpipe gym eval` starts torch,
    # CUDA and its children cold); in parallel the honest kernels also time beside one another, as a
    # pool's workers do, and no test may hang the call
    with_workflow = importlib.util.find_spec("snakemake") is not None
    report.expect(with_workflow, f"cannot check the run's service in a Snakemake run: snakemake missing ({WORKFLOW_ATTACK_TEST}; "
                                 "run `python -m checks.gpu dag setup` first)")
    spread = ["-n", str(ATTACK_WORKERS), "--dist", "load"] if importlib.util.find_spec("xdist") else []
    bounded = ["--timeout", "300"] if importlib.util.find_spec("pytest_timeout") else []
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *spread, *bounded, *ATTACK_TESTS,
            *([WORKFLOW_ATTACK_TEST] if with_workflow else [])]
    code = run_logged(report, argv, {"KPIPE_TEST_GYM_DEVICE": "cuda"})
    report.expect(code == 0, f"an attack was not stopped (pytest exited {code})")


def cost(report: Report, options: argparse.Namespace) -> None:
    """Confined and unconfined throughput, one pass each, with the same statuses
    (benchmarks/confinement_cost.py; its table lands in $OUT)."""
    code = run_logged(report, [sys.executable, "benchmarks/confinement_cost.py", "--rounds", "2"])
    report.expect(code == 0, f"confined and unconfined runs gave different statuses (exit {code})")


# the limits probe's candidates (tests/test_gym_attack_limits.py has them all): an honest Triton kernel, and
# the same kernel after writing 4 GiB at its import, against a 2 GiB memory cap
LIMITS_FIXTURES = ROOT / "tests" / "fixtures" / "gym"
LIMITS_HOARD = "\nhoard = [b'x' * (64 << 20) for _ in range(64)]\n"


def limits(report: Report, options: argparse.Namespace) -> None:
    """Which mechanisms bound a candidate's memory and processes on this machine (a cgroup, or the judge's
    watchdog: kpipe.gym.confine.limits), and under each of them, on the GPU: CUDA and a real Triton kernel work
    (an honest candidate passes with the default limits) and the memory cap trips (``resource_limit``)."""
    import json
    import tempfile

    from kpipe.gym.confine.limits import detect_cgroups

    support = detect_cgroups()
    report.line(f"cgroups here: {support or 'none can be made: the watchdog bounds memory and processes'}; "
                f"the judge runs as uid {os.getuid()} (RLIMIT_NPROC would bind nothing for root)")
    modes = [("cgroup", {})] if support is not None else []
    modes.append(("watchdog", {"KPIPE_GYM_NO_CGROUP": "1"}))
    honest = (LIMITS_FIXTURES / "relu_legit.py").read_text()
    report.line("", "| enforced by: candidate | status | its tree's peak | diagnostic |", "|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kpipe-limits-") as scratch:
        root = Path(scratch)
        (root / "reference.py").write_text((LIMITS_FIXTURES / "relu_reference.py").read_text())
        for mode, env in modes:
            for name, source, protocol, expected in (
                    ("honest, default limits", honest, {"device": "cuda"}, "pass"),
                    ("writes 4 GiB, 2 GiB cap", honest + LIMITS_HOARD, {"device": "cuda", "memory_limit_mb": 2048}, "resource_limit")):
                (root / "candidate.py").write_text(source)
                (root / "protocol.json").write_text(json.dumps({**protocol, "reject_findings": []}))
                trace = root / "trace.jsonl"
                trace.unlink(missing_ok=True)
                done = subprocess.run([sys.executable, "-m", "kpipe.cli", "gym", "eval", "--reference", str(root / "reference.py"),
                                       "--candidate", str(root / "candidate.py"), "--protocol", str(root / "protocol.json"), "--json"],
                                      cwd=ROOT, env={**os.environ, **env, "KPIPE_GYM_TRACE": str(trace)}, capture_output=True, text=True)
                peaks = json.loads(trace.read_text().splitlines()[-1]).get("candidate_peaks") if trace.exists() else None
                peak = ", ".join(f"{key} {value:.0f}" for key, value in (peaks or {}).items())
                try:
                    result = json.loads(done.stdout)
                except ValueError:
                    result = {"status": f"no result (exit {done.returncode})", "diagnostic": done.stderr[-300:]}
                report.row(f"{mode}: {name}", result["status"], peak, str(result.get("diagnostic", ""))[:200],
                           ok=result["status"] == expected)


SECTIONS = (Section("attacks", 300, attacks), Section("limits", 90, limits), Section("cost", 240, cost))
