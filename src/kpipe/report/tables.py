"""The paper's tables from the kpipe database: each ``workflow/sql/<name>.sql`` (one SELECT)
becomes ``<out>/<name>.csv`` (every grouping key and count, so each number can be traced back
with ``kpipe query``) and ``<out>/<name>.md`` (the SQL file's header comment as notes, the
paper's published numbers as reference rows marked "paper", and the table).

Fast@p tables (and the STTS and RL validation curves, ``INTERVALS``) also get a 95% bootstrap
interval per cell that resamples whole tasks (``kpipe.data.metrics.bootstrap_ci``): the samples of one
task are correlated.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NamedTuple

import duckdb
import numpy as np
import pandas as pd
from tabulate import tabulate

from kpipe.data import metrics
from kpipe.data.db import connect
from kpipe.infra.config import REPO_ROOT
from kpipe.report.paper_numbers import FAST_COLUMNS, HACKING_RATIO, KEVIN_BUDGET, REPORTING, TABLE1_EAGER, TABLE2_COMPILE, FastRow

log = logging.getLogger(__name__)

DEFAULT_SQL_DIR = REPO_ROOT / "workflow" / "sql"
VIEWS_FILE = "views.sql"  # not a table: the views every table reads
FAST_TABLES = {"table1_fastp_eager": ("eager", TABLE1_EAGER), "table2_fastp_compile": ("compile", TABLE2_COMPILE)}
FAST_KEYS = ["run", "iteration", "model", "level", "baseline", "turn", "history"]
# the rows of each Fast@p table (its SQL's WHERE, and its bootstrap samples'): Table 1 also has the STTS rows
# (context management, "<model>@top_w(w=<w>)", at their last turn T and the best of turns 1..T)
TABLE1_ROWS = "(stage = 'eval' OR (stage = 'stts' AND split_part(model, '@', 2) LIKE 'top_w%'))"
FAST_ROWS = {"eager": TABLE1_ROWS, "compile": "stage = 'eval'"}
FAST_LABELS = {"fast_1": "Fast@1", "fast_1_2": "Fast@1.2", "fast_1_5": "Fast@1.5", "fast_2": "Fast@2"}
LEVELS = (1, 2, 3)
HACK_DEFINITIONS = ("kpipe", "paper")  # any KernelGym check; the paper's (no Triton kernel in train or eval mode)
REPORT_TURNS = ("paper", "last", "best")  # config tables.report_turn (turn_rule)
REPORT_TURN_NOTES = {
    "paper": "the pipeline's own models at their last turn, every other model (a baseline) at its best turn "
             "by mean Fast@p (the last unless an earlier one is better), as paper §6.1",
    "last": "every model at its last evaluated turn",
    "best": "every model at its best turn by mean Fast@p",
}
# tables of evaluation rows besides Tables 1 and 2: their notes also say which RL checkpoint a best_val model is
CHECKPOINT_TABLES = ("stts_curves", "ablations", "eval_summary", "kevin_metrics", "kevin_budget")
STTS_PAPER_MODEL = "Dr. Kernel-14B-STTS"  # Table 1's STTS rows (TABLE1_EAGER), the end points of Figure 6


def table_sql_files(sql_dir: Path = DEFAULT_SQL_DIR) -> list[Path]:
    """Every table query of `sql_dir` (all .sql files but the views)."""
    files = sorted(p for p in Path(sql_dir).glob("*.sql") if p.name != VIEWS_FILE)
    if not files:
        raise FileNotFoundError(f"no table .sql files in {sql_dir}")
    return files


def header_comment(sql: str) -> list[str]:
    """The leading `--` comment lines of a SQL file: what the table is and its conventions."""
    lines = []
    for line in sql.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line[2:].strip())
    return lines


def run_table_sql(db_path: Path, sql_file: Path) -> pd.DataFrame:
    with connect(db_path) as con:
        try:
            return con.sql(sql_file.read_text()).df()
        except duckdb.Error as error:
            raise RuntimeError(f"{sql_file.name}: {str(error).splitlines()[0]}") from None


# ---------------------------------------------------------------------------------------
# Fast@p tables: bootstrap intervals, paper rows, the paper's wide layout
# ---------------------------------------------------------------------------------------


def fast_samples(db_path: Path, baseline: str) -> pd.DataFrame:
    """The per-sample rows behind the Fast@p table of `baseline` (view fastp_samples)."""
    sql = (f"select {', '.join(FAST_KEYS)}, task_id, sample, {', '.join(FAST_COLUMNS)} from fastp_samples "
           f"where {FAST_ROWS[baseline]} and baseline = '{baseline}'")
    with connect(db_path) as con:
        return con.sql(sql).df()


def with_bootstrap_ci(table: pd.DataFrame, samples: pd.DataFrame, n_boot: int, seed: int = 0,
                      keys: Sequence[str] = FAST_KEYS, columns: Sequence[str] = FAST_COLUMNS) -> pd.DataFrame:
    """`table` with `<column>_lo` / `<column>_hi` columns (percent): a 95% interval per cell (a row
    of `table`, the `samples` with its `keys`), resampling the cell's tasks."""
    table = table.copy()
    if table.empty or n_boot <= 0:
        return table
    keys = list(keys)
    bounds: dict[str, list[float]] = {f"{c}_{side}": [] for c in columns for side in ("lo", "hi")}
    cells = dict(iter(samples.groupby(keys, dropna=False)))
    for key in table[keys].itertuples(index=False, name=None):
        cell = cells[key]
        for column in columns:
            ci = metrics.bootstrap_ci(cell[column].astype(float).to_numpy(), np.mean, n_boot=n_boot, seed=seed,
                                      groups=cell["task_id"].to_numpy())
            bounds[f"{column}_lo"].append(100 * ci.low)
            bounds[f"{column}_hi"].append(100 * ci.high)
    for name, values in bounds.items():
        table[name] = values
    return table


