"""What the timing-noise probes share (benchmarks/timing_residual.py, pairing_methods.py,
window_state.py; timing_noise.py and timing_placement.py load their pairs here too): their command
line, the bank's pairs loaded as the gym's child loads them, their measurements run in fresh
interpreters (one JSON line each), the report of a saved run re-read without the GPU, and how often
five evaluations would spread beyond issue 14's bound."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


def probe_parser(doc: str | None, tasks: str, processes: int) -> argparse.ArgumentParser:
    """The options every probe has; each adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=tasks)
    parser.add_argument("--processes", type=int, default=processes)
    parser.add_argument("--out", type=Path, help="every per-trial time, as JSON")
    parser.add_argument("--replay", type=Path, help="print the report of an earlier --out file (no GPU)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def run_probe(script: str, args: argparse.Namespace, child_args: list[str], measure: Callable[[], Any],
              report: Callable[[dict[str, Any]], list[str]], describe: str,
              merge: Callable[[dict[str, list[Any]]], dict[str, Any]] | None = None) -> None:
    """A probe after its options are read: ``--replay`` prints the report of a saved run;
    ``--child`` measures in this process and prints one JSON line; otherwise `args.processes`
    fresh processes measure (their rows per task, or `merge` of them), and the report, the GPU and
    the run's length are printed and the trials saved to ``--out``."""
    if args.replay:
        print("\n".join(report(json.loads(args.replay.read_text())["tasks"])))
        return
    if args.child:
        print(json.dumps(measure()))
        return
    import torch

    started = time.monotonic()
    per_process = in_fresh_processes(script, child_args, args.processes)
    data = merge(per_process) if merge else per_process
    print("\n".join(report(data)))
    gpu = torch.cuda.get_device_name(0)
    print(f"\n{gpu}; {describe}; whole run {time.monotonic() - started:.0f} s")
    save(args.out, gpu, data)


@dataclass(frozen=True)
class LoadedPair:
    """A task's KernelBench reference and the bank's legit kernel, loaded from files as
    kpipe.gym.child loads them; models and inputs built with the protocol's seed (the weights and
    inputs an evaluation uses) on `device`."""

    task: str
    reference: ModuleType
    candidate: ModuleType
    init_inputs: list[Any]
    seed: int
    device: str

    def reference_model(self) -> Any:
        from kpipe.gym.child import build_model

        return build_model(self.reference.Model, self.init_inputs, self.seed, self.device)

    def candidate_model(self) -> Any:
        from kpipe.gym.child import build_model

        return build_model(self.candidate.ModelNew, self.init_inputs, self.seed, self.device)

    def input_sets(self, count: int | None = None) -> list[Any]:
        """The evaluation's timing input sets (`count`, default the child's TIMING_SETS)."""
        from kpipe.gym.child import TIMING_SETS
        from kpipe.gym.trial_data import make_inputs, trial_seed

        return [make_inputs(self.reference.get_inputs, trial_seed(self.seed, k), self.device)
                for k in range(TIMING_SETS if count is None else count)]


def loaded_pairs(tasks: list[str], device: str = "cuda", shrink: int = 0) -> Iterator[LoadedPair]:
    """Each task's pair (kernelbench_side_by_side.bank_pairs), loaded when the loop reaches it."""
    from kernelbench_side_by_side import bank_pairs
    from kpipe.gym.child import load_module
    from kpipe.gym.protocol import Protocol

    workdir = Path(tempfile.mkdtemp(prefix="bank-pairs-"))
    for pair in bank_pairs(tasks, shrink):
        reference = load_module(pair["reference"], f"ref_{pair['task']}", workdir)
        candidate = load_module(pair["candidate"], f"cand_{pair['task']}", workdir)
        yield LoadedPair(pair["task"], reference, candidate, reference.get_init_inputs(), Protocol().seed, device)


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
