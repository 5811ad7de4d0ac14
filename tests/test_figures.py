"""Figures 4-8 as PNG from a database with training metrics, RL rollouts and STTS rows; and
from an empty one (panels that say there is no data instead of failing)."""

import pandas as pd
from PIL import Image
from test_fastp_definition import write_fixture

from kpipe.data.io import write_table
from kpipe.db import build_db
from kpipe.figures import FIGURE_NAMES, FIGURE_PANELS, build_figures, matching_series, normalised

NAMES = {"fig4_fast1_training", "fig5_fast12_entropy", "fig6_stts", "fig7_training_dynamics", "fig8_hacking_ratio",
         "fig_rl_validation"}


def test_figure_names_are_the_papers():
    assert set(FIGURE_NAMES) == NAMES


def test_metric_names_are_found_under_usual_spellings():
    curves = pd.DataFrame({"run": "r", "stage": ["val", "val", "rl", "rl", "rl", "sft", "rl"], "iteration": 0,
                           "step": 1, "value": 1.0,
                           "name": ["val/fast@1.2_turn3", "fast@1", "entropy", "rollout_ppl", "grad_norm", "entropy",
                                    "fast@1_best_of_history"]})
    panels = FIGURE_PANELS["fig7_training_dynamics"]
    assert normalised("val/Fast@1.2_turn3") == "val_fast_1_2_turn3"
    assert matching_series(curves, FIGURE_PANELS["fig5_fast12_entropy"]["Fast@1.2 during RL"])["name"].tolist() == [
        "val/fast@1.2_turn3"]
    fast1 = FIGURE_PANELS["fig4_fast1_training"]["Fast@1 during RL"]
    assert matching_series(curves, fast1)["name"].tolist() == ["fast@1"]  # not its best-of-history twin
    assert len(matching_series(curves, panels["Entropy"])) == 1  # the SFT stage is not an RL curve
    assert matching_series(curves, panels["Rollout (vLLM) perplexity"])["name"].tolist() == ["rollout_ppl"]


def test_all_figures_are_written(tmp_path):
    metrics = [{"run": "r", "stage": stage, "iteration": step // 2, "step": step, "name": name, "value": value}
               for step in range(4)
               for stage, name, value in (("rl", "entropy", 1.0 / (step + 1)), ("val", "fast@1.2_turn3", 0.1 * step))]
    write_table(metrics, tmp_path / "train_metrics" / "part-0.parquet", "train_metrics")
    rl = [{"run": "r", "stage": "rl", "iteration": it, "model": "p", "task_id": "t3", "sample": s, "turn": 1,
           "hacked": s < 2 - it} for it in range(2) for s in range(4)]
    stts = [{"run": "r", "stage": "stts", "iteration": 0, "model": "m@top_w(w=4)", "task_id": "t1", "sample": 0,
             "turn": t, "correct": True, "hacked": False, "speedup_eager": 1.0 + 0.1 * t} for t in range(1, 5)]
    db = write_fixture(tmp_path, rl + stts)
    written = build_figures(db, tmp_path / "figures")
    assert set(written) == NAMES
    for path in written.values():
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 300


def test_figures_of_an_empty_database(tmp_path):
    build_db(tmp_path, tmp_path / "kpipe.duckdb")
    written = build_figures(tmp_path / "kpipe.duckdb", tmp_path / "figures")
    assert set(written) == NAMES and all(p.stat().st_size > 0 for p in written.values())
