"""The whole GPU suite as device calls of at most 10 minutes each (the lent machines' limit per command).

    python scripts/gpu_suite.py                                   # the plan: the checks of each call
    . scripts/device_env.sh && python3 scripts/gpu_suite.py --call 3    # on the device: run call 3

Each check runs as its own process with ``$OUT/<check>/`` as its ``$OUT`` (its report lands there,
scripts/gpu_harness.py). Exit status 1 when any check of the call exited non-zero. The seconds per
check are its wall time on one H100 from empty compile caches in its last result (docs/gpu-results)
or, where no run split it so, an estimate; calls are packed to 540 s, leaving a tenth for start-up.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gpu_harness

ROOT = Path(__file__).resolve().parent.parent
CALL_LIMIT_S = 540


@dataclass(frozen=True)
class Check:
    name: str
    command: tuple[str, ...]  # a script under scripts/ and its arguments (run by this Python), or a bash command
    seconds: int
    gpus: int = 1

    @property
    def folder(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", self.name.lower()).strip("_")

    def argv(self) -> list[str]:
        return list(self.command) if self.command[0] == "bash" else [sys.executable, *self.command]


SUITE = (
    Check("gym hacks timing_hacks faults", ("scripts/gpu_check_gym.py", "--sections", "hacks,timing_hacks,faults",
                                            "--budget-s", "280"), 330),
    Check("gym pr noise", ("scripts/gpu_check_gym.py", "--sections", "pr,noise", "--budget-s", "200"), 240),
    Check("gym bank", ("scripts/gpu_check_gym.py", "--sections", "bank", "--budget-s", "450"), 480),
    Check("gym paths pool", ("scripts/gpu_check_gym_paths.py", "--sections", "pool"), 240),
    Check("gym paths service", ("scripts/gpu_check_gym_paths.py", "--sections", "service"), 280),
    Check("gym paths ray", ("scripts/gpu_check_gym_paths.py", "--sections", "ray"), 380),
    *(Check(f"gym paths eval {k} of 3", ("scripts/gpu_check_gym_paths.py", "--sections", f"eval:{k}/3"), 450)
      for k in range(3)),
    Check("gym paths placement caches", ("scripts/gpu_check_gym_paths.py", "--sections", "placement,caches"), 300),
    Check("confinement attacks bank", ("bash", "scripts/gpu_check_confinement.sh", "attacks,bank"), 300),
    Check("confinement cost", ("bash", "scripts/gpu_check_confinement.sh", "cost"), 240),
    Check("rl learns", ("scripts/gpu_check_rl_learns.py",), 240),
    Check("rl step", ("scripts/gpu_check_rl.py",), 240),
    Check("sft", ("scripts/gpu_check_sft.py",), 240),
    Check("rl fsdp", ("scripts/gpu_check_rl_fsdp.py", "--gpus", "2"), 120, gpus=2),
)


def plan(checks: tuple[Check, ...] = SUITE, limit_s: int = CALL_LIMIT_S) -> list[list[Check]]:
    """The checks in suite order, packed into calls whose seconds add up to at most `limit_s`; a
    call needs one machine, so checks on different numbers of GPUs never share one."""
    calls: list[list[Check]] = []
    for check in checks:
        last = calls[-1] if calls else []
        if last and last[0].gpus == check.gpus and sum(c.seconds for c in last) + check.seconds <= limit_s:
            last.append(check)
        else:
            calls.append([check])
    return calls


def run_call(call: list[Check], out: Path) -> int:
    """Run one call's checks one after another (one GPU each, nothing beside it)."""
    src = str(ROOT / "src")  # absolute: evaluation children run in scratch directories
    path = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    failures = []
    for check in call:
        folder = out / check.folder
        folder.mkdir(parents=True, exist_ok=True)
        print(f"== {check.name}: {' '.join(check.command)}", flush=True)
        done = subprocess.run(check.argv(), cwd=ROOT, env={**os.environ, "OUT": str(folder), "PYTHONPATH": path})
        if done.returncode:
            failures.append(f"{check.name} exited {done.returncode}")
    return gpu_harness.exit_status(failures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--call", type=int, help="run this call of the plan (1-based); without it, print the plan")
    args = parser.parse_args()
    calls = plan()
    if args.call is None:
        for number, call in enumerate(calls, 1):
            gpus = f", {call[0].gpus} GPUs" if call[0].gpus > 1 else ""
            print(f"call {number} (~{sum(c.seconds for c in call)} s{gpus}): " + "; ".join(c.name for c in call))
        return 0
    if not 1 <= args.call <= len(calls):
        parser.error(f"--call must be 1 to {len(calls)}")
    return run_call(calls[args.call - 1], gpu_harness.out_dir(ROOT / "results" / "gpu_suite"))


if __name__ == "__main__":
    sys.exit(main())
