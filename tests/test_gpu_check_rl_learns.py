"""checks/gpu/rl_learns.py: its verdict, and its CPU smoke mode end to end (issue 16, item 2).

The GPU run itself (5 RL iterations judged by real GPU timing) only runs on the device; here the
same code path runs with --cpu (TRITON_INTERPRET=1, sizes capped, a few steps; ~30-55 s on a
loaded 2-core machine), and the check must fail when the rollouts do not improve.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from checks.gpu import rl_learns as script
from checks.gpu.harness import Report, device_facts

ROOT = Path(__file__).resolve().parents[1]


def iteration(passing: dict[str, int], n: int = 8) -> pd.DataFrame:
    """n rollouts per task, the first `passing[task]` of them correct and fast (reward 2.5)."""
    rows = [{"task_id": task, "reward": 2.5 if i < k else 0.0, "fast1": 1.0 if i < k else 0.0}
            for task, k in passing.items() for i in range(n)]
    return pd.DataFrame(rows)


def test_verdict_passes_a_rise_and_fails_a_flat_or_short_run():
    first = iteration({"a": 2, "b": 1, "c": 2})
    learned = iteration({"a": 7, "b": 6, "c": 8})
    check = script.verdict([first, iteration({"a": 4, "b": 3, "c": 5}), learned], iterations=3)
    assert check["ok"], check
    assert check["reward"]["low"] > 0 and check["fast@1"]["rises"]

    flat = script.verdict([first, iteration({"a": 2, "b": 2, "c": 1})], iterations=2)
    assert not flat["ok"] and "reward does not rise" in flat["why"] and "fast@1 does not rise" in flat["why"]

    noisy = script.verdict([first, iteration({"a": 3, "b": 2, "c": 2})], iterations=2)  # +2 of 24: within noise
    assert not noisy["ok"], noisy

    short = script.verdict([first, learned], iterations=5)
    assert not short["ok"] and "only 2 of 5 iterations ran" in short["why"]
    assert not script.verdict([first], iterations=5)["ok"]


def test_cpu_smoke_runs_every_stage_and_the_enforced_check_fails_without_learning(tmp_path):
    out = tmp_path / "out"
    # --enforce: a smoke run's 3-step SFT policy writes no kernel, so reward and Fast@1 cannot rise
    done = subprocess.run([sys.executable, "-m", "checks.gpu", "rl_learns", "--cpu", "--enforce", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    path = out / "rl_learns.json"  # the check's one current report (kpipe.infra.ledger)
    report = json.loads(path.read_text())["sections"]["learns"]["data"]
    stages = [stage["stage"] for stage in report["stages"]]
    assert stages[:5] == ["policy (BPE tokenizer + nano model)", "KernelGym pool start",
                          "cold start (teacher + KernelGym)", "SFT", "RL iteration 0"], stages
    assert [it["iteration"] for it in report["iterations"]] == [0, 1]
    assert report["coldstart"]["evaluations"]["new"] >= 1  # the teacher's kernels went through KernelGym
    for it in report["iterations"]:
        assert it["rollouts"] == 4 and {"gen_s", "eval_s", "train_s", "step_s"} <= set(it["step"])
    assert report["verdict"]["ok"] is False and "does not rise" in report["verdict"]["why"]
    table = path.with_suffix(".md").read_text()
    assert "| iteration | rollouts | mean reward |" in table and "**FAIL**: learns: " in table


def test_a_run_that_stops_early_keeps_its_json_and_raises_its_own_error(tmp_path):
    """save() of a report cut off before the tasks were set writes the JSON, not a KeyError of its own."""
    sink = Report("rl_learns", script.TITLE, device_facts(), out=tmp_path)
    sink.begin("learns")
    script.save({"settings": {}, "stages": [], "iterations": [], "task_speedups": {}}, sink)
    assert sink.data["stages"] == [] and "stopped before the first RL iteration" in sink.current["lines"][0]
    saved = tmp_path / "rl_learns.json"
    assert json.loads(saved.read_text())["sections"]["learns"]["data"]["stages"] == []
