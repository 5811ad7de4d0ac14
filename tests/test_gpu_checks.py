"""checks/gpu: the harness on a CPU with a fake check (the current report and its ledger line, exit
status, empty compile caches, the suite in calls of at most 10 minutes, one report and ledger line per
check from several calls), and every real check module imports without torch and lists its sections."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from checks.gpu import CHECKS, gym, harness
from checks.gpu.harness import Report, Section, Target
from kpipe.infra import ledger

ROOT = Path(__file__).resolve().parents[1]
FACTS = {"date": "2026-11-27 10:00 UTC", "device": "cpu", "gpus": 0, "driver": "none", "torch": "2.13.0",
         "cuda": "none", "triton": "3.8.0", "python": "3.12.3", "commit": "abc1234"}

# a check of three sections, registered as checks.gpu.fake in a fresh interpreter (no torch imported yet)
FAKE = textwrap.dedent('''
    import os, sys, types
    from pathlib import Path
    from checks.gpu import harness

    def good(report, options):
        caches = {name: os.environ[name] for name in harness.COMPILE_CACHES}
        report.data.update(caches=caches, empty=all(not any(Path(p).iterdir()) for p in caches.values()),
                           home_triton=(Path.home() / ".triton").exists())
        report.table("item", "as expected")
        report.row("a", True)

    def bad(report, options):
        report.table("item", "as expected")
        report.row("b", False, ok=False)
        report.row("c", True)

    def broken(report, options):
        raise RuntimeError("boom")

    def refused(report, options):
        raise harness.CheckFailed("does not hold")

    fake = types.ModuleType("checks.gpu.fake")
    fake.TITLE = "A fake check"
    fake.SECTIONS = (harness.Section("good", 1, good), harness.Section("bad", 1, bad),
                     harness.Section("broken", 1, broken), harness.Section("refused", 1, refused))
    sys.modules["checks.gpu.fake"] = fake
    harness.CHECKS = (*harness.CHECKS, "fake")
    sys.exit(harness.main(sys.argv[1:]))
''')


def run_fake(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    (home / ".triton").mkdir(parents=True, exist_ok=True)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "TRITON_CACHE_DIR": str(tmp_path / "warm")}
    return subprocess.run([sys.executable, "-c", FAKE, "fake", *args, "--out", str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_check_reports_every_section_and_exits_1_when_one_fails(tmp_path):
    done = run_fake(tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    date = time.strftime("%Y-%m-%d", time.gmtime())
    md = tmp_path / "out" / "fake.md"
    report = json.loads(md.with_suffix(".json").read_text())
    [line] = ledger.read_ledger(tmp_path / "out")
    assert line["check"] == "fake" and line["device"] == "cpu" and line["date"].startswith(date)
    assert line["commit"] == report["facts"]["commit"] and line["report"] == "fake.md"
    assert line["figures"]["ok"] is False and line["figures"]["wall_s"] >= 0
    assert report["facts"]["device"] == "cpu" and report["facts"]["torch"] and report["facts"]["commit"]
    failures = {name: section["failures"] for name, section in report["sections"].items()}
    assert failures == {"good": [], "bad": ["b"], "broken": ["ERROR RuntimeError: boom"], "refused": ["does not hold"]}
    assert not report["ok"]
    text = md.read_text()
    assert text.startswith("# A fake check\n") and "## good (ok, " in text and "## bad (FAIL, " in text
    assert "| b | False |" in text and "**FAIL**: bad: b; broken: ERROR RuntimeError: boom" in text
    assert "FAIL: refused: does not hold" in done.stderr

    # empty compile caches of its own, never the environment's; ~/.triton stays on a machine without a GPU
    good = report["sections"]["good"]["data"]
    assert good["empty"] and good["home_triton"]
    assert str(tmp_path / "warm") not in good["caches"].values()


def test_chosen_sections_that_hold_exit_0_in_a_file_of_their_own(tmp_path):
    done = run_fake(tmp_path, "good")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "**PASS**" in (tmp_path / "out" / "fake.md").read_text()
    [line] = ledger.read_ledger(tmp_path / "out")
    assert line["figures"] == {"ok": True, "wall_s": line["figures"]["wall_s"], "sections": "good"}
    assert run_fake(tmp_path, "nosuch").returncode == 2


def test_the_compile_caches_cannot_be_set_once_torch_is_loaded():
    import torch  # noqa: F401 - loaded, as it is in this process anyway

    with pytest.raises(RuntimeError, match="imported before the compile caches"):
        harness.cold_caches()


def test_a_budget_fails_the_items_and_sections_not_started_in_time():
    report = Report("fake", "A fake check", FACTS, budget_s=1e-9)
    report.begin("late")
    time.sleep(0.01)
    report.item("x", 3, lambda: (True, ["y", "z"]))
    report.begin("items")
    report.deadline = None
    report.item("fine", 3, lambda: (True, ["y", "z"]))
    report.item("raises", 3, lambda: 1 / 0)
    assert report.failures == ["late: x", "items: raises"]
    assert "| raises | ERROR ZeroDivisionError: division by zero |  |" in report.markdown()


def section(name: str, seconds: int, gpus: int = 1) -> Section:
    return Section(name, seconds, lambda report, options: None, gpus)


def test_the_suite_is_split_into_calls_of_at_most_ten_minutes_on_one_machine_each():
    units = [("a", section("a1", 300)), ("a", section("a2", 200)), ("b", section("b1", 30)),
             ("b", section("b2", 600)), ("c", section("c1", 100, gpus=2)), ("d", section("d1", 10))]
    calls = harness.plan(units, limit_s=540)
    assert calls == [[Target("a", ("a1", "a2"), 500, 1), Target("b", ("b1",), 30, 1)],
                     [Target("b", ("b2",), 600, 1)],  # longer than a call: alone
                     [Target("c", ("c1",), 100, 2)], [Target("d", ("d1",), 10, 1)]]

    suite = harness.suite()
    calls = harness.plan(suite)
    ran = [(t.check, name) for call in calls for t in call for name in t.sections]
    assert ran == [(check, s.name) for check, s in suite]  # every section once, in suite order
    assert {check for check, _ in suite} == set(CHECKS)
    assert ("paper_units", "rl_step") not in [(check, s.name) for check, s in suite]  # it reads the smoke's run
    assert all(t.seconds <= harness.CALL_LIMIT_S for call in calls for t in call)
    assert all(sum(t.seconds for t in call) <= harness.CALL_LIMIT_S < 600 for call in calls)
    assert all(len({t.gpus for t in call}) == 1 for call in calls)


def test_a_call_runs_each_target_in_its_own_process_and_fails_when_one_does(tmp_path, monkeypatch, capsys):
    assert Target("gym", ("hacks", "faults"), 1, 1).argv(500)[1:] == ["-m", "checks.gpu", "gym", "hacks", "faults",
                                                                      "--budget-s", "500"]

    def argv(self: Target, budget_s: float) -> list[str]:
        write = f"import os, pathlib; pathlib.Path(os.environ['OUT'], '{self.check}.txt').write_text('{budget_s:.0f}')"
        return [sys.executable, "-c", write + ("; raise SystemExit(3)" if self.check == "bad" else "")]

    monkeypatch.setattr(Target, "argv", argv)
    ok, bad = Target("ok", ("s",), 1, 1), Target("bad", ("s",), 1, 1)
    assert harness.run_call([ok], tmp_path) == 0 and (tmp_path / "ok.txt").read_text() == "540"
    assert harness.run_call([ok, bad], tmp_path) == 1
    assert "FAIL: bad s exited 3" in capsys.readouterr().err


def save_fake_run(folder: Path, date: str, device: str, *names: str, fail: str = "") -> None:
    """A run of the fake check's sections `names` on `device`, saved in `folder`; `fail` fails its expectation."""
    facts = {**FACTS, "date": f"{date} 10:00 UTC", "device": device, "gpus": 1}
    report = Report("fake", "A fake check", facts, names, folder)
    for name in names:
        report.begin(name)
        report.line(f"{name} from {folder.name}")
        report.expect(name != fail, f"{name} failed")
        report.current.update(done=True, wall_s=1.0)
    report.save()


