"""scripts/gpu_suite.py: every GPU check is in the suite, its calls fit the device's 10 minutes, and a
call fails when one of its checks does."""

from __future__ import annotations

from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_suite.py"


def test_every_check_runs_once_in_calls_that_fit_one_machine_and_ten_minutes(load_script):
    suite = load_script("gpu_suite")
    checks = {path.name for path in SCRIPT.parent.glob("gpu_check_*")}
    assert checks == {Path(c.command[0] if c.command[0] != "bash" else c.command[1]).name for c in suite.SUITE}
    calls = suite.plan()
    assert [c for call in calls for c in call] == list(suite.SUITE)
    assert all(sum(c.seconds for c in call) <= suite.CALL_LIMIT_S < 600 for call in calls)
    assert all(len({c.gpus for c in call}) == 1 for call in calls)
    assert len({c.folder for c in suite.SUITE}) == len(suite.SUITE)  # one $OUT folder per check


def test_a_call_fails_when_one_of_its_checks_does(load_script, tmp_path, capsys):
    suite = load_script("gpu_suite")
    ok = suite.Check("passes", ("-c", "import os, pathlib; pathlib.Path(os.environ['OUT'], 'r.md').write_text('x')"), 1)
    bad = suite.Check("fails", ("-c", "raise SystemExit(3)"), 1)
    assert suite.run_call([ok], tmp_path) == 0 and (tmp_path / "passes" / "r.md").read_text() == "x"
    assert suite.run_call([ok, bad], tmp_path) == 1
    assert "FAIL: fails exited 3" in capsys.readouterr().err
