"""RL validation (config rl.validation, rule rl_validate): which iterations are validated, the
job's rows (the eval stage's loop on an RL checkpoint, stage=rl_val), the table SQL on a
hand-made fixture, and the planned jobs of the default and paper configs (dry runs)."""

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_eval_stage import write_tasks
from test_fastp_definition import write_fixture

from kpipe.data.io import read_table, write_table
from kpipe.evaluate.kernelbench import validated_iterations, validation_job
from kpipe.report.figures import build_figures
from kpipe.report.tables import DEFAULT_SQL_DIR, run_table_sql



@pytest.mark.parametrize("iterations,every,expected", [
    (2, 1, [0, 1]),
    (30, 10, [9, 19, 29]),
    (5, 2, [1, 3, 4]),  # the last iteration always, so a curve ends at the evaluated model
    (3, 5, [2]),
    (1, 1, [0]),
    (4, 0, []),  # off
])
def test_validated_iterations(iterations, every, expected):
    assert validated_iterations(iterations, every) == expected


@pytest.mark.parametrize("iterations,every", [(0, 1), (3, -1)])
def test_validated_iterations_rejects_bad_counts(iterations, every):
    with pytest.raises(ValueError, match="validated_iterations"):
        validated_iterations(iterations, every)


def test_validation_job_writes_rl_val_rows_of_the_run_and_iteration(tmp_path):
    from kpipe.train.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "nano", size="nano", seed=0)
    tasks = write_tasks(tmp_path / "tasks.parquet", levels=(1, 2, 2, 2))
    settings = {"level": 2, "max_tasks": 2, "samples": 2, "turns": 1, "sampling": {"max_tokens": 8}}
    out = tmp_path / "val.parquet"
    validation_job(tasks, out, tmp_path / "cache.jsonl", str(model), settings, {"ablation": "grpo"}, run="grpo",
                   iteration=3)
    rows = read_table(out, "trajectories").to_pandas()
    assert len(rows) == 2 * 2  # the first 2 level-2 tasks x 2 samples x 1 turn
    assert set(rows["task_id"]) == {"kb-L2-2", "kb-L2-3"}
    assert (set(rows["stage"]), set(rows["run"]), set(rows["iteration"]), set(rows["model"])) == (
        {"rl_val"}, {"grpo"}, {3}, {"rl-grpo"})


# (run, iteration, task, sample, turn, status, correct, hacked, speedup_eager); tasks t1, t2: level 1
VALIDATION_TURNS = [
    ("r", 0, "t1", 0, 1, "pass", True, False, 0.5),
    ("r", 0, "t1", 0, 2, "pass", True, False, 1.0),  # exactly 1: Fast@1, not Fast@1.2
    ("r", 0, "t1", 1, 1, "hacked", True, True, 5.0),
    ("r", 0, "t1", 1, 2, "hacked", True, True, 5.0),  # hacked: incorrect, however fast
    ("r", 0, "t2", 0, 1, "format_error", False, False, None),
    ("r", 0, "t2", 0, 2, "pass", True, False, 1.3),
    ("r", 0, "t2", 1, 1, "generation_error", False, False, None),  # ended: turn 2 never reached
    *[("r", 1, task, sample, turn, status, status == "pass", False, 1.25 if status == "pass" else None)
      for task in ("t1", "t2") for sample in (0, 1) for turn, status in ((1, "mismatch"), (2, "pass"))],
    ("g", 1, "t1", 0, 1, "pass", True, False, 2.0),
    ("g", 1, "t2", 0, 1, "hacked", True, True, 3.0),
]
# (run, iteration) -> n_samples, pass_rate, fast_1, fast_1_2, hacking_ratio (percent), step
EXPECTED = {
    ("r", 0): (4, 50.0, 50.0, 25.0, 100 * 2 / 7, 2),
    ("r", 1): (4, 100.0, 100.0, 100.0, 0.0, 4),
    ("g", 1): (2, 50.0, 50.0, 50.0, 50.0, None),  # no train_metrics of run g: no step
}


