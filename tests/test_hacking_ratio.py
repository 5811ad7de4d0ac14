"""Issue 64: one hacking ratio everywhere (Appendix C): hacked turns over every generated turn, whatever its
status (a format error or a failed generation is in the denominator). The RL rollout metric, `kpipe metrics`, the
hacking-ratio table and every other table's `hacking_ratio` give the same number on the same rows."""

import pandas as pd
import pytest
from test_fastp_definition import eval_rows, table, write_fixture

from kpipe.data import metrics
from kpipe.data.metrics_cli import rates_by_turn
from kpipe.train import rollouts


def level_rows(rows, model, tasks):
    return [row for row in rows if row["model"] == model and row["task_id"] in tasks]


def test_every_hacking_ratio_has_one_denominator(tmp_path):
    # the fixture's level 1 (tasks t1, t2) of model m: 11 generated turns, one hacked, a format error and a
    # compilation error among them; the same turns again as RL validation rows
    rows = level_rows(eval_rows(), "m", ("t1", "t2"))
    rows.append({**rows[0], "turn": 4, "status": "generation_error", "correct": False, "hacked": False,
                 "speedup_eager": None, "speedup_compile": None})  # a failed generation: counted too
    validation = [{**row, "stage": "rl_val", "iteration": 1} for row in rows]
    db = write_fixture(tmp_path, [rows[-1], *validation])
    expected = 1 / 12
    assert metrics.hacking_ratio([row["hacked"] for row in rows]) == pytest.approx(expected)
    assert rollouts.rollout_metrics(rows, max_turns=4)["hacking_ratio"] == pytest.approx(expected)

    ratio = table(db, "hacking_ratio").set_index(["stage", "model", "level"])
    assert ratio.loc[("eval", "m", 1), "n_samples"] == 12
    assert ratio.loc[("eval", "m", 1), "hacking_ratio"] == pytest.approx(100 * expected)
    assert ratio.loc[("rl_val", "m", 1), "hacking_ratio"] == pytest.approx(100 * expected)
    ablations = table(db, "ablations").set_index(["model", "level"])
    assert ablations.loc[("m", 1), "hacking_ratio"] == pytest.approx(100 * expected)
    validation_curve = table(db, "rl_validation").set_index(["model", "level"])
    assert validation_curve.loc[("m", 1), "hacking_ratio"] == pytest.approx(100 * expected)

    per_turn = rates_by_turn(pd.DataFrame(rows)).set_index("turn")["hacked"]
    summary = table(db, "eval_summary").query("model == 'm' and level == 1").set_index("turn")["hacking_ratio"]
    assert (100 * per_turn).to_dict() == pytest.approx(summary.to_dict())
    assert summary[3] == pytest.approx(100 / 3)  # turn 3: one hacked of the three generated
