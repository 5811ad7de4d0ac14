"""Fast@p on a hand-made set of results: the SQL of the paper's tables against hand-computed
values and against kpipe.data.metrics, including hacked samples (incorrect), speedups exactly at a
threshold (counted: >= p), NaN speedups, and turns a trajectory never reached (incorrect)."""

import math

import pandas as pd
import pytest

from kpipe.data import metrics
from kpipe.data.io import write_table
from kpipe.data.db import build_db, connect
from kpipe.report.tables import DEFAULT_SQL_DIR, run_table_sql

NAN = float("nan")
TASKS = {"t1": 1, "t2": 1, "t3": 2}

# (model, task, sample, turn, status, correct, hacked, speedup_eager, speedup_compile)
EVAL_TURNS = [
    # level 1, model m: 2 tasks x 2 samples x up to 3 turns
    ("m", "t1", 0, 1, "pass", True, False, 0.9, 0.5),
    ("m", "t1", 0, 2, "pass", True, False, 1.2, 0.8),  # exactly at the 1.2 threshold
    ("m", "t1", 0, 3, "hacked", True, True, 5.0, 4.0),  # hacked: incorrect, however fast
    ("m", "t1", 1, 1, "mismatch", False, False, None, None),
    ("m", "t1", 1, 2, "pass", True, False, 2.0, 1.0),
    ("m", "t1", 1, 3, "pass", True, False, 1.1, 0.9),
    ("m", "t2", 0, 1, "pass", True, False, 1.5, 1.2),
    ("m", "t2", 0, 2, "format_error", False, False, None, None),  # the episode ended here: no turn 3
    ("m", "t2", 1, 1, "compilation_error", False, False, None, None),
    ("m", "t2", 1, 2, "pass", True, False, 1.19999, 0.7),
    ("m", "t2", 1, 3, "pass", True, False, 1.0, 0.5),  # exactly at the 1.0 threshold
    # level 2, model m
    ("m", "t3", 0, 1, "hacked", True, True, 3.0, 3.0),
    ("m", "t3", 0, 2, "pass", True, False, 3.0, 2.5),
    ("m", "t3", 0, 3, "pass", True, False, NAN, NAN),  # correct but untimed: never fast
    ("m", "t3", 1, 1, "runtime_error", False, False, None, None),
    ("m", "t3", 1, 2, "runtime_error", False, False, None, None),
    ("m", "t3", 1, 3, "runtime_error", False, False, None, None),
    # model single: one turn
    ("single", "t1", 0, 1, "pass", True, False, 1.3, 1.3),
    ("single", "t1", 1, 1, "hacked", False, True, 9.0, 9.0),
]

# Hand-computed Fast@1, @1.2, @1.5, @2 (percent) of model m, level 1, eager baseline.
EXPECTED_L1 = {
    ("last", 1): (25.0, 25.0, 25.0, 0.0),
    ("last", 2): (75.0, 50.0, 25.0, 25.0),
    ("last", 3): (50.0, 0.0, 0.0, 0.0),
    ("best", 1): (25.0, 25.0, 25.0, 0.0),
    ("best", 2): (100.0, 75.0, 50.0, 25.0),
    ("best", 3): (100.0, 75.0, 50.0, 25.0),
}


def eval_rows():
    return [{"run": "r", "stage": "eval", "iteration": 0, "model": model, "task_id": task, "sample": sample,
             "turn": turn, "status": status, "correct": correct, "hacked": hacked, "speedup_eager": eager,
             "speedup_compile": compiled, "reward": 0.0}
            for model, task, sample, turn, status, correct, hacked, eager, compiled in EVAL_TURNS]


