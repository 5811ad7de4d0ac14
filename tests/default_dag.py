"""What of the default DAG's tables does not depend on the clock, recorded once from a run of main
73f9be3 (before issue 66's reshape) so that a run of the reshaped code can be checked against it
(tests/test_workflow.py): `python tests/default_dag.py RESULTS` records a run's.

On a CPU, KernelGym's speedups are interpreter timings, so every reward, what RL learns from it and
every later generation vary from run to run (issue 65); the teacher's feedback quotes timings too.
What does not: the tasks, the decontaminated queries, and SFT's curve (loss, gradient norm, token
counts and learning rate per step, which also pins the cold-start turns SFT trains on). Two runs of main and of the
reshaped code on this 2-core machine gave the same values to the last bit; the comparison allows 1e-6.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "default_dag" / "at_main.json"
SFT_METRICS = ("loss", "grad_norm", "label_tokens", "tokens", "lr", "epoch")


def digest(rows: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def only(results: Path, pattern: str) -> Path:
    """The one file of `results` that `pattern` matches (tasks and queries lie in folders named by digests)."""
    (path,) = results.glob(pattern)
    return path


def deterministic_tables(results: Path) -> dict[str, Any]:
    """The clock-free part of a default run's `results/`: row digests of tasks and queries, SFT's curve."""
    from kpipe.data.io import read_table

    sft = read_table(results / "train_metrics" / "stage=sft" / "run=default" / "part-0.parquet", "train_metrics")
    return {
        "tasks": digest(read_table(only(results, "tasks/*/tasks.parquet"), "tasks").to_pylist()),
        "queries": digest(read_table(only(results, "queries/*/queries.parquet"), "queries").to_pylist()),
        "sft": sorted([row["step"], row["name"], row["value"]] for row in sft.to_pylist() if row["name"] in SFT_METRICS),
    }


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(deterministic_tables(Path(sys.argv[1])), indent=0))
