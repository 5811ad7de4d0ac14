"""checks/gpu/gym_paths.py: the merge of a full run with a later rerun of some pairs, and --pairs.

The folders here are fake report folders with gym_paths_*.json as the harness writes them: per
section its data (path, column, ok, rows, each row with pair, status, diagnostic, ...) and whether it
finished; an eval section that ran out of time did not, and holds the rows it got to. No GPU, no
bank, no KernelBench data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from checks.gpu import gym_paths as script
from checks.gpu.harness import CheckFailed


PAIRS = [
    {"key": "L1_19/legit", "expected": "pass", "reference_src": "", "candidate_src": ""},
    {"key": "L1_19/wrong_dtype", "expected": "mismatch", "reference_src": "", "candidate_src": ""},
    {"key": "L1_1/legit", "expected": "pass", "reference_src": "", "candidate_src": ""},
]
OOM = "the reference program failed (OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB.)"


def row(pair: str, status: str, diagnostic: str = "") -> dict:
    return {"key": f"hash-{pair}", "reference_hash": "842b5334e0c33c1a", "candidate_hash": "01ba0cdea84a3c84", "status": status,
            "correct": status == "pass", "hacked": False, "hack_reasons": [], "findings": [], "diagnostic": diagnostic,
            "feedback": f"Status: {status}", "wall_s": 3.3, "device_id": "GPU-794c4a7e 00000000:00:06.0", "pair": pair}


def section(path: str, rows: list[dict], expected: dict[str, str]) -> dict:
    return {"path": path, "column": path, "ok": all(r["status"] == expected[r["pair"]] for r in rows), "rows": rows,
            "pairs": len(rows), "wall_s": 330.3, "first_eval_s": 7.1, "median_eval_s": 3.3, "median_warm_eval_s": 3.3,
            "devices": ["GPU-794c4a7e"]}


def write(folder: Path, name: str, data: dict, done: bool = True) -> None:
    """One call's report of section `name` (as checks.gpu.harness.Report.save writes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    report = {"check": "gym_paths", "title": "KernelGym paths", "facts": {"date": "2026-11-27 10:00 UTC"}, "part": [name],
              "sections": {name: {"lines": [], "failures": [], "data": data, "done": done, "wall_s": 1.0 if done else None}}}
    (folder / f"gym_paths_2026-11-27_H100.{name}.json").write_text(json.dumps(report))


@pytest.fixture
def runs(tmp_path):
    """A full run (pool all pass; service OOM on the two L1_19 pairs, as lanes sharing one GPU
    gave; eval in two shards, the second cut short) and a rerun of the two L1_19 pairs on service
    and of one pair on the eval path."""
    expected = {p["key"]: p["expected"] for p in PAIRS}
    full, rerun = tmp_path / "full", tmp_path / "rerun"
    write(full, "pool", section("pool", [row(p["key"], p["expected"], "full") for p in PAIRS], expected))
    service = [row("L1_19/legit", "reference_error", OOM), row("L1_19/wrong_dtype", "reference_error", OOM), row("L1_1/legit", "pass", "full")]
    write(full, "service", section("service", service, expected))
    eval0 = [row("L1_19/legit", "oom", "full"), row("L1_1/legit", "pass", "full")]
    write(full, "eval0", section("eval", eval0, expected) | {"cli_pairs": 1})
    # ran out of time after one pair
    write(full, "eval1", {"path": "eval", "column": "eval", "rows": [row("L1_19/wrong_dtype", "mismatch", "full")]}, done=False)
    write(rerun, "service", section("service", [row("L1_19/legit", "pass", "rerun"), row("L1_19/wrong_dtype", "mismatch", "rerun")], expected))
    write(rerun, "eval0", {"path": "eval", "column": "eval", "rows": [row("L1_19/legit", "pass", "rerun")]}, done=False)
    return full, rerun