class Interval(NamedTuple):
    """Where the samples behind a percentage table's cells are, for its bootstrap intervals."""

    samples_sql: str  # one row per sample: the table's keys, task_id and each column as a boolean
    keys: tuple[str, ...]
    columns: tuple[str, ...]


# Other tables of percentages over samples get the Fast@p tables' intervals (their figures shade them)
INTERVALS = {
    "stts_curves": Interval("select run, base_model as model, strategy, level, turn as T, history, task_id, fast_1, "
                            "fast_1_2, fast_1_5, fast_2 from stts_samples where baseline = 'eager'",
                            ("run", "model", "strategy", "level", "T", "history"), FAST_COLUMNS),
    "rl_validation": Interval("select run, iteration, model, level, turn, task_id, fast_1, fast_1_2, "
                              "correct as pass_rate from fastp_samples where stage = 'rl_val' and baseline = 'eager' "
                              "and history = 'last' and turn = last_turn",
                              ("run", "iteration", "model", "level", "turn"), ("fast_1", "fast_1_2", "pass_rate")),
}


def with_intervals(db_path: Path, name: str, table: pd.DataFrame, n_boot: int, seed: int = 0) -> pd.DataFrame:
    """`table` (the result of `<name>.sql`) with the bootstrap intervals of INTERVALS[name]."""
    spec = INTERVALS[name]
    with connect(db_path) as con:
        samples = con.sql(spec.samples_sql).df()
    return with_bootstrap_ci(table, samples, n_boot, seed, spec.keys, spec.columns)


def paper_fast_rows(rows: Sequence[FastRow], baseline: str) -> pd.DataFrame:
    """The paper's rows in the CSV's long layout (source = "paper"; counts are not published; the
    turn is text such as "3 or best", so it goes to `reported_turn` and `turn` stays numeric)."""
    records = []
    for row in rows:
        for level, values in row.levels.items():
            records.append({"source": "paper", "model": row.model, "level": level, "baseline": baseline,
                            "reported_turn": row.turn, "history": row.history,
                            **dict(zip(FAST_COLUMNS, values)),
                            "where": row.where, "note": row.note})
    return pd.DataFrame(records)


def best_turn(rows: pd.DataFrame) -> int:
    """§6.1's "best average performance" of one model: the turn whose Fast@p, averaged over p and levels,
    is highest (ties: the later turn, so a model without a better earlier turn reports its last)."""
    means = rows.groupby("turn")[list(FAST_COLUMNS)].mean().mean(axis=1)
    return int(max(means.index, key=lambda turn: (means[turn], turn)))


