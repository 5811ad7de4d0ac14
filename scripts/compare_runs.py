"""Do two result trees hold the same rows? A before/after check for refactors.

    python scripts/compare_runs.py RESULTS_A RESULTS_B [--ignore COLUMN ...] [--rtol 1e-9] [--show 5]

Every kpipe Parquet table under each tree (files stamped ``kpipe.table`` by
``kpipe.data.io.write_table``: tasks, queries, queries_raw, trajectories, train_metrics, evals;
``work/`` and ``cache/`` are partial work, not results, and are skipped) is compared row by row,
per table, matched by the file's path relative to the tree plus the table's key columns
(``KEYS``). What a rerun cannot reproduce is left out:

- timings and durations: columns ending in ``_ms``, ``_ms_iqr`` or ``_s`` (``gen_s``, ``eval_s``,
  ``wall_s``), ``timed_spans``; train_metrics rows whose name is a timing (``TIMING_METRIC``);
- where it ran: ``device_id`` (the GPU's uuid and bus address);
- in free text (``feedback``, ``diagnostic``, the prompt's messages), decimal numbers, which are
  the measured times the feedback quotes (``1.23 ms``) -- the words around them still count;
- speedups (``speedup_*``): only their side of 1 is compared (faster, as fast, slower), and
  whether there is one.

Everything else counts: statuses, correct/hacked, codes, responses, rewards, returns,
advantages, losses (floats equal within ``--rtol``); ``--ignore NAME`` leaves out more columns or
train_metrics metrics. Prints one summary line per table (and the first differing rows) and
exits 1 on any difference, 0 when every table holds the same rows.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

SKIPPED_DIRS = {"work", "cache"}
KEYS: dict[str, tuple[str, ...]] = {
    "tasks": ("task_id",),
    "queries": ("query_id",),
    "evals": ("key",),
    "trajectories": ("run", "stage", "iteration", "model", "task_id", "sample", "turn"),
    "train_metrics": ("run", "stage", "iteration", "step", "name"),
}
IGNORED_COLUMNS = {"timed_spans", "device_id"}
TIMING_SUFFIXES = ("_ms", "_ms_iqr", "_s")
TIMING_METRIC = re.compile(r"(^|_)(time|seconds|elapsed|wall|duration|throughput)($|_)|_s$|_ms$|per_s(ec)?($|_)")
FREE_TEXT = {"feedback", "diagnostic", "prompt_messages"}
DECIMAL = re.compile(r"\d+\.\d+(?:[eE][-+]?\d+)?")


def ignored(column: str, extra: Iterable[str] = ()) -> bool:
    return column in IGNORED_COLUMNS or column in set(extra) or column.endswith(TIMING_SUFFIXES)


def speedup_side(value: float | None) -> str | None:
    """Which side of 1 a speedup is on: what a rerun with other timings should keep."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return "faster" if value > 1 else "slower" if value < 1 else "same"


def masked(value: Any) -> Any:
    """Free text with its decimal numbers (measured times) replaced by '#'."""
    if isinstance(value, str):
        return DECIMAL.sub("#", value)
    if isinstance(value, list):
        return [masked(item) for item in value]
    if isinstance(value, dict):
        return {key: masked(item) for key, item in value.items()}
    return value


def comparable(column: str, value: Any) -> Any:
    if column.startswith("speedup_"):
        return speedup_side(value)
    if column in FREE_TEXT:
        return masked(value)
    return value


def same_value(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-3)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y, rtol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k], rtol) for k in a)
    return a == b


def kpipe_tables(root: Path) -> dict[str, dict[str, Path]]:
    """table name -> {path relative to `root`: file} of every kpipe Parquet file under `root`."""
    found: dict[str, dict[str, Path]] = {}
    for path in sorted(root.rglob("*.parquet")):
        relative = path.relative_to(root)
        if SKIPPED_DIRS & set(relative.parts[:-1]):
            continue
        meta = pq.read_schema(path).metadata or {}
        table = meta.get(b"kpipe.table", b"").decode()
        if table:
            found.setdefault(table, {})[str(relative)] = path
    return found


def _sort_key(row: dict[str, Any], keys: Sequence[str]) -> tuple:
    return tuple((row.get(key) is None, str(row.get(key)) if not isinstance(row.get(key), int) else row.get(key))
                 for key in keys)


