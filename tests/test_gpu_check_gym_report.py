"""scripts/gpu_check_gym.py fails (exit 1) when a row says NO or ERROR, not only prints it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check_gym.py"


def load_script():
    if str(SCRIPT.parent) not in sys.path:  # as for `python scripts/...`: the check imports gpu_harness
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_check_gym", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_that_say_no_or_error_are_failures_and_stale_output_hacks_may_be_mismatch():
    check = load_script()
    report = check.Report(budget_s=60)
    report.row(["unused_kernel", "yes", "hacked", "hacked", ""])
    report.row(["skip_when_warm", "skipped (time budget)", "", "", ""])
    assert report.failures == []
    report.row(["ghost_launch", "NO", "pass", "hacked", ""])
    report.guarded("broken item", 5, lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    assert report.failures == ["ghost_launch", "broken item"]
    assert set(check.HACKS["pointer_cache"]) == {"hacked", "mismatch"} and check.HACKS["ghost_launch"] == "hacked"


def test_main_exits_1_on_a_failed_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    check = load_script()
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(check, "SECTIONS", {"fake": lambda report: report.row(["x", "NO", "", "", ""])})
    monkeypatch.setattr("sys.argv", ["gpu_check_gym.py", "--sections", "fake"])
    assert check.main() == 1
    assert "FAILED: x" in (tmp_path / "gym_check.md").read_text()