def test_reports_of_several_calls_combine_into_one_per_check(tmp_path, monkeypatch):
    fake = ModuleType("checks.gpu.fake")
    fake.TITLE, fake.SECTIONS = "A fake check", (section("one", 1), section("two", 1), section("three", 1))
    monkeypatch.setitem(sys.modules, "checks.gpu.fake", fake)
    monkeypatch.setattr(harness, "CHECKS", (*CHECKS, "fake"))

    h100 = "NVIDIA H100 80GB HBM3"
    save_fake_run(tmp_path / "call1", "2026-11-26", h100, "two", "three", fail="three")
    save_fake_run(tmp_path / "call2", "2026-11-27", h100, "one")
    save_fake_run(tmp_path / "rerun", "2026-11-27", h100, "three")
    assert (tmp_path / "call1" / "fake.md").exists()
    [written] = harness.combine([tmp_path / "call1", tmp_path / "call2", tmp_path / "rerun"], tmp_path / "docs")
    assert written == tmp_path / "docs" / "fake.md"
    text = written.read_text()
    assert text.index("## one") < text.index("## two") < text.index("## three")
    assert "three from rerun" in text and "three from call1" not in text and "**PASS**" in text
    [line] = ledger.read_ledger(tmp_path / "docs")
    assert line == {"check": "fake", "commit": "abc1234", "date": "2026-11-27 10:00 UTC", "device": "H100",
                    "figures": {"ok": True, "wall_s": 3.0}, "report": "fake.md"}


