"""Batch evaluation for Snakemake rules: a Parquet of candidates in, an ``evals`` table out.

Input (``CANDIDATES.parquet``), either form; other columns are ignored:

- ``reference_src`` + ``candidate_src``: self-contained pairs;
- ``task_id`` + ``code`` (the ``trajectories`` columns), with ``--references`` naming a
  ``tasks`` or ``queries`` Parquet that maps ``task_id`` / ``query_id`` to ``reference_src``.
  A null ``code`` (nothing extracted) is evaluated as an empty program: a ``format_error``.

Output: the ``evals`` table, one row per input row in input order (duplicates included, so
row i answers candidate i). Resumable: every result goes to the result cache as soon as it
exists, so a rerun after a kill evaluates only what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from kpipe.data.io import write_table
from kpipe.gym.serve.cache import ResultCache
from kpipe.gym.protocol import Protocol
from kpipe.gym.judge.result import EvalResult, reference_error_result

ON_REFERENCE_ERROR = ("row", "fail", "skip")


class BatchInputError(ValueError):
    """The candidates file does not have a form this command reads."""


@dataclass
class BatchSummary:
    rows: int
    unique: int
    cached: int  # unique jobs already in the cache before this run
    evaluated: int  # unique jobs evaluated by this run
    written: int
    reference_errors: list[int] = field(default_factory=list)  # input row numbers

    def line(self) -> str:
        text = (f"{self.rows} rows, {self.unique} unique: {self.cached} from the cache, "
                f"{self.evaluated} evaluated; {self.written} rows written")
        if self.reference_errors:
            text += f"; {len(self.reference_errors)} rows whose reference failed"
        return text


def reference_map(path: Path) -> dict[str, str]:
    """``task_id``/``query_id`` -> ``reference_src`` from a tasks or queries Parquet."""
    names = pq.read_schema(path).names
    id_column = next((c for c in ("task_id", "query_id") if c in names), None)
    if id_column is None or "reference_src" not in names:
        raise BatchInputError(f"{path}: expected columns task_id (or query_id) and reference_src")
    table = pq.read_table(path, columns=[id_column, "reference_src"]).to_pydict()
    return dict(zip(table[id_column], table["reference_src"]))


def load_jobs(candidates: Path, references: Path | None = None) -> list[tuple[str, str]]:
    """(reference_src, candidate_src) per input row, in order."""
    names = pq.read_schema(candidates).names
    if {"reference_src", "candidate_src"} <= set(names):
        data = pq.read_table(candidates, columns=["reference_src", "candidate_src"]).to_pydict()
        pairs = list(zip(data["reference_src"], data["candidate_src"]))
        missing = [i for i, (ref, cand) in enumerate(pairs) if ref is None or cand is None]
        if missing:
            raise BatchInputError(f"{candidates}: null reference_src/candidate_src in row(s) {missing[:10]}")
        return pairs
    if {"task_id", "code"} <= set(names):
        if references is None:
            raise BatchInputError(f"{candidates}: has task_id + code; name the tasks/queries file with --references")
        by_id = reference_map(references)
        data = pq.read_table(candidates, columns=["task_id", "code"]).to_pydict()
        unknown = sorted({t for t in data["task_id"] if t not in by_id}, key=str)
        if unknown:
            raise BatchInputError(f"{candidates}: task id(s) not in {references}: {unknown[:10]}")
        return [(by_id[t], code or "") for t, code in zip(data["task_id"], data["code"])]
    raise BatchInputError(f"{candidates}: expected columns reference_src + candidate_src, or task_id + code; found {names}")


def cached_device_kind(protocol: Protocol) -> str:
    """The device kind evaluations would run on, found without starting workers (a rerun
    that is all cache hits then costs no worker start-up)."""
    from kpipe.gym.judge.evaluation import device_kind, resolve_device

    return device_kind(resolve_device(protocol))


def eval_batch(
    candidates: Path,
    output: Path,
    protocol: Protocol,
    cache: ResultCache,
    references: Path | None = None,
    workers: int | None = None,
    per_gpu: int | None = None,
    reuse_reference: bool = False,
    on_reference_error: str = "row",
    progress: bool = True,
) -> BatchSummary:
    """Evaluate every input row (through the cache) and write the ``evals`` rows to `output`.

    A reference that fails to run (after the pool retried it alone where it ran out of GPU
    memory) is bad input, not a bad candidate: with ``row`` (the default) its rows are written
    with the status ``reference_error`` and the reason, every other row as usual, so that one
    failed row never takes the batch with it; with ``fail`` the command raises after every other
    job finished (and was cached), naming the rows; with ``skip`` those rows are left out.
    """
    from kpipe.gym.judge.result import eval_key
    from kpipe.gym.serve.pool import GymPool

    if on_reference_error not in ON_REFERENCE_ERROR:
        raise ValueError(f"on_reference_error must be one of {ON_REFERENCE_ERROR}")
    jobs = load_jobs(candidates, references)
    kind = cached_device_kind(protocol)
    keys = [eval_key(ref, cand, protocol, kind) for ref, cand in jobs]
    unique = list(dict.fromkeys(keys))
    cached = cache.get_many(unique)
    results: list[Any] = [cached.get(key) for key in keys]
    missing = [i for i, result in enumerate(results) if result is None]
    if missing:
        with GymPool(protocol, workers=workers, per_gpu=per_gpu, cache=cache, reuse_reference=reuse_reference, progress=progress) as pool:
            if pool.device_kind != kind:
                raise RuntimeError(f"workers run on {pool.device_kind!r} but this process sees {kind!r}")
            for i, result in zip(missing, pool.evaluate_many([jobs[i] for i in missing])):
                results[i] = result
    bad_rows = [i for i, result in enumerate(results) if not isinstance(result, EvalResult)]
    if on_reference_error == "row":
        from kpipe.data.source_text import source_hash

        for i in bad_rows:
            results[i] = reference_error_result(keys[i], source_hash(jobs[i][0]), source_hash(jobs[i][1]),
                                                 str(results[i].get("diagnostic", "")))
    elif bad_rows and on_reference_error == "fail":
        reason = results[bad_rows[0]].get("diagnostic", "")
        raise BatchInputError(f"the reference failed in row(s) {bad_rows[:10]} (first: {reason[:300]})")
    rows = [result.to_row() for result in results if isinstance(result, EvalResult)]
    write_table(rows, output, "evals")
    return BatchSummary(rows=len(jobs), unique=len(unique), cached=len(cached),
                        evaluated=len(unique) - len(cached), written=len(rows), reference_errors=bad_rows)
