"""Kevin's test-time budget table (workflow/sql/kevin_budget.sql) on a hand-made budget of 4 kernels
per task split as 4×1, 2×2 and 1×4: best@k of correctness and speedup per split and k, against
hand-computed values and against kpipe.data.metrics.best_at_k; the markdown's paper rows."""

import pandas as pd
import pytest
from test_fastp_definition import write_fixture

from kpipe.data import metrics
from kpipe.report.tables import DEFAULT_SQL_DIR, build_table, run_table_sql

NAN = float("nan")

# (split, task, sample, turn, correct, hacked, speedup_eager); tasks t1, t2 are level 1
BUDGET_TURNS = [
    ("4x1", "t1", 0, 1, True, False, 1.5),
    ("4x1", "t1", 1, 1, False, False, None),
    ("4x1", "t1", 2, 1, True, True, 3.0),  # hacked: incorrect
    ("4x1", "t1", 3, 1, True, False, 0.5),
    ("4x1", "t2", 0, 1, False, False, None),
    ("4x1", "t2", 1, 1, True, False, NAN),  # correct but untimed: speedup 0
    ("4x1", "t2", 2, 1, False, False, None),
    ("4x1", "t2", 3, 1, True, False, 2.0),
    ("2x2", "t1", 0, 1, False, False, None),
    ("2x2", "t1", 0, 2, True, False, 1.2),
    ("2x2", "t1", 1, 1, True, False, 0.8),
    ("2x2", "t1", 1, 2, True, True, 4.0),  # hacked: the trajectory keeps turn 1's 0.8
    ("2x2", "t2", 0, 1, False, False, None),
    ("2x2", "t2", 0, 2, False, False, None),
    ("2x2", "t2", 1, 1, True, False, 1.1),  # the episode ended after turn 1
    ("1x4", "t1", 0, 1, False, False, None),
    ("1x4", "t1", 0, 2, False, False, None),
    ("1x4", "t1", 0, 3, True, False, 1.3),
    ("1x4", "t1", 0, 4, True, False, 2.5),
    *[("1x4", "t2", 0, turn, False, False, None) for turn in range(1, 5)],
]

# (trajectories, turns, k) -> (best@k correct %, best@k speedup), by hand:
# 4x1: t1 correct [0,0,1,1] speedups [0,0,.5,1.5]; t2 correct [0,0,1,1] speedups [0,0,0,2].
#   best@2 weights C(i-1,1)/C(4,2) = (i-1)/6 on the sorted values: of [0,0,1,1] 5/6 (= 1 - C(2,2)/C(4,2));
#   of the speedups (2·.5 + 3·1.5)/6 and 3·2/6.
#   best@3 weights C(i-1,2)/4 on the sorted values: 1/4 on the 3rd, 3/4 on the 4th.
# 2x2: t1 trajectories (1, 1.2), (1, 0.8); t2 (0, 0), (1, 1.1).
# 1x4: t1 (1, 2.5); t2 (0, 0).
EXPECTED = {
    (4, 1, 1): (50.0, (0.5 + 0.5) / 2),
    (4, 1, 2): (100 * 5 / 6, ((2 * 0.5 + 3 * 1.5) / 6 + 3 * 2 / 6) / 2),
    (4, 1, 3): (100.0, ((0.5 + 3 * 1.5) / 4 + 3 * 2 / 4) / 2),
    (4, 1, 4): (100.0, (1.5 + 2.0) / 2),
    (2, 2, 1): (75.0, (1.0 + 0.55) / 2),
    (2, 2, 2): (100.0, (1.2 + 1.1) / 2),
    (1, 4, 1): (50.0, 1.25),
}


def budget_rows():
    return [{"run": "r", "stage": "budget", "iteration": 0, "model": f"m@{split}", "task_id": task, "sample": sample,
             "turn": turn, "status": "pass" if correct else "mismatch", "correct": correct, "hacked": hacked,
             "speedup_eager": speedup, "speedup_compile": speedup, "reward": 0.0}
            for split, task, sample, turn, correct, hacked, speedup in BUDGET_TURNS]


@pytest.fixture
def db(tmp_path):
    return write_fixture(tmp_path, budget_rows())


def test_best_at_k_per_split_matches_hand_computed(db):
    table = run_table_sql(db, DEFAULT_SQL_DIR / "kevin_budget.sql")
    assert set(table["model"]) == {"m"} and set(table["budget"]) == {4} and set(table["n_tasks"]) == {2}
    got = {(row.trajectories, row.turns, row.k): (row.best_at_k_correct, row.best_at_k_speedup)
           for row in table.itertuples()}
    assert got.keys() == EXPECTED.keys()
    for key, expected in EXPECTED.items():
        assert got[key] == pytest.approx(expected), key
    full = table[table["full_budget"]]
    assert sorted(zip(full["trajectories"], full["turns"], full["kernels"])) == [(1, 4, 4), (2, 2, 4), (4, 1, 4)]


def test_sql_agrees_with_kpipe_metrics(db):
    table = run_table_sql(db, DEFAULT_SQL_DIR / "kevin_budget.sql")
    frame = pd.DataFrame(budget_rows())
    for row in table.itertuples():
        split = frame[frame["model"] == f"m@{row.trajectories}x{row.turns}"]
        assert row.best_at_k_correct == pytest.approx(100 * metrics.best_at_k(split, row.k, "correct"))
        assert row.best_at_k_speedup == pytest.approx(metrics.best_at_k(split, row.k, "speedup"))


def test_markdown_shows_whole_budgets_and_kevins_rows(db, tmp_path):
    csv = build_table(db, DEFAULT_SQL_DIR / "kevin_budget.sql", tmp_path / "tables")
    assert set(csv["source"]) == {"kpipe", "paper"}
    paper = csv[csv["source"] == "paper"]
    assert len(paper) == 9 and set(paper["budget"]) == {128}
    assert paper.loc[(paper["trajectories"] == 16) & paper["model"].str.startswith("Multi-Turn"),
                     "best_at_k_speedup"].item() == 1.10
    text = (tmp_path / "tables" / "kevin_budget.md").read_text()
    assert text.startswith("# Kevin's test-time budget")
    ours = [line for line in text.splitlines() if line.startswith("| r ")]
    assert len(ours) == 3  # one row per split at its whole budget, not every k