def write_fixture(results, extra_trajectories=()):
    """Tasks, eval trajectories (and `extra_trajectories`) under `results`; returns the built database."""
    tasks = [{"task_id": task, "source": "kernelbench", "version": "main", "size_profile": "tiny", "split": "eval",
              "level": level, "problem_id": i, "name": task, "reference_src": "", "reference_hash": task}
             for i, (task, level) in enumerate(TASKS.items())]
    write_table(tasks, results / "tasks" / "tasks.parquet", "tasks")
    write_table(eval_rows(), results / "trajectories" / "stage=eval" / "run=r" / "part-0.parquet", "trajectories")
    if extra_trajectories:
        write_table(list(extra_trajectories), results / "trajectories" / "stage=other" / "part-0.parquet",
                    "trajectories")
    db = results / "kpipe.duckdb"
    build_db(results, db)
    return db


@pytest.fixture
def db(tmp_path):
    return write_fixture(tmp_path)


def table(db, name):
    return run_table_sql(db, DEFAULT_SQL_DIR / f"{name}.sql")


def test_table1_matches_hand_computed_fast_p(db):
    t1 = table(db, "table1_fastp_eager")
    level1 = t1[(t1["model"] == "m") & (t1["level"] == 1)]
    assert set(level1["n_samples"]) == {4}  # every trajectory, also at turn 3 where one never arrived
    for (history, turn), expected in EXPECTED_L1.items():
        row = level1[(level1["history"] == history) & (level1["turn"] == turn)].iloc[0]
        assert tuple(row[["fast_1", "fast_1_2", "fast_1_5", "fast_2"]]) == pytest.approx(expected), (history, turn)
        assert row["n_fast_1"] == expected[0] / 25  # counts are there to trace the percentage
    level2 = t1[(t1["model"] == "m") & (t1["level"] == 2)].set_index(["history", "turn"])
    assert level2.loc[("last", 1), "fast_1"] == 0.0  # hacked at 3x
    assert level2.loc[("last", 3), "fast_1"] == 0.0  # NaN speedup
    assert level2.loc[("best", 3), "fast_2"] == 50.0
    single = t1[t1["model"] == "single"]
    assert list(single["turn"].unique()) == [1] and set(single["fast_1"]) == {50.0}


def test_threshold_convention_is_at_least_p_and_differs_from_kernelbench_strict(db):
    rows = pd.DataFrame(eval_rows())
    group = rows[(rows["model"] == "m") & rows["task_id"].isin(["t1", "t2"])]
    ours = metrics.fast_p_by_turn(group, [1.0, 1.2])
    strict = metrics.fast_p_by_turn(group, [1.0, 1.2], strict=True)
    assert ours.set_index("turn").loc[3, "fast@1"] == 0.5 and strict.set_index("turn").loc[3, "fast@1"] == 0.25
    assert ours.set_index("turn").loc[2, "fast@1.2"] == 0.5 and strict.set_index("turn").loc[2, "fast@1.2"] == 0.25
    sql = open(DEFAULT_SQL_DIR / "table1_fastp_eager.sql").read()
    assert "speedup >= p" in sql and "hacked counts" in sql  # the table states its convention


@pytest.mark.parametrize("name,column", [("table1_fastp_eager", "speedup_eager"),
                                         ("table2_fastp_compile", "speedup_compile")])
def test_sql_fast_p_equals_kpipe_metrics(db, name, column):
    t = table(db, name)
    rows = pd.DataFrame(eval_rows()).assign(level=lambda f: f["task_id"].map(TASKS))
    checked = 0
    for (model, level), group in rows.groupby(["model", "level"]):
        horizon = rows.loc[rows["model"] == model, "turn"].max()  # the denominator grid is per model
        for history in (False, True):
            expected = metrics.fast_p_by_turn(group, metrics.FAST_P_THRESHOLDS, column, history=history)
            expected = expected.set_index("turn").reindex(range(1, horizon + 1))
            got = t[(t["model"] == model) & (t["level"] == level) & (t["history"] == ("best" if history else "last"))]
            for _, row in got.iterrows():
                for p, col in zip(metrics.FAST_P_THRESHOLDS, ["fast_1", "fast_1_2", "fast_1_5", "fast_2"]):
                    want = expected.loc[row["turn"], f"fast@{p:g}"]
                    want = 0.0 if math.isnan(want) else 100 * want
                    assert row[col] == pytest.approx(want), (model, level, history, row["turn"], p)
                    checked += 1
    assert checked == 4 * 2 * (3 + 3 + 1)


