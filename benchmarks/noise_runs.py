"""What the timing-noise probes share (benchmarks/timing_residual.py, pairing_methods.py): their
measurements run in fresh interpreters, one JSON line each, and their reports ask how often five
evaluations would spread beyond issue 14's bound."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def in_fresh_processes(script: str, child_args: list[str], processes: int) -> dict[str, list[Any]]:
    """Run `script --child child_args` `processes` times; per task, the rows of each process."""
    started = time.monotonic()
    data: dict[str, list[Any]] = {}
    for p in range(processes):
        done = subprocess.run([sys.executable, script, "--child", *child_args], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"process {p} failed:\n{done.stderr[-3000:]}")
        for task, rows in json.loads(done.stdout.strip().splitlines()[-1]).items():
            data.setdefault(task, []).append(rows)
        print(f"process {p + 1}/{processes} done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return data


def share_spread_beyond(values: list[float], bound: float = 1.03, draws: int = 2000) -> float:
    """How often five of `values`, drawn at random (fixed seed), have max/min above `bound`."""
    if len(values) < 5:
        return float("nan")
    pick = random.Random(0)
    return sum(max(five) / min(five) > bound for five in (pick.sample(values, 5) for _ in range(draws))) / draws


def save(path: Path | None, gpu: str, data: dict[str, Any]) -> None:
    if path:
        path.write_text(json.dumps({"gpu": gpu, "tasks": data}))
