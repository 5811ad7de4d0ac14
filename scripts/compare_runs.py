"""Do two result trees hold the same rows? A before/after check: did my change alter results?

    python scripts/compare_runs.py RESULTS_A RESULTS_B [--config FILE ...] [--ignore COLUMN ...] [--rtol 1e-9] [--show 5]

Every kpipe Parquet table under each tree (files stamped ``kpipe.table`` by
``kpipe.data.io.write_table``: tasks, queries, queries_raw, trajectories, train_metrics, evals;
``work/`` and ``cache/`` are partial work, not results, and are skipped) is compared row by row,
per table, matched by the file's path relative to the tree plus the table's key columns
(``KEYS``), in two parts:

- **deterministic**: what two clean runs of the same code and config reproduce, on a CPU too. The
  exit status is this part's: 0 when it is the same in every table, 1 otherwise.
- **run-dependent**: what differs between clean runs, reported but never failing the comparison:
  what measured times decide (on a CPU the Triton interpreter's times vary run to run, and so do
  the speedups, the paper reward and PR computed from them, and through the rewards the RL
  policy's weights), and what a wrong kernel's uninitialised output decides:
  - columns ``speedup_*`` (compared by their side of 1: faster, as fast, slower), ``reward``,
    ``return_to_go``, ``advantage``, ``kept``, ``rejected_by`` (RL's filters read rewards), ``pr``,
    ``gpu_drift``; ``feedback`` and ``diagnostic`` of a pass, mismatch or hacked verdict (they quote
    measured times and profiles, or the candidate's wrong output);
  - whole rows written by an RL-trained policy: trajectories of stages rl and rl_val and of every
    model whose `source` is rl in the run's config (``--config``, default config/config.yaml;
    STTS's and the budget's ``<model>@<strategy>`` too), and train_metrics of stages rl and val;
  - trajectory turns after the first: their prompt quotes the measured times of earlier turns;
  - evals rows that no deterministic trajectory row references (``eval_key``).

Left out of both, as nothing a rerun reproduces: timings and durations (columns ending in ``_ms``,
``_ms_iqr`` or ``_s``, ``timed_spans``; train_metrics rows whose name is a timing,
``TIMING_METRIC``), ``device_id``, and in free text (``feedback``, ``diagnostic``, the prompt's
messages) decimal numbers (the measured times they quote) and the names of scratch folders under
/tmp; the words around them still count.
Floats are equal within ``--rtol``; ``--ignore NAME`` leaves out more columns or train_metrics
metrics. Prints one summary line per table and part (and the first differing rows).
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
import yaml

SKIPPED_DIRS = {"work", "cache"}
KEYS: dict[str, tuple[str, ...]] = {
    "tasks": ("task_id",),
    "queries": ("query_id",),
    "evals": ("key",),
    "trajectories": ("run", "stage", "iteration", "model", "task_id", "sample", "turn"),
    "train_metrics": ("run", "stage", "iteration", "step", "name"),
}
IGNORED_COLUMNS = {"timed_spans", "device_id"}
TIMING_COLUMNS = {"reward", "return_to_go", "advantage", "kept", "rejected_by", "pr", "gpu_drift"}
TIMING_STAGES = {"trajectories": {"rl", "rl_val"}, "train_metrics": {"rl", "val"}}
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"
DETERMINISTIC, VARYING = "deterministic", "run-dependent"
TIMING_SUFFIXES = ("_ms", "_ms_iqr", "_s")
TIMING_METRIC = re.compile(r"(^|_)(time|seconds|elapsed|wall|duration|throughput)($|_)|_s$|_ms$|per_s(ec)?($|_)")
FREE_TEXT = {"feedback", "diagnostic", "prompt_messages"}
DECIMAL = re.compile(r"\d+\.\d+(?:[eE][-+]?\d+)?")
SCRATCH_PATH = re.compile(r"/tmp/[^/\s'\"]+")  # a candidate's scratch folder, named at random, in tracebacks
# the diagnostic and feedback of a candidate that ran to a verdict quote what it measured (a pass: its
# times, their spread and profile, in words too) or what it output (a mismatch: a kernel that leaves
# memory unwritten returns what was there, max abs diff 1e29 in one run, NaN in the next; a hack
# check: the timings or outputs it caught)
VERDICT_TEXT = {"feedback", "diagnostic"}
MEASURED_VERDICTS = {"pass", "mismatch", "hacked"}


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
        return SCRATCH_PATH.sub("/tmp/#", DECIMAL.sub("#", value))
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


def run_dependent_column(column: str, row: dict[str, Any]) -> bool:
    """A column measured times decide, or a verdict's text quoting measurements or outputs."""
    return (column in TIMING_COLUMNS or column.startswith("speedup_")
            or (column in VERDICT_TEXT and row.get("status") in MEASURED_VERDICTS))


def rl_models(config_files: Sequence[Path]) -> set[str]:
    """Names of the models whose `source` is rl, in the config the files make (a later file's
    `models` list replaces an earlier one's, as Snakemake layers --configfile files)."""
    models: list[dict[str, Any]] = []
    for path in config_files:
        models = (yaml.safe_load(path.read_text()) or {}).get("models", models)
    return {model["name"] for model in models if model.get("source") == "rl"}


