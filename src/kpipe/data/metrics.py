"""Evaluation metrics of kernel generation: Fast@p, best-of-history, Kevin's best@k / avg@k,
hacking, compile and correctness rates, geometric-mean speedup, bootstrap intervals.

Conventions (stated once, used everywhere):
- A hacked sample is incorrect, whatever its correctness check said (paper, Table 1).
- Fast@p counts a sample iff it is correct and speedup >= p (the paper's convention);
  ``strict=True`` gives KernelBench's own ``fastp`` (speedup > p).
- A frame is trajectories-shaped: one row per (task_id, sample, turn) with ``correct``,
  ``hacked`` and a speedup column (``speedup_eager`` or ``speedup_compile``). The
  denominator of a per-turn rate is every (task_id, sample) trajectory in the frame: a
  trajectory that never reached turn t counts as incorrect at t.

numpy/pandas only: nothing here imports torch, so ``kpipe query`` and the table scripts
stay light.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa

FAST_P_THRESHOLDS = (1.0, 1.2, 1.5, 2.0)  # paper Tables 1 and 2
NOT_COMPILED = frozenset({"format_error", "compilation_error"})  # no runnable candidate came out
TRAJECTORY_KEYS = ["task_id", "sample"]

ArrayLike = Sequence | np.ndarray | pd.Series


def _bools(values: ArrayLike | None, n: int) -> np.ndarray:
    """A bool array where missing values (None / NA) are False."""
    if values is None:
        return np.zeros(n, dtype=bool)
    return np.array([False if pd.isna(value) else bool(value) for value in values], dtype=bool)


def _floats(values: ArrayLike) -> np.ndarray:
    """A float array where missing values (None / NA) are NaN."""
    return pd.to_numeric(pd.Series(values, dtype="object"), errors="raise").to_numpy(dtype=float)


def _nonempty(n: int, what: str) -> None:
    if n == 0:
        raise ValueError(f"{what} of no samples is undefined")


def effective_correct(correct: ArrayLike, hacked: ArrayLike | None = None) -> np.ndarray:
    """Correct and not hacked, per sample (missing values count as False)."""
    correct = _bools(correct, len(correct))
    return correct & ~_bools(hacked, len(correct))


def is_fast(
    correct: ArrayLike, speedup: ArrayLike, p: float, hacked: ArrayLike | None = None, strict: bool = False
) -> np.ndarray:
    """Per sample: correct (not hacked) and speedup >= p (> p with `strict`). NaN speedup is never fast."""
    speedup = _floats(speedup)
    ok = effective_correct(correct, hacked)
    if len(speedup) != len(ok):
        raise ValueError(f"{len(ok)} correctness flags but {len(speedup)} speedups")
    with np.errstate(invalid="ignore"):
        fast = speedup > p if strict else speedup >= p
    return ok & fast


def fast_p(
    correct: ArrayLike, speedup: ArrayLike, p: float, hacked: ArrayLike | None = None, strict: bool = False
) -> float:
    """Fast@p: the fraction of samples that are correct (hacked = incorrect) with speedup >= p."""
    fast = is_fast(correct, speedup, p, hacked, strict)
    _nonempty(len(fast), "Fast@p")
    return float(fast.mean())


def correct_rate(correct: ArrayLike, hacked: ArrayLike | None = None) -> float:
    """Fraction of samples correct and not hacked."""
    ok = effective_correct(correct, hacked)
    _nonempty(len(ok), "the correctness rate")
    return float(ok.mean())


def hacking_ratio(hacked: ArrayLike) -> float:
    """The hacking ratio (Appendix C, Figure 8): hacked turns / every generated turn (one per turn row, whatever
    its status: a format error or a failed generation is in the denominator). kpipe's one definition: the RL
    rollout metric, `kpipe metrics` and every table's `hacking_ratio` (workflow/sql) compute it so
    (tests/test_hacking_ratio.py)."""
    flags = _bools(hacked, len(hacked))
    _nonempty(len(flags), "the hacking ratio")
    return float(flags.mean())


def compile_rate(status: ArrayLike) -> float:
    """Fraction of samples whose candidate was extracted and compiled (status not in NOT_COMPILED)."""
    statuses = pd.Series(status, dtype="object")
    _nonempty(len(statuses), "the compile rate")
    if statuses.isna().any():
        raise ValueError("compile rate: some samples have no status")
    return float((~statuses.isin(NOT_COMPILED)).mean())


def geomean_speedup(
    correct: ArrayLike,
    speedup: ArrayLike,
    hacked: ArrayLike | None = None,
    incorrect: Literal["exclude", "as_one"] = "exclude",
) -> float:
    """Geometric-mean speedup.

    ``incorrect="exclude"``: over correct samples only (NaN when there are none) — how fast
    the kernels that work are. ``"as_one"``: incorrect samples count as speedup 1, i.e. the
    user falls back to the reference — the expected gain of deploying the model's output.
    """
    speedup = _floats(speedup)
    ok = effective_correct(correct, hacked)
    _nonempty(len(ok), "the geometric-mean speedup")
    if incorrect == "exclude":
        values = speedup[ok]
    elif incorrect == "as_one":
        values = np.where(ok, speedup, 1.0)
    else:
        raise ValueError(f"incorrect must be 'exclude' or 'as_one', got {incorrect!r}")
    if len(values) == 0:
        return math.nan
    if not (np.isfinite(values) & (values > 0)).all():
        raise ValueError("geometric mean needs finite, positive speedups for every correct sample")
    return float(np.exp(np.log(values).mean()))


# ---------------------------------------------------------------------------------------
# Trajectory frames: per turn, best of history, Kevin's trajectory metrics
# ---------------------------------------------------------------------------------------


def _as_frame(frame: pd.DataFrame | pa.Table) -> pd.DataFrame:
    return frame.to_pandas() if isinstance(frame, pa.Table) else frame


def _turn_grids(
    frame: pd.DataFrame | pa.Table, speedup_col: str, by: Sequence[str]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Dense [trajectory x turn] grids: effective correctness (False where a turn is missing)
    and the speedup of correct turns (NaN elsewhere)."""
    frame = _as_frame(frame)
    needed = [*by, *TRAJECTORY_KEYS, "turn", "correct", "hacked", speedup_col]
    missing = [column for column in needed if column not in frame.columns]
    if missing:
        raise ValueError(f"trajectory frame lacks column(s) {missing}")
    _nonempty(len(frame), "a trajectory metric")
    keys = [*by, *TRAJECTORY_KEYS]
    if frame.duplicated([*keys, "turn"]).any():
        raise ValueError("trajectory frame has two rows for the same (task_id, sample, turn)")
    ok = effective_correct(frame["correct"], frame["hacked"])
    rows = frame[keys + ["turn"]].assign(ok=ok.astype(float), speed=np.where(ok, _floats(frame[speedup_col]), np.nan))
    correct = rows.pivot(index=keys, columns="turn", values="ok").fillna(0.0).astype(bool)
    speed = rows.pivot(index=keys, columns="turn", values="speed")
    turns = range(1, int(rows["turn"].max()) + 1)
    return correct.reindex(columns=turns, fill_value=False), speed.reindex(columns=turns)