def test_a_check_that_keeps_sections_combines_a_run_into_its_current_report(tmp_path, monkeypatch):
    """The current report under --out keeps the sections the run did not run, each with its card; the ledger
    line holds the run's figures; `ledger add` would replace the merged report by one run's and refuses."""
    fake = ModuleType("checks.gpu.fake")
    fake.TITLE, fake.KEEPS_SECTIONS = "A fake check", True
    fake.SECTIONS = (section("one", 1), section("two", 1), section("three", 1))
    fake.figures = lambda report: {name: 1.0 for name in report["sections"]}
    monkeypatch.setitem(sys.modules, "checks.gpu.fake", fake)
    monkeypatch.setattr(harness, "CHECKS", (*CHECKS, "fake"))

    save_fake_run(tmp_path / "h100", "2026-11-26", "NVIDIA H100 80GB HBM3", "one", "three", fail="three")
    harness.combine([tmp_path / "h100"], tmp_path / "docs")
    save_fake_run(tmp_path / "h200", "2026-11-27", "NVIDIA H200", "two", "three")
    [written] = harness.combine([tmp_path / "h200"], tmp_path / "docs")
    text = written.read_text()
    assert text.index("## one") < text.index("## two") < text.index("## three") and "three from h100" not in text
    assert "Measured on NVIDIA H100 80GB HBM3, commit abc1234, 2026-11-26 10:00 UTC (an earlier run)." in text
    assert "Measured on NVIDIA H200, commit abc1234, 2026-11-27 10:00 UTC." in text and "**PASS**" in text
    data = json.loads((tmp_path / "docs" / "fake.json").read_text())
    assert [name for name, s in data["sections"].items() if s.get("kept")] == ["one"]
    first, second = ledger.read_ledger(tmp_path / "docs")
    assert (first["device"], first["figures"]) == ("H100", {"ok": False, "wall_s": 2.0, "sections": "one,three",
                                                            "one": 1.0, "three": 1.0})
    assert (second["device"], second["figures"]) == ("H200", {"ok": True, "wall_s": 2.0, "sections": "two,three",
                                                             "two": 1.0, "three": 1.0})
    (tmp_path / "h200" / "ledger.jsonl").write_text(json.dumps(second) + "\n")
    with pytest.raises(ValueError, match="--combine"):
        ledger.add([tmp_path / "h200"], results=tmp_path / "docs", performance_path=tmp_path / "performance.md")