@pytest.fixture
def validation_db(tmp_path):
    rows = [{"run": run, "stage": "rl_val", "iteration": it, "model": f"rl-{run}", "task_id": task, "sample": sample,
             "turn": turn, "status": status, "correct": correct, "hacked": hacked, "speedup_eager": eager,
             "speedup_compile": eager} for run, it, task, sample, turn, status, correct, hacked, eager
            in VALIDATION_TURNS]
    metrics = [{"run": "r", "stage": "rl", "iteration": step // 3, "step": step, "name": "reward_mean", "value": 0.0}
               for step in (1, 2, 3, 4)]
    metrics.append({"run": "r", "stage": "sft", "iteration": 0, "step": 100, "name": "loss", "value": 0.0})
    write_table(metrics, tmp_path / "train_metrics" / "part-0.parquet", "train_metrics")
    return write_fixture(tmp_path, rows)


def test_rl_validation_table_matches_hand_computed_values(validation_db):
    table = run_table_sql(validation_db, DEFAULT_SQL_DIR / "rl_validation.sql")
    assert len(table) == len(EXPECTED)  # the eval rows of the fixture are not validation rows
    for (run, iteration), (n, pass_rate, fast_1, fast_1_2, hacking, step) in EXPECTED.items():
        row = table[(table["run"] == run) & (table["iteration"] == iteration)].iloc[0]
        assert row["n_samples"] == n and row["level"] == 1 and row["model"] == f"rl-{run}"
        assert tuple(row[["pass_rate", "fast_1", "fast_1_2", "hacking_ratio"]]) == pytest.approx(
            (pass_rate, fast_1, fast_1_2, hacking)), (run, iteration)
        assert (pd.isna(row["step"]) if step is None else row["step"] == step), (run, iteration)
    assert table.set_index(["run", "iteration"]).loc[("r", 0), "turn"] == 2  # read at the last turn


def test_validation_rows_stay_out_of_table1_and_reach_the_figure(validation_db, tmp_path):
    table1 = run_table_sql(validation_db, DEFAULT_SQL_DIR / "table1_fastp_eager.sql")
    assert set(table1["model"]) == {"m", "single"}
    written = build_figures(validation_db, tmp_path / "figures")
    assert written["fig_rl_validation"].stat().st_size > 0


# ---------------------------------------------------------------------------------------
# Planning: the default DAG and config/paper.yaml (dry runs in a scratch copy)
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(workflow_copy: Path) -> Path:
    return workflow_copy


def planned(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", *args], cwd=workdir,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def default_plan(workdir: Path) -> subprocess.CompletedProcess:
    """The default config's dry run, made once for the tests that read it."""
    return planned(workdir)


def with_overlay(workdir: Path, overlay: str) -> subprocess.CompletedProcess:
    """A dry run of the default config with `overlay` (YAML) on top, as config/ablations/*.yaml are given."""
    path = workdir / "config" / "test_overlay.yaml"
    path.write_text(overlay + "\n")
    return planned(workdir, "--configfile", "config/config.yaml", str(path.relative_to(workdir)))


def job_counts(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Rule name -> planned jobs, from the dry run's 'Job stats' table."""
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    stats = result.stdout.split("Job stats:")[1].split("total")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}


def test_default_dag_validates_every_other_iteration_and_the_last(workdir, default_plan):
    result = default_plan
    assert job_counts(result)["rl_validate"] == 3  # rl.iterations 5, every 2: 1, 3 and the last
    for iteration in (1, 3, 4):
        assert f"results/trajectories/stage=rl_val/rl-default/run=default/iter={iteration}/part-0.parquet" in result.stdout
    assert job_counts(with_overlay(workdir, "rl: {validation: {every: 1}}"))["rl_validate"] == 5
    assert job_counts(with_overlay(workdir, "rl: {validation: {every: 5}}"))["rl_validate"] == 1  # the last
    assert "rl_validate" not in job_counts(with_overlay(workdir, "rl: {validation: {every: 0}}"))


def test_the_tritonforge_overlay_adds_its_two_runs(workdir, default_plan):
    base = job_counts(default_plan)
    counts = job_counts(planned(workdir, "--configfile", "config/config.yaml", "config/ablations/tritonforge.yaml"))
    for rule in ("rl_iter", "rl_validate"):  # the default run, tritonforge and tritonforge_released
        assert counts[rule] == 3 * base[rule], rule


def test_paper_config_validates_both_runs_at_every_iteration(workdir):
    assert job_counts(planned(workdir, "--configfile", "config/paper.yaml"))["rl_validate"] == 2 * 30


def test_a_validation_level_outside_the_tasks_stops_with_one_line(workdir):
    result = with_overlay(workdir, "kernelbench: {levels: [1]}")
    assert result.returncode != 0
    assert "config error: rl.validation.level: 2 is not one of kernelbench.levels [1]" in result.stderr
