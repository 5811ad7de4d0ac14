"""Results kept as data (kpipe.infra.ledger): docs/gpu-results holds one current report per check, the
ledger and its index; the index and docs/performance.md are what the ledger generates; a recorded run
overwrites its check's report and appends one line; a device's folder is taken in as it is."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kpipe.infra import ledger

KEYS = {"check", "date", "commit", "device", "figures", "report"}


def test_the_index_and_performance_page_are_generated_from_the_ledger() -> None:
    lines = ledger.read_ledger()
    assert (ledger.RESULTS / ledger.INDEX).read_text() == ledger.index(lines), (
        "docs/gpu-results/README.md is stale: python -m kpipe.infra.ledger write")
    assert ledger.PERFORMANCE.read_text() == ledger.performance(lines), (
        "docs/performance.md is stale: python -m kpipe.infra.ledger write")


def test_the_results_folder_is_one_report_per_check_the_ledger_and_its_index() -> None:
    lines = ledger.read_ledger()
    assert lines and all(set(line) == KEYS and isinstance(line["figures"], dict) for line in lines)
    checks = {line["check"] for line in lines}
    files = {path.name for path in ledger.RESULTS.iterdir()}
    assert {ledger.LEDGER, ledger.INDEX} <= files and len(files) <= 25
    # a report merged from runs of some sections keeps its data beside it (checks.gpu.harness, KEEPS_SECTIONS)
    assert files - {ledger.LEDGER, ledger.INDEX} <= {f"{check}.{kind}" for check in checks for kind in ("md", "json")}
    assert {f"{check}.md" for check in checks if not check.startswith("make_")} <= files  # make run/test: timed by hand


def test_record_overwrites_the_current_report_and_appends_a_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KPIPE_COMMIT", "abc1234")
    ledger.record("fake", "# first\n", {"per_min": 1.0}, "H200", results=tmp_path)
    second = ledger.record("fake", "# second\n", {"per_min": 2.0}, "2xH200", results=tmp_path)
    assert (tmp_path / "fake.md").read_text() == "# second\n"
    assert [line["figures"]["per_min"] for line in ledger.read_ledger(tmp_path)] == [1.0, 2.0]
    assert second["commit"] == "abc1234" and second["date"].endswith(" UTC") and second["report"] == "fake.md"
    assert set(second) == KEYS
    monkeypatch.delenv("KPIPE_COMMIT")
    assert ledger.current_commit() != "abc1234"


def test_a_tree_that_differs_from_its_head_is_not_credited_to_that_commit(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KPIPE_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "code.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "untracked.log").write_text("a run's output\n")
    assert ledger.current_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert ledger.current_commit(tmp_path) == f"{head}+changes"
    assert ledger.current_commit(tmp_path / "missing") == "unknown"


def test_the_latest_line_per_check_and_device_is_what_the_pages_show() -> None:
    lines = [{"check": "a", "date": "2026-11-27 10:00 UTC", "commit": "old", "device": "H200", "figures": {"x": 1}, "report": "a.md"},
             {"check": "a", "date": "2026-11-28 10:00 UTC", "commit": "new", "device": "2xH200", "figures": {"x": 2.345678}, "report": "a.md"},
             {"check": "a", "date": "2026-11-26 10:00 UTC", "commit": "older", "device": "H200", "figures": {"ok": True}, "report": "a.md"}]
    assert [line["commit"] for line in ledger.latest(lines, "check")] == ["new"]
    assert [line["commit"] for line in ledger.latest(lines, "check", "device")] == ["new", "old"]
    page = ledger.performance(lines)
    assert "| a | 2xH200 | 2026-11-28 | x 2.346 |" in page and "| a | H200 | 2026-11-27 | x 1 |" in page
    assert "ok yes" not in page  # the older line of that check and device
    assert not any(line["commit"] in page for line in lines)  # a guide names no commit
    assert ledger.figures_text({"ok": False, "n": 3}) == "ok no, n 3"


def test_a_device_folder_is_added_with_its_reports(tmp_path: Path) -> None:
    device, docs = tmp_path / "out", tmp_path / "docs"
    docs.mkdir()
    line = ledger.record("gym_scaling", "# scaling\n", {"per_min_1x2": 40.0}, "4xH200", results=device, commit="abc1234")
    assert ledger.add([device], results=docs, performance_path=tmp_path / "performance.md") == [line]
    assert (docs / "gym_scaling.md").read_text() == "# scaling\n"
    assert ledger.read_ledger(docs) == [line]
    index = (docs / ledger.INDEX).read_text()
    assert "| gym_scaling | `python benchmarks/gym_scaling.py` | [`gym_scaling.md`](gym_scaling.md) | 4xH200 |" in index
    assert "per_min_1x2 40" in (tmp_path / "performance.md").read_text()
    assert json.loads((docs / ledger.LEDGER).read_text()) == line


def test_device_labels() -> None:
    assert ledger.device_label("NVIDIA H100 80GB HBM3", 1) == "H100"
    assert ledger.device_label("NVIDIA H200", 4) == "4xH200"
    assert ledger.device_label("cpu", 0) == "cpu"


def test_every_benchmark_records_through_the_ledger() -> None:
    """A benchmark's report goes through `ledger.record` (its current report and ledger line), never a
    Markdown file of its own; the GPU checks do so through their harness (tests/test_gpu_checks.py)."""
    benchmarks = sorted((ledger.ROOT / "benchmarks").glob("*.py"))
    assert len(benchmarks) >= 7
    for path in benchmarks:
        source = path.read_text()
        assert "ledger.record(" in source, f"{path.name} does not record through kpipe.infra.ledger"
        assert '.md").write_text' not in source and ".md').write_text" not in source, path.name