def turn_rule(model: str, report_turn: str, own_models: Collection[str]) -> str:
    """Which turn a model's row reports: `last` or `best`. ``paper`` (§6.1): "turn 3 for our models and for
    most baselines [...] For baselines whose best average performance is achieved at an earlier turn, we
    instead report their best-performing turn": the pipeline's own models at the last turn, baselines at
    their best (which is the last unless an earlier turn is better)."""
    if report_turn not in REPORT_TURNS:
        raise ValueError(f"report_turn must be one of {REPORT_TURNS}, got {report_turn!r}")
    if "@" in model:  # an STTS row ("<model>@top_w(w=4)"): Table 1 reports its turn T, and † the best of 1..T
        return "last"
    if report_turn == "paper":
        return "last" if model in own_models else "best"
    return report_turn


def reported_rows(table: pd.DataFrame, report_turn: str = "paper", own_models: Collection[str] = ()) -> pd.DataFrame:
    """Per (run, iteration, model): the rows of the turn its row reports (`turn_rule`) and, for the best
    of history (†), of its last turn (best of turns 1..T), with `reported` = "last" or "best"."""
    parts = []
    for (_, _, model), rows in table.groupby(["run", "iteration", "model"], sort=False, dropna=False):
        last = int(rows["turn"].max())
        rule = turn_rule(model, report_turn, own_models)
        per_turn = rows[rows["history"] == "last"]
        turn = best_turn(per_turn) if rule == "best" and not per_turn.empty else last
        chosen = rows[((rows["history"] == "last") & (rows["turn"] == turn))
                      | ((rows["history"] == "best") & (rows["turn"] == last))]
        parts.append(chosen.assign(reported=rule, last_turn=last))
    return pd.concat(parts) if parts else table.assign(reported=pd.Series(dtype=str), last_turn=pd.Series(dtype=int))


def _cell(value: float | None) -> str:
    return "—" if value is None or pd.isna(value) else f"{value:.1f}"


def _range_cell(low: float | None, high: float | None) -> str:
    """A paper-definition cell: one number when no sample is unjudged, else the interval it lies in."""
    return _cell(low) if low is None or pd.isna(low) or high == low else f"{low:.1f}–{high:.1f}"


def _turn_label(history: str, turn: int, rule: str, last: int) -> str:
    if history == "best":
        return f"1..{turn}"
    return f"{turn} (best of 1..{last})" if rule == "best" else str(turn)


def fast_wide(table: pd.DataFrame, paper: pd.DataFrame, report_turn: str = "paper",
              own_models: Collection[str] = ()) -> pd.DataFrame:
    """The paper's layout: one row per model, history and hack definition, Fast@p columns per level; ours at
    the turn `report_turn` picks, each as kpipe's definition and the paper's (a range where samples only
    kpipe's checks rejected leave it open), then the paper's rows (their own definition)."""
    records = []
    ours = reported_rows(table, report_turn, own_models)
    for (run, iteration, model, history), group in ours.groupby(["run", "iteration", "model", "history"], sort=False):
        by_level = group.set_index("level")
        turn = int(group["turn"].iloc[0])
        common = {"model": model + (" †" if history == "best" else ""), "run": run, "iteration": iteration,
                  "turn": _turn_label(history, turn, group["reported"].iloc[0], int(group["last_turn"].iloc[0])),
                  "n per level": "/".join(str(int(by_level.loc[lv, "n_samples"])) if lv in by_level.index else "—"
                                          for lv in LEVELS)}
        for hacks in HACK_DEFINITIONS:
            column = "n_hacked" if hacks == "kpipe" else "n_hacked_paper"
            record = {"source": "kpipe", **common, "hacks": hacks, "hacked": int(group[column].sum())}
            for level in LEVELS:
                for fast in FAST_COLUMNS:
                    low = by_level.loc[level, fast] if level in by_level.index else None
                    high = by_level.loc[level, f"{fast}_paper_hi"] if level in by_level.index else None
                    record[f"L{level} {FAST_LABELS[fast]}"] = _cell(low) if hacks == "kpipe" else _range_cell(low, high)
            records.append(record)
    for (model, history, turn), group in paper.groupby(["model", "history", "reported_turn"], sort=False):
        by_level = group.set_index("level")
        record = {"source": "paper", "model": model + (" †" if history == "best" else ""), "run": "", "iteration": "",
                  "turn": turn, "n per level": "", "hacks": "paper", "hacked": ""}
        for level in LEVELS:
            for column in FAST_COLUMNS:
                record[f"L{level} {FAST_LABELS[column]}"] = _cell(by_level.loc[level, column])
        records.append(record)
    return pd.DataFrame(records)


