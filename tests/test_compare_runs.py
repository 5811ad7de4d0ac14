"""scripts/compare_runs.py: two result trees with the same rows pass whatever their timings; a changed
status, code, row or file fails, and the summary names the table and column; what measured times
decide (speedups, rewards, rows of an RL-trained policy, later turns) is reported apart and never fails."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from kpipe.data.io import write_table

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_runs.py"
spec = importlib.util.spec_from_file_location("compare_runs", SCRIPT)
compare_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_runs)


def turn(task: str, sample: int, **values) -> dict:
    row = {"run": "default", "stage": "eval", "iteration": 0, "task_id": task, "sample": sample, "turn": 1,
           "model": "tiny-sft", "eval_key": "k1", "prompt_messages": [{"role": "user", "content": "write a kernel"}],
           "response": "```python\nx\n```", "code": "x", "status": "pass", "correct": True, "hacked": False,
           "speedup_eager": 1.8, "speedup_compile": 0.7, "feedback": "correct; 1.234 ms vs 2.000 ms eager",
           "reward": 2.8, "gen_s": 0.5, "eval_s": 3.25}
    return {**row, **values}


TRAJECTORIES = [turn("kb-main-L1-19", 0), turn("kb-main-L1-19", 1, status="mismatch", correct=False, reward=0.0,
                                                speedup_eager=None, speedup_compile=None),
                turn("kb-main-L2-3", 0)]
METRICS = [{"run": "default", "stage": "sft", "iteration": 0, "step": 1, "name": "loss", "value": 0.25},
           {"run": "default", "stage": "sft", "iteration": 0, "step": 1, "name": "step_s", "value": 12.0}]
EVALS = [{"key": "k1", "status": "pass", "correct": True, "hacked": False, "candidate_ms": 1.2, "eager_ms": 2.0,
          "speedup_eager": 1.6, "device_id": "GPU-aaaa 0000:17:00.0", "timed_spans": [[1.0, 2.0]], "wall_s": 4.0,
          "feedback": "1.200 ms"}]


def tree(root: Path, trajectories=TRAJECTORIES, metrics=METRICS, evals=EVALS, shuffle: bool = False) -> Path:
    trajectories = list(reversed(trajectories)) if shuffle else trajectories  # row order is not compared
    write_table(trajectories, root / "trajectories/stage=eval/run=default/model=tiny-rl/level=1/part-0.parquet",
                "trajectories")
    write_table(metrics, root / "train_metrics/stage=rl/run=default/iter=0/part-0.parquet", "train_metrics")
    write_table(evals, root / "evals/part-0.parquet", "evals")
    write_table(metrics, root / "work/rl-default/iter=0/scratch/train_metrics.parquet", "train_metrics")
    return root


def rerun_of(rows: list[dict], **changes) -> list[dict]:
    """The rows as a rerun writes them: other timings, other measured times in the feedback."""
    rows = copy.deepcopy(rows)
    for row in rows:
        for column in ("gen_s", "eval_s", "wall_s", "candidate_ms", "eager_ms"):
            if column in row:
                row[column] *= 1.7
        if row.get("speedup_eager"):
            row["speedup_eager"] *= 1.1  # the same side of 1
        if "feedback" in row:
            row["feedback"] = row["feedback"].replace("1.2", "1.4")
        row.update(changes)
    return rows


def test_a_rerun_with_other_timings_has_the_same_rows(tmp_path: Path) -> None:
    a = tree(tmp_path / "a")
    metrics = [dict(row, value=99.0) if row["name"] == "step_s" else row for row in METRICS]
    evals = rerun_of(EVALS, device_id="GPU-bbbb 0000:3b:00.0", timed_spans=[[5.0, 6.0]])
    b = tree(tmp_path / "b", rerun_of(TRAJECTORIES), metrics, evals, shuffle=True)
    same, report = compare_runs.compare(a, b)
    assert same, report
    assert report[0].startswith("evals [deterministic]: 1 / 1 file(s), 1 / 1 row(s): same rows")
    assert any(line.startswith("trajectories [deterministic]: 1 / 1 file(s), 3 / 3 row(s): same rows") for line in report)
    assert any(line.startswith("train_metrics [deterministic]: 1 / 1 file(s), 1 / 1 row(s)") for line in report)  # work/ skipped


@pytest.mark.parametrize("change, column", [
    (dict(status="timeout"), "status"),
    (dict(code="y"), "code"),
    (dict(feedback="wrong; 1.234 ms"), "feedback"),
])
def test_a_changed_value_is_named(tmp_path: Path, change: dict, column: str) -> None:
    """(A runtime error's feedback is deterministic; a pass's quotes its times: the next test.)"""
    base = copy.deepcopy(TRAJECTORIES)
    base[2].update(status="runtime_error", feedback="RuntimeError: shape mismatch")
    changed = copy.deepcopy(base)
    changed[2].update(change)
    same, report = compare_runs.compare(tree(tmp_path / "a", base), tree(tmp_path / "b", changed))
    assert not same
    line = next(line for line in report if line.startswith("trajectories [deterministic]:"))
    assert f"1 row(s) differ in {column} (1)" in line, report
    assert any("task_id='kb-main-L2-3'" in line and column in line for line in report)


@pytest.mark.parametrize("change, column", [
    (dict(reward=2.5), "reward"),
    (dict(speedup_compile=1.3), "speedup_compile"),  # 0.7 -> 1.3: slower became faster
    (dict(feedback="correct; profile: host 60%, kernel 40%"), "feedback"),  # a pass's feedback quotes its times
])
def test_what_measured_times_decide_is_reported_apart_and_does_not_fail(tmp_path: Path, change: dict,
                                                                         column: str) -> None:
    changed = copy.deepcopy(TRAJECTORIES)
    changed[2].update(change)
    same, report = compare_runs.compare(tree(tmp_path / "a"), tree(tmp_path / "b", changed))
    assert same, report
    line = next(line for line in report if line.startswith("trajectories [run-dependent]:"))
    assert f"differs (as runs may): 1 row(s) differ in {column} (1)" in line, report
    assert next(line for line in report if line.startswith("trajectories [deterministic]:")).endswith("same rows")


@pytest.mark.parametrize("change", [dict(model="tiny-rl"), dict(model="tiny-rl@best_of_n"), dict(stage="rl"),
                                    dict(turn=2)])
def test_rows_of_an_rl_policy_and_later_turns_are_run_dependent_whole(tmp_path: Path, change: dict) -> None:
    """tiny-rl's `source` is rl in config/config.yaml; a later turn's prompt quotes measured times."""
    a = [dict(row, **change) for row in TRAJECTORIES]
    b = [dict(row, code="other", status="timeout") for row in a]
    same, report = compare_runs.compare(tree(tmp_path / "a", a), tree(tmp_path / "b", b))
    assert same, report
    assert any(line.startswith("trajectories [deterministic]: 1 / 1 file(s), 0 / 0 row(s)") for line in report)
    assert any(line.startswith("trajectories [run-dependent]") and "code (3)" in line for line in report)
    # their evaluations too: no deterministic row references k1
    assert report[0].startswith("evals [deterministic]: 1 / 1 file(s), 0 / 0 row(s)")


def test_the_config_names_the_rl_models(tmp_path: Path) -> None:
    config = tmp_path / "overlay.yaml"
    config.write_text("models:\n  - {name: tiny-sft, kind: pipeline, source: rl}\n")
    assert compare_runs.rl_models([compare_runs.DEFAULT_CONFIG]) == {"tiny-rl"}
    assert compare_runs.rl_models([compare_runs.DEFAULT_CONFIG, config]) == {"tiny-sft"}


def test_missing_rows_files_and_tables_differ(tmp_path: Path) -> None:
    a = tree(tmp_path / "a")
    same, report = compare_runs.compare(a, tree(tmp_path / "b", TRAJECTORIES[:2]))
    assert not same and "row counts differ by -1" in next(line for line in report if line.startswith("trajectories [deterministic]"))
    b = tree(tmp_path / "c")
    (b / "evals" / "part-0.parquet").unlink()
    same, report = compare_runs.compare(a, b)
    assert not same
    assert any(line.startswith("evals [deterministic]: 1 / 0 file(s)") and "1 file(s) only in A" in line for line in report)
    assert "  only in A: evals/part-0.parquet" in report


def test_the_command_exits_non_zero_on_a_difference(tmp_path: Path) -> None:
    a, b = tree(tmp_path / "a"), tree(tmp_path / "b")
    same = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "the same deterministic rows in every table" in same.stdout.strip().splitlines()[-1]
    changed = copy.deepcopy(METRICS)
    changed[0]["value"] = 0.3
    c = tree(tmp_path / "c", metrics=changed)
    different = subprocess.run([sys.executable, str(SCRIPT), str(a), str(c)], capture_output=True, text=True)
    assert different.returncode == 1
    assert "train_metrics [deterministic]: 1 / 1 file(s), 1 / 1 row(s): DIFFERENT: 1 row(s) differ in value (1)" in different.stdout
    ignored = subprocess.run([sys.executable, str(SCRIPT), str(a), str(c), "--ignore", "loss"], capture_output=True,
                             text=True)
    assert ignored.returncode == 0, ignored.stdout  # the metric left out