def table_rows(files: dict[str, Path], table: str, extra_ignored: Sequence[str]) -> list[dict[str, Any]]:
    """Every compared row of one table, tagged with its file, in key order."""
    rows = []
    for relative, path in sorted(files.items()):
        for row in pq.read_table(path).to_pylist():
            if table == "train_metrics" and (TIMING_METRIC.search(str(row.get("name", "")))
                                             or row.get("name") in extra_ignored):
                continue
            kept = {column: comparable(column, value) for column, value in row.items()
                    if not ignored(column, extra_ignored)}
            rows.append({"file": relative, **kept})
    keys = ("file", *KEYS.get(table, ()))
    rows.sort(key=lambda row: (_sort_key(row, keys), repr(sorted(row.items()))))
    return rows


def compare_table(table: str, files_a: dict[str, Path], files_b: dict[str, Path], rtol: float,
                  extra_ignored: Sequence[str], show: int) -> tuple[bool, list[str]]:
    """(same?, report lines) for one table."""
    lines = []
    only_a, only_b = sorted(set(files_a) - set(files_b)), sorted(set(files_b) - set(files_a))
    for name, only in (("A", only_a), ("B", only_b)):
        for relative in only[:show]:
            lines.append(f"  only in {name}: {relative}")
        if len(only) > show:
            lines.append(f"  ... and {len(only) - show} more file(s) only in {name}")
    rows_a = table_rows(files_a, table, extra_ignored)
    rows_b = table_rows(files_b, table, extra_ignored)
    keys = ("file", *KEYS.get(table, ()))
    differing = Counter()
    examples = []
    for index, (a, b) in enumerate(zip(rows_a, rows_b)):
        columns = sorted(set(a) | set(b))
        bad = [column for column in columns if not same_value(a.get(column), b.get(column), rtol)]
        if bad:
            differing.update(bad)
            if len(examples) < show:
                where = ", ".join(f"{key}={a.get(key)!r}" for key in keys if key in a)
                detail = "; ".join(f"{column}: {_short(a.get(column))} != {_short(b.get(column))}" for column in bad[:4])
                examples.append(f"  row {index} ({where}): {detail}")
    n_differing_rows = sum(1 for a, b in zip(rows_a, rows_b)
                           if any(not same_value(a.get(c), b.get(c), rtol) for c in set(a) | set(b)))
    same = not only_a and not only_b and len(rows_a) == len(rows_b) and not differing
    summary = f"{table}: {len(files_a)} / {len(files_b)} file(s), {len(rows_a)} / {len(rows_b)} row(s)"
    if same:
        summary += ": same rows"
    else:
        parts = []
        if len(rows_a) != len(rows_b):
            parts.append(f"row counts differ by {len(rows_b) - len(rows_a):+d}")
        if differing:
            parts.append(f"{n_differing_rows} row(s) differ in " + ", ".join(f"{c} ({n})" for c, n in differing.most_common()))
        if only_a or only_b:
            parts.append(f"{len(only_a)} file(s) only in A, {len(only_b)} only in B")
        summary += ": DIFFERENT: " + "; ".join(parts)
    return same, [summary, *lines, *examples]


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def compare(root_a: Path, root_b: Path, rtol: float = 1e-9, extra_ignored: Sequence[str] = (),
            show: int = 5) -> tuple[bool, list[str]]:
    """(every table the same?, the report) for two result trees."""
    tables_a, tables_b = kpipe_tables(root_a), kpipe_tables(root_b)
    if not tables_a and not tables_b:
        return False, [f"no kpipe Parquet tables under {root_a} or {root_b}"]
    same, report = True, []
    for table in sorted(set(tables_a) | set(tables_b)):
        table_same, lines = compare_table(table, tables_a.get(table, {}), tables_b.get(table, {}), rtol,
                                          extra_ignored, show)
        same &= table_same
        report += lines
    return same, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results_a", type=Path)
    parser.add_argument("results_b", type=Path)
    parser.add_argument("--ignore", action="append", default=[], metavar="NAME",
                        help="leave this column (or train_metrics metric, e.g. fast@1) out too (repeatable)")
    parser.add_argument("--rtol", type=float, default=1e-9, help="relative tolerance of float columns")
    parser.add_argument("--show", type=int, default=5, help="differing rows (and files) shown per table")
    args = parser.parse_args(argv)
    for root in (args.results_a, args.results_b):
        if not root.is_dir():
            parser.error(f"{root} is not a directory")
    same, report = compare(args.results_a, args.results_b, args.rtol, args.ignore, args.show)
    print("\n".join(report))
    print("same rows in every table" if same else "the result trees differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