# ---------------------------------------------------------------------------------------
# Other tables' paper rows and markdown bodies
# ---------------------------------------------------------------------------------------


def paper_hacking_rows() -> pd.DataFrame:
    return pd.DataFrame([{"source": "paper", "model": r.model, "level": r.level, "stage": r.when,
                          "hacking_ratio": r.hacking_ratio, "where": r.where} for r in HACKING_RATIO])


def paper_stts_rows() -> pd.DataFrame:
    """Table 1's Dr. Kernel-14B-STTS rows (Fast@1 to Fast@2) as the end points of Figure 6 (T not stated)."""
    return pd.DataFrame([{"source": "paper", "model": "Dr. Kernel-14B", "strategy": "top_w", "level": level,
                          "history": row.history, **dict(zip(FAST_COLUMNS, values)),
                          "where": "Table 1 (STTS rows); Figure 6"}
                         for row in TABLE1_EAGER if row.model == STTS_PAPER_MODEL
                         for level, values in row.levels.items()])


def paper_budget_rows() -> pd.DataFrame:
    """Kevin-32B's Table 2 (§5.4): 128 kernels per task as 16×8, 32×4 and 128×1."""
    return pd.DataFrame([{"source": "paper", "model": r.model, "budget": r.budget, "trajectories": r.trajectories,
                          "turns": r.turns, "k": r.trajectories, "full_budget": True,
                          "best_at_k_correct": r.best_correct, "best_at_k_speedup": r.best_speedup,
                          "where": r.where} for r in KEVIN_BUDGET])


PAPER_ROWS = {"hacking_ratio": paper_hacking_rows, "stts_curves": paper_stts_rows, "kevin_budget": paper_budget_rows}


def training_curve_summary(table: pd.DataFrame) -> pd.DataFrame:
    """The markdown view of the (long) training curves: first and last value of each metric."""
    if table.empty:
        return table
    ordered = table.sort_values(["iteration", "step"])
    grouped = ordered.groupby(["run", "stage", "name"])
    return pd.DataFrame({"steps": grouped.size(), "first": grouped["value"].first(),
                         "last": grouped["value"].last()}).reset_index()


def budget_summary(table: pd.DataFrame) -> pd.DataFrame:
    """The markdown view of the test-time budget table: each split at its whole budget (the CSV
    also has every smaller k, the scaling curves)."""
    if table.empty:
        return table
    return table[table["full_budget"]].drop(columns=["full_budget"])


MARKDOWN_VIEWS = {"training_curves": training_curve_summary, "kevin_budget": budget_summary}


def markdown_frame(frame: pd.DataFrame, preformatted: bool = False) -> str:
    """A github table; `preformatted` keeps the cells' own text (e.g. "50.0")."""
    if frame.empty:
        return "_No rows yet: the stages this table reads produced none in this run._"
    cells = frame.astype(object).where(frame.notna(), None)  # NaN (e.g. no correct kernel to average) -> "—"
    return tabulate(cells, headers="keys", tablefmt="github", showindex=False, floatfmt=".4g", missingval="—",
                    disable_numparse=preformatted)


def markdown(name: str, notes: list[str], body: str, paper: pd.DataFrame | None) -> str:
    first, *rest = notes or [name]
    title, _, lead = first.partition(": ")  # "Table 1 (paper §6.2): what it shows..." -> title, lead
    rest = [lead, *rest] if lead else rest
    parts = [f"# {title}", "", *[f"> {line}" if line else ">" for line in rest], "",
             f"Source: `workflow/sql/{name}.sql` over the run's `kpipe.duckdb` (beside `tables/`); every key and count is in "
             f"`{name}.csv`.", "", body]
    if paper is not None and not paper.empty:
        parts += ["", "Reference rows from the paper (source = paper):", "", markdown_frame(paper)]
    return "\n".join(parts) + "\n"


def checkpoint_notes(selections: Sequence[str | Path]) -> list[str]:
    """One line per checkpoint selection file (rule select_checkpoint): which RL iteration a `best_val` model
    is, and its validation score beside the last iteration's; rows of that model carry the iteration."""
    lines = []
    for path in selections:
        chosen = json.loads(Path(path).read_text())
        last = chosen["last_score"]
        lines.append(f"RL run {chosen['run']}: checkpoint of iteration {chosen['iteration']} (chosen by "
                     f"{chosen['choice']}: validation {chosen['metric']} at turn {chosen['turn']} = {chosen['score']:.1f}; "
                     f"the last iteration, {chosen['last_iteration']}, "
                     f"{'was not validated' if last is None else f'{last:.1f}'}).")
    return lines


