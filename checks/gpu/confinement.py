"""Confined candidates on a GPU (issues 25, 52): every attack of the attack tests (``ATTACK_TESTS``) fails on the
GPU, and confinement costs KernelGym no throughput. (The bank's 66 pairs through the confined pool,
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


def attacks(report: Report, options: argparse.Namespace) -> None:
    """Every attack, through `kpipe gym eval`, `eval-batch` and `kpipe gym serve`, with the candidates on the GPU."""
    import importlib.util

    missing = [name for name in SERVICE_MODULES if importlib.util.find_spec(name) is None]
    report.expect(not missing, f"cannot check the service path: {', '.join(missing)} missing (carry their wheels in .whl/)")
    if missing:
        return
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *ATTACK_TESTS]
    code = run_logged(report, argv, {"KPIPE_TEST_GYM_DEVICE": "cuda"})
    report.expect(code == 0, f"an attack was not stopped (pytest exited {code})")


def cost(report: Report, options: argparse.Namespace) -> None:
    """Confined and unconfined throughput, one pass each, with the same statuses
    (benchmarks/confinement_cost.py; its table lands in $OUT)."""
    code = run_logged(report, [sys.executable, "benchmarks/confinement_cost.py", "--rounds", "2"])
    report.expect(code == 0, f"confined and unconfined runs gave different statuses (exit {code})")


SECTIONS = (Section("attacks", 240, attacks), Section("cost", 240, cost))
