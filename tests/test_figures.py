"""Figures 4-8, RL validation and Kevin's budget as PNG from a database with training metrics, RL
rollouts, STTS and budget rows, and from an empty one: titles name the engine and device read from
the rows, axes are labelled, CPU timings are marked, and a panel with nothing to show says so."""

import pandas as pd
import pytest
from PIL import Image
from test_fastp_definition import write_fixture
from test_kevin_budget import budget_rows

from kpipe.data.io import write_table
from kpipe.data.db import build_db
from kpipe.report.figures import (
    CPU_MARK,
    FIGURE_NAMES,
    FIGURE_PANELS,
    Source,
    build_figures,
    matching_series,
    normalised,
    nothing_to_draw,
    read_provenance,
    source_of,
)
from kpipe.gym.judge.feedback import runtime_lines
from kpipe.gym.judge.result import EvalResult

NAMES = {"fig4_fast1_training", "fig5_fast12_entropy", "fig6_stts", "fig7_training_dynamics", "fig8_hacking_ratio",
         "fig_rl_validation", "fig_kevin_budget", "fig_rl_reward"}
CPU = Source(("HF transformers",), ("cpu",))
GPU = Source(("vLLM",), ("cuda",))


def test_figure_names_are_the_papers():
    assert set(FIGURE_NAMES) == NAMES


def test_metric_names_are_found_under_usual_spellings():
    curves = pd.DataFrame({"run": "r", "stage": ["val", "val", "rl", "rl", "rl", "sft", "rl"], "iteration": 0,
                           "step": 1, "value": 1.0,
                           "name": ["val/fast@1.2_turn3", "fast@1", "entropy", "rollout_ppl", "grad_norm", "entropy",
                                    "fast@1_best_of_history"]})
    panels = FIGURE_PANELS["fig7_training_dynamics"]
    assert normalised("val/Fast@1.2_turn3") == "val_fast_1_2_turn3"
    fast12 = FIGURE_PANELS["fig5_fast12_entropy"]["Fast@1.2 during RL"].pattern
    assert matching_series(curves, fast12)["name"].tolist() == ["val/fast@1.2_turn3"]
    fast1 = FIGURE_PANELS["fig4_fast1_training"]["Fast@1 during RL"].pattern
    assert matching_series(curves, fast1)["name"].tolist() == ["fast@1"]  # not its best-of-history twin
    assert len(matching_series(curves, panels["Entropy"].pattern)) == 1  # the SFT stage is not an RL curve
    assert matching_series(curves, panels["Rollout-engine perplexity"].pattern)["name"].tolist() == ["rollout_ppl"]
    assert not any("vLLM" in title or "FSDP" in title for figure in FIGURE_PANELS.values() for title in figure)


def test_what_counts_as_nothing_to_draw():
    zeros, some = pd.Series([0.0, 0.0]), pd.Series([0.0, 0.5])
    assert nothing_to_draw(pd.Series(dtype=float), "Fast@1", CPU) == "no Fast@1 in this run"
    assert "CPU-interpreter" in nothing_to_draw(zeros, "Fast@1", CPU, speed=True)
    assert "no kernel was timed" in nothing_to_draw(zeros, "Fast@1", Source((), ()), speed=True)
    assert nothing_to_draw(zeros, "Fast@1", GPU, speed=True) is None  # a GPU-measured zero is a result
    assert "no update moved" in nothing_to_draw(zeros, "Gradient norm", GPU, zero_means="no update moved")
    assert nothing_to_draw(zeros, "Mean reward", CPU) is None  # a zero reward is a result
    assert nothing_to_draw(some, "Fast@1", CPU, speed=True) is None  # drawn, marked as CPU timings


def timed_feedback(kind: str) -> str:
    result = EvalResult(key="k", reference_hash="r", candidate_hash="c", status="pass", correct=True,
                        candidate_ms=2.0, eager_ms=1.0, speedup_eager=0.5, timing_kind=kind)
    return "\n".join(["Status: pass (correct)", *runtime_lines(result)])


def rows_with_feedback(kind: str) -> list[dict]:
    rl = [{"run": "r", "stage": "rl", "iteration": it, "model": f"r/rl-iter{it}/hf", "task_id": "t3", "sample": s,
           "turn": 1, "hacked": s < 2 - it, "correct": s >= 2 - it, "feedback": timed_feedback(kind)}
          for it in range(2) for s in range(4)]
    stts = [{"run": "r", "stage": "stts", "iteration": 0, "model": "m@top_w(w=4)", "task_id": "t1", "sample": 0,
             "turn": t, "correct": True, "hacked": False, "speedup_eager": 1.0 + 0.1 * t,
             "feedback": timed_feedback(kind)} for t in range(1, 5)]
    return rl + stts + [{**row, "feedback": timed_feedback(kind)} for row in budget_rows()]