def _best_so_far(correct: pd.DataFrame, speed: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Over turns <= t: any correct, and the best correct speedup (NaN while none)."""
    best = speed.fillna(-np.inf).cummax(axis=1).replace(-np.inf, np.nan)
    return correct.cummax(axis=1), best


def _long(correct: pd.DataFrame, speed: pd.DataFrame) -> pd.DataFrame:
    # correct has no NaN, so the left join keeps every (trajectory, turn) whatever stack() drops
    out = correct.stack().rename("correct").to_frame().join(speed.stack().rename("speedup"))
    return out.reset_index()


def per_turn(frame: pd.DataFrame | pa.Table, speedup_col: str = "speedup_eager", by: Sequence[str] = ()) -> pd.DataFrame:
    """One row per (trajectory, turn 1..T): correct (hacked folded in; missing turn = False) and
    the speedup of that turn's kernel where correct."""
    return _long(*_turn_grids(frame, speedup_col, by))


def best_of_history(
    frame: pd.DataFrame | pa.Table, speedup_col: str = "speedup_eager", by: Sequence[str] = ()
) -> pd.DataFrame:
    """Per (trajectory, turn t): whether any turn <= t was correct, and the best correct speedup
    among them (the paper's † rows and Figure 6 right)."""
    return _long(*_best_so_far(*_turn_grids(frame, speedup_col, by)))


def fast_p_by_turn(
    frame: pd.DataFrame | pa.Table,
    ps: Sequence[float] = FAST_P_THRESHOLDS,
    speedup_col: str = "speedup_eager",
    history: bool = False,
    strict: bool = False,
    by: Sequence[str] = (),
) -> pd.DataFrame:
    """Fast@p per turn (columns ``fast@<p>``, one row per `by` x turn); with `history`, the
    best-of-history Fast@p at each turn."""
    rows = (best_of_history if history else per_turn)(frame, speedup_col, by)
    table = pd.DataFrame({"n": rows.groupby([*by, "turn"]).size()})
    for p in ps:
        fast = pd.Series(is_fast(rows["correct"], rows["speedup"], p, strict=strict), index=rows.index)
        table[f"fast@{p:g}"] = fast.groupby([rows[c] for c in [*by, "turn"]]).mean()
    return table.reset_index()


def trajectory_summary(
    frame: pd.DataFrame | pa.Table, speedup_col: str = "speedup_eager", by: Sequence[str] = ()
) -> pd.DataFrame:
    """Kevin's view of a trajectory: correct if any turn is; its performance is its fastest
    correct kernel's speedup (0 if none is correct)."""
    correct, speed = _turn_grids(frame, speedup_col, by)
    summary = pd.DataFrame({"correct": correct.any(axis=1), "speedup": speed.max(axis=1).fillna(0.0)})
    return summary.reset_index()


def expected_best_of_k(values: ArrayLike, k: int) -> float:
    """E[max] of k values drawn without replacement from `values` (exact, over all k-subsets):
    sum_i C(i-1, k-1) / C(n, k) · v_(i) for the ascending order statistics v_(i)."""
    ordered = np.sort(_floats(values))
    n = len(ordered)
    if not 1 <= k <= n:
        raise ValueError(f"best@k needs 1 <= k <= {n} trajectories per task, got k={k}")
    weights = np.array([math.comb(i - 1, k - 1) for i in range(1, n + 1)], dtype=float) / math.comb(n, k)
    return float(weights @ ordered)


def _kevin_metric(frame, metric: str, p: float | None, speedup_col: str, strict: bool) -> pd.DataFrame:
    summary = trajectory_summary(frame, speedup_col)
    if metric == "correct":
        summary["value"] = summary["correct"].astype(float)
    elif metric == "speedup":
        summary["value"] = summary["speedup"]
    elif metric == "fast":
        if p is None:
            raise ValueError("metric 'fast' needs a threshold p")
        summary["value"] = is_fast(summary["correct"], summary["speedup"], p, strict=strict).astype(float)
    else:
        raise ValueError(f"unknown metric {metric!r}; known: correct, speedup, fast")
    return summary


def best_at_k(
    frame: pd.DataFrame | pa.Table,
    k: int,
    metric: Literal["correct", "speedup", "fast"] = "correct",
    p: float | None = None,
    speedup_col: str = "speedup_eager",
    strict: bool = False,
) -> float:
    """Kevin's best@k averaged over tasks: per task, the best metric among k parallel
    trajectories, in expectation over which k of the task's n trajectories are taken."""
    summary = _kevin_metric(frame, metric, p, speedup_col, strict)
    per_task = summary.groupby("task_id")["value"].apply(lambda values: expected_best_of_k(values, k))
    return float(per_task.mean())


def avg_at_k(
    frame: pd.DataFrame | pa.Table,
    k: int,
    metric: Literal["correct", "speedup", "fast"] = "correct",
    p: float | None = None,
    speedup_col: str = "speedup_eager",
    strict: bool = False,
) -> float:
    """Kevin's avg@k averaged over tasks: the mean metric over a task's trajectories (the
    expectation of the mean of any k of them, so k only has to be available)."""
    summary = _kevin_metric(frame, metric, p, speedup_col, strict)
    counts = summary.groupby("task_id").size()
    if (counts < k).any():
        raise ValueError(f"avg@k needs k={k} trajectories per task; some task has {int(counts.min())}")
    return float(summary.groupby("task_id")["value"].mean().mean())


# ---------------------------------------------------------------------------------------
# Uncertainty
# ---------------------------------------------------------------------------------------


class BootstrapCI(NamedTuple):
    estimate: float
    low: float
    high: float


def bootstrap_ci(
    values: ArrayLike,
    stat: Callable[[np.ndarray], float] = np.mean,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
    groups: ArrayLike | None = None,
) -> BootstrapCI:
    """Percentile bootstrap interval of `stat` at level 1 - alpha.

    With `groups` (e.g. the task id of each sample), whole groups are resampled: the 8
    samples of one task are correlated, and the question a benchmark answers is about new
    tasks, so resampling samples would understate the uncertainty.
    """
    values = _floats(values)
    _nonempty(len(values), "a bootstrap interval")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    rng = np.random.default_rng(seed)
    if groups is None:
        members = [np.array([i]) for i in range(len(values))]
    else:
        if len(groups) != len(values):
            raise ValueError(f"{len(values)} values but {len(groups)} group labels")
        codes, uniques = pd.factorize(pd.Series(groups, dtype="object"))
        members = [np.flatnonzero(codes == g) for g in range(len(uniques))]
    replicates = np.empty(n_boot)
    for b in range(n_boot):
        chosen = rng.integers(0, len(members), len(members))
        replicates[b] = stat(values[np.concatenate([members[g] for g in chosen])])
    low, high = np.quantile(replicates, [alpha / 2, 1 - alpha / 2])
    return BootstrapCI(float(stat(values)), float(low), float(high))


def fast_p_ci(
    frame: pd.DataFrame | pa.Table,
    p: float,
    turn: int,
    speedup_col: str = "speedup_eager",
    history: bool = False,
    strict: bool = False,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> BootstrapCI:
    """Fast@p at one turn with a task-resampling bootstrap interval."""
    rows = (best_of_history if history else per_turn)(frame, speedup_col)
    rows = rows[rows["turn"] == turn]
    if rows.empty:
        raise ValueError(f"no trajectory has turn {turn}")
    fast = is_fast(rows["correct"], rows["speedup"], p, strict=strict).astype(float)
    return bootstrap_ci(fast, np.mean, n_boot, alpha, seed, groups=rows["task_id"].to_numpy())
