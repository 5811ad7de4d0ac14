"""checks/gpu/paper_units.py: the arithmetic it reports and the whole check on a nano model on the CPU (vLLM,
absent here, is skipped with a reason), so that its one cold run on the device does not fail on plumbing."""

import json
import subprocess
import sys
from pathlib import Path

from checks.gpu import paper_units

ROOT = Path(__file__).resolve().parents[1]


def test_training_flops_count_weights_and_causal_attention():
    # 6 N t + 6 L d t^2: N 100, t 10, L 2, d 4 -> 6,000 + 4,800
    assert paper_units.training_flops(100, 2, 4, 10) == 10_800


def test_a_step_past_its_limit_is_a_failure_and_the_next_step_runs(tmp_path):
    from checks.gpu.harness import Report

    facts = dict.fromkeys(("commit", "date", "device", "driver", "torch", "cuda", "triton", "python"), "x")
    report = Report("paper_units", "t", facts, out=tmp_path)
    report.begin("training")

    def slow() -> dict:
        import time
        time.sleep(5)
        return {}

    assert paper_units.step(report, "slow", 1, slow) is None
    assert paper_units.step(report, "fast", 5, lambda: {"x": 1.0}) == {"x": 1.0}
    assert report.failures == ["training: slow"] and report.data == {"fast": {"x": 1.0}}
    assert (tmp_path / "paper_units.json").exists()  # saved after each step


def test_the_check_runs_on_a_nano_model_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "checks.gpu", "paper_units", "--tiny", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((tmp_path / "paper_units.json").read_text())
    numerics = report["sections"]["optimizer_numerics"]["data"]
    for where in ("gpu", "host"):
        figures = numerics[f"offloaded_vs_adamw_master_on_{where}"]
        assert figures["relative_difference"] <= 1e-6 and figures["moved_fraction"] >= 0.99
    trainer = report["sections"]["trainer"]["data"]
    assert trainer["trainer_build"]["plan"] == "fp32"  # no GPU: no memory limit
    for tokens in (64, 32):
        figures = trainer[f"trainer_{tokens}"]
        assert figures["steps"] == 5 and figures["tokens_per_s"] > 0 and figures["optimizer_step_s"] > 0
        assert figures["host_peak_gib"] > 0 and len(figures["losses"]) == 5
    assert set(paper_units.figures(report)) >= {"train_tokens_per_s_64", "train_mfu_32", "optimizer_step_s"}
    assert "vLLM is not installed here" in (tmp_path / "paper_units.md").read_text()
