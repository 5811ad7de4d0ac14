"""Issue 55: the evaluated RL checkpoint chosen by validation at turn 3 (paper Figure 4: "we select checkpoints
based on turn 3 performance"; config eval.checkpoint / stts.checkpoint: best_val), and what the DAG plans."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_fastp_definition import write_fixture

from kpipe.data.io import write_table
from kpipe.evaluate.kernelbench import checkpoint_iteration, resolved_checkpoint, select_iteration, selection_job
from kpipe.report.tables import build_tables, checkpoint_notes


def test_the_best_turn3_validation_is_chosen_ties_by_fast_1_2_then_the_later_iteration():
    assert select_iteration({1: (10.0, 5.0), 3: (30.0, 0.0), 5: (20.0, 20.0)}) == 3
    assert select_iteration({1: (30.0, 5.0), 3: (30.0, 10.0), 5: (30.0, 10.0)}) == 5
    with pytest.raises(ValueError, match="no validated iteration"):
        select_iteration({})


def validation_rows(iteration: int, fast_at_turn3: int, fast_at_turn1: int) -> list[dict]:
    """Four trajectories of three turns: `fast_at_turn3` of them fast (speedup 1.5) at turn 3 and
    `fast_at_turn1` at turn 1 (the turn that must not decide); one more is fast but hacked at turn 3."""
    rows = []
    for sample in range(4):
        for turn in (1, 2, 3):
            fast = sample < (fast_at_turn3 if turn == 3 else fast_at_turn1 if turn == 1 else 0)
            hacked = turn == 3 and sample == fast_at_turn3
            rows.append({"run": "r", "stage": "rl_val", "iteration": iteration, "model": "rl-r", "task_id": "t",
                         "sample": sample, "turn": turn, "status": "hacked" if hacked else "pass" if fast else "mismatch",
                         "correct": fast or hacked, "hacked": hacked,
                         "speedup_eager": 1.5 if fast or hacked else None, "reward": 0.0})
    return rows


def test_selection_job_picks_the_best_turn3_validation_and_the_evaluations_read_it(tmp_path):
    paths, checkpoints = [], {}
    for iteration, at3, at1 in ((1, 1, 4), (3, 3, 0), (4, 2, 4)):  # iteration 1 is best at turn 1, 3 at turn 3
        path = tmp_path / f"iter={iteration}" / "part-0.parquet"
        write_table(validation_rows(iteration, at3, at1), path, "trajectories")
        paths.append(path)
        checkpoints[iteration] = f"results/models/rl-r/iter={iteration}"
    out = tmp_path / "selected.json"
    selection = selection_job(paths, checkpoints, out, run="r", turn=3)
    assert (selection["iteration"], selection["score"], selection["last_score"]) == (3, 75.0, 50.0)
    assert json.loads(out.read_text())["scores"]["1"] == {"fast_1": 25.0, "fast_1_2": 25.0}
    assert resolved_checkpoint(out) == "results/models/rl-r/iter=3" and checkpoint_iteration(str(out)) == 3
    assert checkpoint_iteration("results/models/rl-r/iter=29/") == 29 and checkpoint_iteration(None) == 0
    assert checkpoint_notes([out]) == ["RL run r: checkpoint of iteration 3 (chosen by best_val: validation fast_1 "
                                       "at turn 3 = 75.0; the last iteration, 4, 50.0)."]
    tables = tmp_path / "tables"
    build_tables(write_fixture(tmp_path / "db"), tables, n_boot=0, checkpoints=[out])
    for name in ("table1_fastp_eager", "table2_fastp_compile", "stts_curves", "eval_summary"):
        assert "RL run r: checkpoint of iteration 3" in (tables / f"{name}.md").read_text(), name
    assert "checkpoint of iteration" not in (tables / "training_curves.md").read_text()
    with pytest.raises(ValueError, match=r"iteration\(s\) \[4\] have no checkpoint"):
        selection_job(paths, {1: "a", 3: "b"}, out, run="r", turn=3)


def planned(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", *args], cwd=workdir,
                          capture_output=True, text=True)


def test_best_val_makes_the_evaluations_wait_for_the_runs_validation(workflow_copy):
    """eval, STTS and the tables of a best_val model read the selection file, which reads every validated
    iteration of its RL run; under `last` nothing changes."""
    last = planned(workflow_copy)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "select_checkpoint" not in last.stdout
    (workflow_copy / "config" / "best_val.yaml").write_text("eval: {checkpoint: best_val}\nstts: {checkpoint: best_val}\n")
    best = planned(workflow_copy, "--configfile", "config/config.yaml", "config/best_val.yaml")
    assert best.returncode == 0, best.stderr[-3000:]
    jobs = best.stdout.split("\n\n")
    select = [job for job in jobs if "rule select_checkpoint:" in job]
    assert len(select) == 1
    assert set(re.findall(r"stage=rl_val/rl-default/run=default/iter=(\d+)", select[0])) == {"1", "3", "4"}
    selection = "results/models/rl-default/default/selected.json"
    for rule in ("eval", "stts", "tables"):
        readers = [job for job in jobs if f"rule {rule}:" in job and selection in job]
        assert readers, rule
    rl_eval = [job for job in jobs if "rule eval:" in job and "model=tiny-rl" in job]
    assert rl_eval and all(selection in job and "rl-default/default/iter=4" not in job for job in rl_eval)
    (workflow_copy / "config" / "no_val.yaml").write_text("eval: {checkpoint: best_val}\nrl: {validation: {every: 0}}\n")
    refused = planned(workflow_copy, "--configfile", "config/config.yaml", "config/no_val.yaml")
    assert refused.returncode != 0 and "best_val needs RL validation" in refused.stdout + refused.stderr