@pytest.mark.parametrize("check", CHECKS)
def test_every_check_is_a_module_that_only_says_what_it_checks(check):
    module = harness.load(check)
    assert module.TITLE and module.SECTIONS and all(isinstance(s, Section) for s in module.SECTIONS)
    assert len({s.name for s in module.SECTIONS}) == len(module.SECTIONS)
    assert all(0 < s.seconds <= harness.CALL_LIMIT_S and s.run.__doc__ for s in module.SECTIONS)
    if hasattr(module, "add_options"):  # its options go beside the harness's
        parser = argparse.ArgumentParser()
        module.add_options(parser.add_argument_group())
        parser.parse_args([])
    source = (ROOT / "checks" / "gpu" / f"{check}.py").read_text()
    assert not any(plumbing in source for plumbing in ("cold_caches(", "device_facts(", "exit_status(", "TRITON_CACHE_DIR"))


def test_listing_the_suite_imports_no_torch():
    code = ("import sys; from checks.gpu import harness; harness.main(['--list']); "
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "call 1 (" in done.stdout and "gym_paths: KernelGym paths from a cold start" in done.stdout


def test_the_stale_output_hacks_are_a_mismatch_under_the_gym_checks_protocol():
    """A stale output within the correctness trials is judged a mismatch (correctness first); the
    check names one status per fixture, so any other status fails it."""
    assert all(isinstance(status, str) for status in gym.HACKS.values())
    assert gym.RUNTIME_ONLY.correct_trials == 5
    assert gym.HACKS["skip_when_warm"] == gym.HACKS["pointer_cache"] == "mismatch"
    two_trials = gym.Protocol(correct_trials=2)  # tests/test_gym_eval.py's: the stale output shows while timed
    assert gym.stale_output_status(3, two_trials) == gym.stale_output_status(4, two_trials) == "hacked"


def test_skip_when_warm_is_a_mismatch_when_its_stale_call_is_a_correctness_trial():
    """The reasoning behind HACKS, on the CPU: with 3 correctness trials, skip_when_warm's 3rd call
    (its first stale output) is judged for correctness, before any timing."""
    from kpipe.gym import evaluate

    protocol = gym.Protocol(correct_trials=3, perf_trials=2, warmup=0, baseline="eager", timeout_s=60,
                            memory_limit_mb=6000, reject_findings=())
    fixtures = ROOT / "tests" / "fixtures" / "gym"
    result = evaluate((fixtures / "relu_reference.py").read_text(), (fixtures / "hacks" / "skip_when_warm.py").read_text(),
                      protocol, reuse_reference=True)
    assert result.status == gym.stale_output_status(3, protocol) == "mismatch", result.diagnostic


def test_the_gym_check_fails_on_any_status_but_the_expected_one(monkeypatch):
    statuses = {**gym.HACKS, "pointer_cache": "hacked"}  # a deviation, even to another rejection, fails

    def evaluate(reference: str, candidate: str, protocol: object, reuse: bool = True) -> SimpleNamespace:
        name = next(n for n in statuses if (gym.FIXTURES / "hacks" / f"{n}.py").read_text() == candidate)
        return SimpleNamespace(status=statuses[name], hack_reasons=[], diagnostic="")

    monkeypatch.setattr(gym, "evaluate", evaluate)
    report = Report("gym", gym.TITLE, FACTS)
    report.begin("hacks")
    gym.hacks(report, argparse.Namespace())
    assert report.failures == ["hacks: pointer_cache"]
