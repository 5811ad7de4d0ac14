"""Metrics on hand-made result sets whose answers were worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from kpipe.data import metrics

NAN = float("nan")

# Two tasks, two samples each, up to three turns. T2/s1 stopped after turn 1.
# T1/s1 turn 2 passed the checks but was flagged hacked: it is incorrect.
ROWS = [
    # task, level, sample, turn, correct, hacked, speedup
    ("T1", 1, 0, 1, True, False, 0.9),
    ("T1", 1, 0, 2, True, False, 1.2),
    ("T1", 1, 0, 3, False, False, NAN),
    ("T1", 1, 1, 1, False, False, NAN),
    ("T1", 1, 1, 2, True, True, 5.0),
    ("T1", 1, 1, 3, True, False, 1.0),
    ("T2", 2, 0, 1, True, False, 2.0),
    ("T2", 2, 0, 2, True, False, 1.5),
    ("T2", 2, 0, 3, True, False, 1.19),
    ("T2", 2, 1, 1, False, None, NAN),
]
FRAME = pd.DataFrame(ROWS, columns=["task_id", "level", "sample", "turn", "correct", "hacked", "speedup_eager"])


def test_fast_p_counts_hacked_as_incorrect_and_uses_ge():
    correct = [True, True, True, False]
    hacked = [False, True, False, False]
    speedup = [1.2, 3.0, 1.0, 5.0]
    assert metrics.fast_p(correct, speedup, 1.2, hacked) == 0.25  # 1.2 >= 1.2 counts; hacked 3.0 does not
    assert metrics.fast_p(correct, speedup, 1.2, hacked, strict=True) == 0.0  # KernelBench's >
    assert metrics.fast_p(correct, speedup, 1.0, hacked) == 0.5
    assert metrics.fast_p(correct, speedup, 1.0, hacked, strict=True) == 0.25
    assert metrics.fast_p(correct, speedup, 1.0) == 0.75  # without the hacking flags
    assert metrics.fast_p([True, None], [None, 2.0], 1.0) == 0.0  # missing values never count
    with pytest.raises(ValueError, match="no samples"):
        metrics.fast_p([], [], 1.0)


def test_fast_p_by_turn_last_turn():
    table = metrics.fast_p_by_turn(FRAME).set_index("turn")
    assert table["n"].tolist() == [4, 4, 4]  # T2/s1's missing turns count, as incorrect
    assert table.loc[1, ["fast@1", "fast@1.2", "fast@1.5", "fast@2"]].tolist() == [0.25, 0.25, 0.25, 0.25]
    assert table.loc[2, ["fast@1", "fast@1.2", "fast@1.5", "fast@2"]].tolist() == [0.5, 0.5, 0.25, 0.0]
    assert table.loc[3, ["fast@1", "fast@1.2", "fast@1.5", "fast@2"]].tolist() == [0.5, 0.0, 0.0, 0.0]
    strict = metrics.fast_p_by_turn(FRAME, strict=True).set_index("turn")
    assert strict.loc[1, "fast@2"] == 0.0  # exactly 2.0 is not > 2
    assert strict.loc[2, "fast@1.2"] == 0.25  # exactly 1.2 is not > 1.2
    assert strict.loc[3, "fast@1"] == 0.25  # exactly 1.0 is not > 1


def test_fast_p_best_of_history():
    table = metrics.fast_p_by_turn(FRAME, history=True).set_index("turn")
    assert table.loc[1, ["fast@1", "fast@1.2", "fast@1.5", "fast@2"]].tolist() == [0.25, 0.25, 0.25, 0.25]
    assert table.loc[2, ["fast@1", "fast@1.2", "fast@1.5", "fast@2"]].tolist() == [0.5, 0.5, 0.25, 0.25]
    assert table.loc[3, ["fast@1", "fast@1.2", "fast@1.5", "fast@2"]].tolist() == [0.75, 0.5, 0.25, 0.25]
    best = metrics.best_of_history(FRAME).set_index(["task_id", "sample", "turn"])
    assert best.loc[("T1", 0, 3), "speedup"] == 1.2  # carried over the failed turn 3
    assert best.loc[("T1", 1, 3), "speedup"] == 1.0  # the hacked 5.0 never counts
    assert math.isnan(best.loc[("T1", 1, 2), "speedup"]) and not best.loc[("T1", 1, 2), "correct"]
    assert best.loc[("T2", 0, 3), "speedup"] == 2.0


def test_fast_p_by_level_and_from_arrow():
    table = metrics.fast_p_by_turn(FRAME, ps=[1.0], by=["level"]).set_index(["level", "turn"])
    assert table.loc[(1, 1), "fast@1"] == 0.0 and table.loc[(2, 1), "fast@1"] == 0.5
    assert table.loc[(1, 3), "n"] == 2
    arrow = pa.Table.from_pandas(FRAME)
    assert metrics.fast_p_by_turn(arrow).equals(metrics.fast_p_by_turn(FRAME))


def test_frame_checks():
    with pytest.raises(ValueError, match="lacks column"):
        metrics.fast_p_by_turn(FRAME.drop(columns="hacked"))
    with pytest.raises(ValueError, match="two rows"):
        metrics.fast_p_by_turn(pd.concat([FRAME, FRAME.iloc[:1]]))


def test_rates():
    assert metrics.hacking_ratio(FRAME["hacked"]) == 0.1
    assert metrics.correct_rate(FRAME["correct"], FRAME["hacked"]) == 0.6  # 7 of 10 rows correct, 1 of them hacked
    statuses = ["pass", "compilation_error", "mismatch", "format_error", "runtime_error", "hacked", "timeout", "pass"]
    assert metrics.compile_rate(statuses) == 0.75
    with pytest.raises(ValueError, match="no status"):
        metrics.compile_rate(["pass", None])


def test_geomean_speedup():
    correct = [True, True, True, False, True]
    hacked = [False, False, False, False, True]
    speedup = [2.0, 0.5, 4.0, NAN, 100.0]
    assert metrics.geomean_speedup(correct, speedup, hacked) == pytest.approx(4 ** (1 / 3))
    assert metrics.geomean_speedup(correct, speedup, hacked, incorrect="as_one") == pytest.approx(4 ** (1 / 5))
    assert math.isnan(metrics.geomean_speedup([False], [NAN]))
    with pytest.raises(ValueError, match="positive"):
        metrics.geomean_speedup([True], [0.0])


def test_kevin_trajectory_metrics():
    summary = metrics.trajectory_summary(FRAME).set_index(["task_id", "sample"])
    assert summary["correct"].tolist() == [True, True, True, False]
    assert summary["speedup"].tolist() == [1.2, 1.0, 2.0, 0.0]  # fastest correct kernel, 0 if none
    assert metrics.best_at_k(FRAME, 2, "correct") == 1.0
    assert metrics.avg_at_k(FRAME, 2, "correct") == 0.75
    assert metrics.best_at_k(FRAME, 2, "speedup") == pytest.approx((1.2 + 2.0) / 2)
    assert metrics.avg_at_k(FRAME, 2, "speedup") == pytest.approx((1.1 + 1.0) / 2)
    assert metrics.best_at_k(FRAME, 1, "speedup") == pytest.approx(1.05)  # best of one = average
    assert metrics.best_at_k(FRAME, 2, "fast", p=1.2) == 1.0
    assert metrics.avg_at_k(FRAME, 2, "fast", p=1.2) == 0.5
    with pytest.raises(ValueError, match="k=3"):
        metrics.best_at_k(FRAME, 3)
    with pytest.raises(ValueError, match="needs a threshold"):
        metrics.best_at_k(FRAME, 1, "fast")


def test_expected_best_of_k_over_subsets():
    # subsets of two from {0, 1, 3}: max 1, 3, 3
    assert metrics.expected_best_of_k([3.0, 0.0, 1.0], 2) == pytest.approx(7 / 3)
    assert metrics.expected_best_of_k([3.0, 0.0, 1.0], 3) == 3.0
    assert metrics.expected_best_of_k([1.0, 0.0, 0.0, 0.0], 2) == pytest.approx(0.5)  # pass@2 of 1 in 4


def test_bootstrap_resamples_tasks_not_samples():
    values = [1.0] * 4 + [0.0] * 4
    tasks = ["A"] * 4 + ["B"] * 4
    # resampling two tasks: means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4
    grouped = metrics.bootstrap_ci(values, groups=tasks, n_boot=2000, seed=1)
    assert grouped == (0.5, 0.0, 1.0)
    ungrouped = metrics.bootstrap_ci(values, n_boot=2000, seed=1)
    assert 0.0 < ungrouped.low < 0.5 < ungrouped.high < 1.0  # treats 8 correlated samples as independent
    assert metrics.bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    assert metrics.bootstrap_ci(values, seed=3) == metrics.bootstrap_ci(values, seed=3)
    assert metrics.bootstrap_ci([1.0, 5.0, 3.0], stat=np.median, n_boot=200).estimate == 3.0
    with pytest.raises(ValueError, match="group labels"):
        metrics.bootstrap_ci(values, groups=tasks[:-1])


def test_fast_p_ci_at_a_turn():
    ci = metrics.fast_p_ci(FRAME, 1.0, turn=3, history=True, n_boot=500)
    assert ci.estimate == 0.75
    assert 0.5 <= ci.low <= ci.estimate <= ci.high <= 1.0  # task T1 contributes 1.0, task T2 0.5
    with pytest.raises(ValueError, match="turn 4"):
        metrics.fast_p_ci(FRAME, 1.0, turn=4)


def test_cli_summary(tmp_path):
    from click.testing import CliRunner

    from kpipe.cli import main
    from kpipe.data.io import write_table

    statuses = ["pass", "pass", "mismatch", "compilation_error", "hacked", "pass", "pass", "pass", "pass",
                "format_error"]
    rows = [
        {"run": "r", "stage": "eval", "iteration": 0, "task_id": task, "sample": sample, "turn": turn,
         "correct": correct, "hacked": hacked, "speedup_eager": None if math.isnan(speedup) else speedup,
         "status": status}
        for (task, _, sample, turn, correct, hacked, speedup), status in zip(ROWS, statuses)
    ]
    write_table(rows, tmp_path / "stage=eval" / "part-0.parquet", "trajectories")
    result = CliRunner().invoke(main, ["metrics", "summary", str(tmp_path), "-p", "1", "-p", "1.2", "--n-boot", "50"])
    assert result.exit_code == 0, result.output
    last, history = result.output.split("Fast@p at turn t")[1].split("Fast@p, best of turns <= t")
    turn3_last = [line for line in last.splitlines() if line.startswith("|      3")][0]
    turn3_best = [line for line in history.splitlines() if line.startswith("|      3")][0]
    assert "| 50.0 [" in turn3_last and "| 0.0 [" in turn3_last
    assert "| 75.0 [50.0, 100.0]" in turn3_best
    rates = result.output.split("Fast@p at turn t")[0]
    assert "|      1 |         4 |     0.500 |    0.000 |      0.500 |" in rates
    assert "|      2 |         3 |     0.667 |    0.333 |      1.000 |" in rates
    empty = CliRunner().invoke(main, ["metrics", "summary", str(tmp_path / "nothing")])
    assert empty.exit_code != 0 and "no such file" in empty.output
