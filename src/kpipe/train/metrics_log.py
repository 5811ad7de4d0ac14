"""Per-step training metrics as `train_metrics` rows (long format: one row per name per step).

The whole log is rewritten atomically at every checkpoint, and a resumed run first forgets
the steps after its checkpoint: a killed-and-resumed run ends with each step logged once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kpipe.data.io import read_table, write_table


class MetricsLog:
    """Accumulates `train_metrics` rows of one run and stage, and writes them to one Parquet file."""

    def __init__(self, path: str | Path, run: str, stage: str, iteration: int = 0) -> None:
        self.path = Path(path)
        self.run, self.stage, self.iteration = run, stage, iteration
        self.rows: list[dict] = []

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record `values` (name -> number) for optimizer step `step`."""
        for name, value in values.items():
            self.rows.append({"run": self.run, "stage": self.stage, "iteration": self.iteration,
                              "step": step, "name": name, "value": float(value)})

    def resume(self, last_step: int) -> None:
        """Reload the file's rows of this run, stage and iteration up to `last_step`; later ones are redone."""
        if not self.path.exists():
            self.rows = []
            return
        rows = read_table(self.path, "train_metrics").to_pylist()
        self.rows = [r for r in rows if (r["run"], r["stage"], r["iteration"]) == (self.run, self.stage, self.iteration)
                     and r["step"] <= last_step]

    def flush(self) -> Path:
        """Write every row so far to `path` (atomic replace)."""
        return write_table(self.rows, self.path, "train_metrics")

    def series(self, name: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one metric, in step order."""
        return sorted((r["step"], r["value"]) for r in self.rows if r["name"] == name)