def build_table(db_path: Path, sql_file: Path, out_dir: Path, n_boot: int = 1000, seed: int = 0,
                report_turn: str = "paper", own_models: Collection[str] = (),
                checkpoints: Sequence[str | Path] = ()) -> pd.DataFrame:
    """Run one table's SQL and write its .csv and .md; returns the CSV frame. `report_turn` and `own_models`
    (the pipeline's own models, the rest being baselines) choose the turn of the Fast@p rows (`turn_rule`);
    `checkpoints` (selection files) say which RL checkpoint a model chosen by validation is."""
    name = sql_file.stem
    notes = header_comment(sql_file.read_text())
    table = run_table_sql(db_path, sql_file)
    paper = None
    if name in FAST_TABLES:
        baseline, rows = FAST_TABLES[name]
        table = with_bootstrap_ci(table, fast_samples(db_path, baseline), n_boot, seed)
        paper_long = paper_fast_rows(rows, baseline)
        body = markdown_frame(fast_wide(table, paper_long, report_turn, own_models), preformatted=True)
        notes = notes + ["", f"Our rows: {REPORT_TURN_NOTES[report_turn]}, and (†) the best of turns 1..T; "
                         f"95% task-bootstrap intervals ({n_boot} replicates) in the CSV (`*_lo`, `*_hi`).",
                         "hacks = kpipe: any KernelGym check rejects; hacks = paper: only \"no Triton kernel "
                         "executed in training or evaluation mode\" does. A range (a–b) is open by the samples only "
                         "kpipe's checks rejected (its other hack checks, its extra correctness checks): the upper "
                         "bound counts each at its timed speedup, or as fast when never timed; `hacked`: samples hacked "
                         "by that definition at the reported turns (all levels).",
                         f"The paper's rows (source = paper): {REPORTING}",
                         *(["STTS rows (`<model>@top_w(w=4)`, Table 1's DR. KERNEL-14B-STTS): context management at its "
                            "last turn T (`stts.max_turns`; the paper does not state T), and (†) the best of turns 1..T."]
                           if baseline == "eager" else []),
                         *checkpoint_notes(checkpoints)]
        csv = pd.concat([table.assign(source="kpipe"), paper_long], ignore_index=True)
    else:
        paper = PAPER_ROWS[name]() if name in PAPER_ROWS else None
        if name in INTERVALS:
            table = with_intervals(db_path, name, table, n_boot, seed)
            notes = notes + ["", f"95% task-bootstrap intervals ({n_boot} replicates): `*_lo`, `*_hi`."]
        if name in CHECKPOINT_TABLES and checkpoints:
            notes = notes + ["", *checkpoint_notes(checkpoints)]
        body = markdown_frame(MARKDOWN_VIEWS.get(name, lambda frame: frame)(table))
        csv = pd.concat([table.assign(source="kpipe"), paper], ignore_index=True) if paper is not None else table
    out_dir.mkdir(parents=True, exist_ok=True)
    csv.to_csv(out_dir / f"{name}.csv", index=False)
    (out_dir / f"{name}.md").write_text(markdown(name, notes, body, paper))
    return csv


def build_tables(db_path: Path, out_dir: Path, sql_dir: Path = DEFAULT_SQL_DIR, n_boot: int = 1000,
                 seed: int = 0, report_turn: str = "paper", own_models: Collection[str] = (),
                 checkpoints: Sequence[str | Path] = ()) -> dict[str, Path]:
    """Every table of `sql_dir` into `out_dir`; returns name -> markdown path."""
    if not Path(db_path).exists():
        raise FileNotFoundError(f"no database at {db_path}: build it first (kpipe query --rebuild)")
    written = {}
    for sql_file in table_sql_files(sql_dir):
        build_table(Path(db_path), sql_file, Path(out_dir), n_boot, seed, report_turn, own_models, checkpoints)
        written[sql_file.stem] = Path(out_dir) / f"{sql_file.stem}.md"
    log.info("tables in %s: %s", out_dir, ", ".join(written))
    return written