def test_provenance_reads_engine_and_device_from_the_rows(tmp_path):
    db = write_fixture(tmp_path, rows_with_feedback("cpu"))
    provenance = read_provenance(db)
    assert source_of(provenance, ["rl"]) == Source(("HF transformers",), ("cpu",))
    assert source_of(provenance, ["budget"], None) == Source(("m",), ("cpu",))
    gpu = write_fixture(tmp_path / "gpu", rows_with_feedback("cuda"))
    assert source_of(read_provenance(gpu), ["stts"], None).timing == ("cuda",)
    untimed = [{**row, "feedback": "Status: mismatch (incorrect output)"} if row["stage"] == "rl" else row
               for row in rows_with_feedback("cpu")]
    db = write_fixture(tmp_path / "untimed", untimed)
    assert source_of(read_provenance(db), ["rl"]).timing == ("cpu",)  # no RL kernel timed: the run's device


@pytest.fixture
def figure_texts(monkeypatch):
    """Every text drawn on a figure (titles, labels, panel messages), by output file name, its
    whitespace normalised."""
    import matplotlib.figure

    texts: dict[str, list[str]] = {}
    save = matplotlib.figure.Figure.savefig

    def recording_save(fig, path, *args, **kwargs):
        drawn = [fig._suptitle.get_text()] if fig._suptitle else []
        for ax in fig.axes:
            drawn += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), *(t.get_text() for t in ax.texts)]
        texts[path.stem] = [" ".join(text.split()) for text in drawn]  # wrapped lines joined
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_save)
    return texts


def test_all_figures_are_written_with_labels_and_sources(tmp_path, figure_texts):
    metrics = [{"run": "r", "stage": stage, "iteration": step // 2, "step": step, "name": name, "value": value}
               for step in range(4)
               for stage, name, value in (("rl", "entropy", 1.0 / (step + 1)), ("val", "fast@1.2_turn3", 0.1 * step),
                                          ("rl", "grad_norm", 0.0), ("rl", "reward_mean", 0.1 * step))]
    write_table(metrics, tmp_path / "train_metrics" / "part-0.parquet", "train_metrics")
    db = write_fixture(tmp_path, rows_with_feedback("cpu"))
    written = build_figures(db, tmp_path / "figures")
    assert set(written) == NAMES
    for path in written.values():
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 300
    for name in ("fig4_fast1_training", "fig7_training_dynamics", "fig8_hacking_ratio", "fig_rl_reward"):
        title = figure_texts[name][0]
        assert "rollouts: HF transformers" in title and "device: CPU" in title, title
    dynamics = " ".join(figure_texts["fig7_training_dynamics"])
    assert "Gradient norm: 0 at every step (4 values): no update moved the policy" in dynamics  # said, not drawn as a flat 0
    assert "training step (optimizer updates)" in dynamics and "entropy (nats per token)" in dynamics
    budget = figure_texts["fig_kevin_budget"]
    assert "models: m" in budget[0] and "device: CPU" in budget[0] and "4 kernels per task" in budget[0]
    assert "kernels generated per task (k trajectories × turns)" in budget and CPU_MARK in budget
    stts = figure_texts["fig6_stts"]
    assert "turns T" in stts and "Fast@1.2 vs eager (% of samples)" in stts and CPU_MARK in stts


def test_figures_of_an_empty_database(tmp_path, figure_texts):
    build_db(tmp_path, tmp_path / "kpipe.duckdb")
    written = build_figures(tmp_path / "kpipe.duckdb", tmp_path / "figures")
    assert set(written) == NAMES and all(p.stat().st_size > 0 for p in written.values())
    assert "no STTS rows in this run" in figure_texts["fig6_stts"]
    assert "no RL validation rows in this run" in figure_texts["fig_rl_validation"]
    assert "no RL rollouts in this run" in figure_texts["fig_rl_reward"]
    assert "no budget rows (config eval_budget) in this run" in figure_texts["fig_kevin_budget"]
    assert "device: no timed kernel" in figure_texts["fig6_stts"][0]


def test_intervals_of_the_tables_are_shaded(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kpipe.report.figures import _line
    from kpipe.report.tables import DEFAULT_SQL_DIR, run_table_sql, with_intervals

    stts = [{"run": "r", "stage": "stts", "iteration": 0, "model": "m@full", "task_id": task, "sample": 0, "turn": t,
             "correct": task == "t1", "hacked": False, "speedup_eager": 1.5} for task in ("t1", "t3") for t in (1, 2)]
    db = write_fixture(tmp_path, stts)
    curves = with_intervals(db, "stts_curves", run_table_sql(db, DEFAULT_SQL_DIR / "stts_curves.sql"), n_boot=200)
    level1 = curves[(curves["level"] == 1) & (curves["history"] == "last")]
    assert (level1["fast_1_2_lo"] <= level1["fast_1_2"]).all() and (level1["fast_1_2"] <= level1["fast_1_2_hi"]).all()
    fig, ax = plt.subplots()
    _line(ax, level1, "T", "fast_1_2", "m full L1")
    assert len(ax.collections) == 1  # the shaded interval
    _line(ax, level1.drop(columns=["fast_1_2_lo", "fast_1_2_hi"]), "T", "fast_1_2", "no interval")
    assert len(ax.collections) == 1
    plt.close(fig)
