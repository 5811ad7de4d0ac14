"""scripts/gpu_check_gym.py fails (exit 1) when a row says NO or ERROR, not only prints it."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_rows_that_say_no_or_error_are_failures_and_stale_output_hacks_may_be_mismatch(load_script):
    check = load_script("gpu_check_gym")
    report = check.Report(budget_s=60)
    report.row(["unused_kernel", "yes", "hacked", "hacked", ""])
    report.row(["skip_when_warm", "skipped (time budget)", "", "", ""])
    assert report.failures == []
    report.row(["ghost_launch", "NO", "pass", "hacked", ""])
    report.guarded("broken item", 5, lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    assert report.failures == ["ghost_launch", "broken item"]
    assert set(check.HACKS["pointer_cache"]) == {"hacked", "mismatch"} and check.HACKS["ghost_launch"] == "hacked"


def test_main_exits_1_on_a_failed_row(load_script, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    check = load_script("gpu_check_gym")
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(check, "SECTIONS", {"fake": lambda report: report.row(["x", "NO", "", "", ""])})
    monkeypatch.setattr("sys.argv", ["gpu_check_gym.py", "--sections", "fake"])
    assert check.main() == 1
    assert "FAILED: x" in (tmp_path / "gym_check.md").read_text()