def test_rows_behind_a_cell_are_listed_by_the_view(db):
    with connect(db) as con:
        rows = con.sql("select task_id, sample, source_turn from fastp_samples where stage = 'eval' and model = 'm' "
                       "and level = 1 and baseline = 'eager' and history = 'best' and turn = 3 and fast_1_2 "
                       "order by task_id, sample").fetchall()
    # the hacked 5x kernel of (t1, 0) at turn 3 is not its best: turn 2 (1.2x) is
    assert rows == [("t1", 0, 2), ("t1", 1, 2), ("t2", 0, 1)]


def test_hacking_ratio_per_level_and_rl_iteration(tmp_path):
    rl = [{"run": "r", "stage": "rl", "iteration": it, "model": "policy", "task_id": "t3", "sample": s, "turn": 1,
           "hacked": s < hacked} for it, hacked in ((0, 2), (1, 1)) for s in range(4)]
    db = write_fixture(tmp_path, rl)
    ratio = table(db, "hacking_ratio").set_index(["stage", "model", "level", "iteration"])
    assert ratio.loc[("eval", "m", 1, 0), ["n_samples", "n_hacked"]].tolist() == [11, 1]
    assert ratio.loc[("eval", "m", 2, 0), "hacking_ratio"] == pytest.approx(100 / 6)
    assert ratio.loc[("rl", "policy", 2, 0), "hacking_ratio"] == 50.0
    assert ratio.loc[("rl", "policy", 2, 1), "hacking_ratio"] == 25.0


def test_kevin_best_and_avg_at_k_equal_kpipe_metrics(db):
    kevin = table(db, "kevin_metrics").set_index(["model", "level", "baseline"])
    rows = pd.DataFrame(eval_rows()).assign(level=lambda f: f["task_id"].map(TASKS))
    for (model, level), group in rows.groupby(["model", "level"]):
        for baseline in ("eager", "compile"):
            got = kevin.loc[(model, level, baseline)]
            column = f"speedup_{baseline}"
            k = int(got["k"])
            assert k == got["k_max"] == 2
            for metric, p, name in (("correct", None, "correct"), ("fast", 1.2, "fast_1_2"),
                                    ("speedup", None, "speedup")):
                scale = 1 if metric == "speedup" else 100
                best = metrics.best_at_k(group, k, metric, p, column)
                mean = metrics.avg_at_k(group, k, metric, p, column)
                assert got[f"best_at_k_{name}"] == pytest.approx(scale * best), (model, level, baseline, metric)
                assert got[f"avg_at_k_{name}"] == pytest.approx(scale * mean), (model, level, baseline, metric)
    # by hand: level 1 tasks t1 (trajectories correct, best 2.0x) and t2 (both correct, best 1.5x)
    assert kevin.loc[("m", 1, "eager"), "best_at_k_speedup"] == pytest.approx((2.0 + 1.5) / 2)


def test_documented_trace_query_reaches_the_trajectory_rows(db):
    """docs/evaluation.md: from a Table 1 cell to the turns (and eval keys) that made it."""
    sql = """select t.task_id, t.sample, t.turn, t.status, t.speedup_eager
      from fastp_samples f join trajectories t
        on t.run = f.run and t.stage = f.stage and t.model = f.model and t.task_id = f.task_id
       and t.sample = f.sample and t.turn = f.source_turn
      where f.stage = 'eval' and f.baseline = 'eager' and f.run = 'r' and f.model = 'm'
        and f.level = 1 and f.turn = 3 and f.history = 'best' and f.fast_1_2 order by 1, 2"""
    with connect(db) as con:
        rows = con.sql(sql).fetchall()
    cell = table(db, "table1_fastp_eager").query("model == 'm' and level == 1 and turn == 3 and history == 'best'")
    assert len(rows) == cell["n_fast_1_2"].item() == 3
    assert rows == [("t1", 0, 2, "pass", 1.2), ("t1", 1, 2, "pass", 2.0), ("t2", 0, 1, "pass", 1.5)]