def table_row(lines: list[str], key: str) -> list[str]:
    [line] = [line for line in lines if line.startswith(f"| {key} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_later_folder_supersedes_rerun_pairs_and_keeps_the_rest(runs):
    full, rerun = runs
    lines, ok = script.merge([full, rerun], PAIRS)
    text = "\n".join(lines)
    header = table_row(lines, "pair")
    cells = {key: dict(zip(header, table_row(lines, key))) for key in ("L1_19/legit", "L1_19/wrong_dtype", "L1_1/legit")}
    assert cells["L1_19/legit"]["service"] == "pass" and cells["L1_19/legit"]["eval"] == "pass"  # the rerun's rows
    assert cells["L1_19/wrong_dtype"]["service"] == "mismatch"
    assert cells["L1_19/wrong_dtype"]["eval"] == "mismatch"  # the full run's .partial shard, not rerun
    assert cells["L1_1/legit"]["service"] == "pass" and cells["L1_1/legit"]["eval"] == "pass"  # not rerun: the full run's
    assert all(c["agree"].startswith("yes") for c in cells.values()), text
    assert ok, text  # the full run's failing service and eval sections were rerun where they failed
    assert f"- service: 1 pairs from {full}, 2 pairs from {rerun}" in text
    assert f"- eval: 2 pairs from {full}, 1 pairs from {rerun}" in text
    assert f"- pool: 3 pairs from {full}" in text
    assert "(2 superseded by a later folder)" in text  # the full run's service section

    # which row each pair got, by the rows' own marks
    sections = {f"service ({name})": json.loads((folder / "gym_paths_2026-11-27_H100.service.json").read_text())
                ["sections"]["service"]["data"] for name, folder in (("full", full), ("rerun", rerun))}
    by_path, source, superseded = script.rows_per_path(sections, {"service (full)": 0, "service (rerun)": 1})
    assert {k: r["diagnostic"] for k, r in by_path["service"].items()} == {
        "L1_19/legit": "rerun", "L1_19/wrong_dtype": "rerun", "L1_1/legit": "full"}
    assert source["service"] == {"L1_19/legit": 1, "L1_19/wrong_dtype": 1, "L1_1/legit": 0}
    assert superseded == {"service (full)": 2, "service (rerun)": 0}


def test_command_line_order_decides_not_the_folder_names(runs):
    full, rerun = runs
    lines, ok = script.merge([rerun, full], PAIRS)  # the full run given last supersedes the rerun
    header = table_row(lines, "pair")
    cells = dict(zip(header, table_row(lines, "L1_19/legit")))
    assert cells["service"].startswith("reference_error") and cells["eval"].startswith("oom")
    assert not ok
    assert f"- service: 3 pairs from {full}" in "\n".join(lines)


def test_one_folder_per_path_is_unchanged(runs):
    full, _ = runs
    lines, ok = script.merge([full], PAIRS)
    text = "\n".join(lines)
    assert not ok and "Rows per path by folder" not in text and "superseded" not in text
    assert "Pairs run: eval 3/3, pool 3/3, service 3/3" in text
    assert dict(zip(table_row(lines, "pair"), table_row(lines, "L1_19/legit")))["service"].startswith("reference_error")


def test_select_pairs_filters_after_limit_and_stride_and_names_bad_keys():
    assert [p["key"] for p in script.select_pairs(PAIRS, None, 1, None)] == [p["key"] for p in PAIRS]
    assert [p["key"] for p in script.select_pairs(PAIRS, None, 1, "L1_1/legit, L1_19/legit")] == ["L1_19/legit", "L1_1/legit"]
    with pytest.raises(ValueError, match="unknown pair key.*L9_99/nope"):
        script.select_pairs(PAIRS, None, 1, "L1_19/legit,L9_99/nope")
    with pytest.raises(ValueError, match="L1_19/wrong_dtype.*--limit/--stride"):
        script.select_pairs(PAIRS, None, 2, "L1_19/wrong_dtype")
    with pytest.raises(ValueError, match="L1_1/legit.*--limit/--stride"):
        script.select_pairs(PAIRS, 2, 1, "L1_1/legit")


def test_a_path_section_runs_the_chosen_pairs_of_its_shard_and_fails_on_a_wrong_status(monkeypatch):
    monkeypatch.setattr(script, "bank_pairs", lambda size_cap=None: PAIRS)
    ran: list[str] = []

    def fake_eval(pairs, perf_trials, work, report, cli_pairs=3):
        ran.extend(p["key"] for p in pairs)
        return [{"status": "pass", "wall_s": 1.0} for _ in pairs], {}

    monkeypatch.setitem(script.RUNNERS, "eval", fake_eval)
    monkeypatch.setattr(script, "run_eval", fake_eval)
    options = argparse.Namespace(size_cap=None, limit=None, stride=1, pairs="L1_19/wrong_dtype,L1_1/legit", perf_trials=2)
    sections = {s.name: s for s in script.SECTIONS}
    report = script.Report("gym_paths", script.TITLE, {"date": "2026-11-27 10:00 UTC"})
    report.begin("eval0")
    sections["eval0"].run(report, options)
    assert ran == ["L1_19/wrong_dtype"]  # pair 0 of the two chosen: shard 0 of 3
    assert report.failures == ["eval0: pairs without their expected status (table above)"]
    report.begin("eval1")
    sections["eval1"].run(report, options)
    assert ran[1:] == ["L1_1/legit"] and report.data["ok"] and len(report.failures) == 1

    options.pairs = "L9_99/nope"
    with pytest.raises(CheckFailed, match="L9_99/nope"):
        sections["pool"].run(report, options)