def timing_dependent_row(table: str, row: dict[str, Any], trained_on_timings: set[str],
                         deterministic_evals: set[str]) -> bool:
    """Whether the measured times decide the whole row (the module docstring says when)."""
    if table == "evals":
        return row.get("key") not in deterministic_evals
    if row.get("stage") in TIMING_STAGES.get(table, ()):
        return True
    if table == "trajectories":
        return str(row.get("model") or "").split("@")[0] in trained_on_timings or (row.get("turn") or 1) > 1
    return False


def table_rows(files: dict[str, Path], table: str, extra_ignored: Sequence[str], trained_on_timings: set[str],
               deterministic_evals: set[str]) -> dict[str, list[dict[str, Any]]]:
    """Every compared row of one table, tagged with its file, in key order, split into the
    deterministic and the run-dependent part (a deterministic row's run-dependent columns, with its
    keys, go to the run-dependent part)."""
    keys = ("file", *KEYS.get(table, ()))
    parts: dict[str, list[dict[str, Any]]] = {DETERMINISTIC: [], VARYING: []}
    for relative, path in sorted(files.items()):
        for row in pq.read_table(path).to_pylist():
            if table == "train_metrics" and (TIMING_METRIC.search(str(row.get("name", "")))
                                             or row.get("name") in extra_ignored):
                continue
            kept = {"file": relative, **{column: comparable(column, value) for column, value in row.items()
                                         if not ignored(column, extra_ignored)}}
            if timing_dependent_row(table, row, trained_on_timings, deterministic_evals):
                parts[VARYING].append(kept)
                continue
            varying = {column for column in kept if run_dependent_column(column, row)}
            parts[DETERMINISTIC].append({column: value for column, value in kept.items() if column not in varying})
            if varying:
                parts[VARYING].append({**{key: kept.get(key) for key in keys}, **{column: kept[column] for column in varying}})
    for rows in parts.values():
        rows.sort(key=lambda row: (_sort_key(row, keys), repr(sorted(row.items()))))
    return parts


def deterministic_eval_keys(files: dict[str, Path], trained_on_timings: set[str]) -> set[str]:
    """The eval_key of every deterministic trajectory row: their evals rows are deterministic too."""
    return {row["eval_key"] for path in files.values() for row in pq.read_table(path).to_pylist()
            if row.get("eval_key") and not timing_dependent_row("trajectories", row, trained_on_timings, set())}


def compare_table(table: str, part: str, files_a: dict[str, Path], files_b: dict[str, Path],
                  rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], rtol: float,
                  show: int) -> tuple[bool, list[str]]:
    """(same?, report lines) for one part of one table; files only in one tree count in the
    deterministic part."""
    lines = []
    only_a, only_b = (sorted(set(files_a) - set(files_b)), sorted(set(files_b) - set(files_a))) \
        if part == DETERMINISTIC else ([], [])
    for name, only in (("A", only_a), ("B", only_b)):
        for relative in only[:show]:
            lines.append(f"  only in {name}: {relative}")
        if len(only) > show:
            lines.append(f"  ... and {len(only) - show} more file(s) only in {name}")
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
    summary = f"{table} [{part}]: {len(files_a)} / {len(files_b)} file(s), {len(rows_a)} / {len(rows_b)} row(s)"
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
        summary += (": DIFFERENT: " if part == DETERMINISTIC else ": differs (as runs may): ") + "; ".join(parts)
    return same, [summary, *lines, *examples]


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def compare(root_a: Path, root_b: Path, rtol: float = 1e-9, extra_ignored: Sequence[str] = (),
            show: int = 5, config_files: Sequence[Path] = (DEFAULT_CONFIG,)) -> tuple[bool, list[str]]:
    """(the deterministic part the same in every table?, the report) for two result trees."""
    tables_a, tables_b = kpipe_tables(root_a), kpipe_tables(root_b)
    if not tables_a and not tables_b:
        return False, [f"no kpipe Parquet tables under {root_a} or {root_b}"]
    trained_on_timings = rl_models(config_files)
    evals_a = deterministic_eval_keys(tables_a.get("trajectories", {}), trained_on_timings)
    evals_b = deterministic_eval_keys(tables_b.get("trajectories", {}), trained_on_timings)
    same, report = True, []
    for table in sorted(set(tables_a) | set(tables_b)):
        files_a, files_b = tables_a.get(table, {}), tables_b.get(table, {})
        parts_a = table_rows(files_a, table, extra_ignored, trained_on_timings, evals_a)
        parts_b = table_rows(files_b, table, extra_ignored, trained_on_timings, evals_b)
        for part in (DETERMINISTIC, VARYING):
            part_same, lines = compare_table(table, part, files_a, files_b, parts_a[part], parts_b[part], rtol, show)
            same &= part_same or part == VARYING
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
    parser.add_argument("--config", action="append", type=Path, metavar="FILE",
                        help="the runs' config files, in --configfile order (default: config/config.yaml): "
                             "which models RL trained (repeatable)")
    args = parser.parse_args(argv)
    for root in (args.results_a, args.results_b):
        if not root.is_dir():
            parser.error(f"{root} is not a directory")
    same, report = compare(args.results_a, args.results_b, args.rtol, args.ignore, args.show,
                           args.config or [DEFAULT_CONFIG])
    print("\n".join(report))
    print("the same deterministic rows in every table (the run-dependent part may differ between clean runs)"
          if same else "the result trees differ in their deterministic part")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
