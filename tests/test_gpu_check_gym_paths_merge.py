"""scripts/gpu_check_gym_paths.py: --merge of a full run with a later rerun of some pairs, and --pairs.

The folders here are fake $OUT folders with gym_paths_*.json in the structure the script writes
(see docs/gpu-results/gym_paths_2026-11-25_H100/): a section dict with path, column, ok, rows
(each row with pair, status, diagnostic, ...) and figures; an eval section that ran out of time
as a .partial file holding the rows alone. No GPU, no bank, no KernelBench data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


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


def write(folder: Path, stem: str, data) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"gym_paths_{stem}.json").write_text(json.dumps(data))


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
    write(full, "eval_0of2", section("eval", eval0, expected) | {"cli_pairs": 1})
    write(full, "eval_0of2.partial", eval0)  # superseded by the finished section in the same folder
    write(full, "eval_1of2.partial", [row("L1_19/wrong_dtype", "mismatch", "full")])  # ran out of time
    write(rerun, "service", section("service", [row("L1_19/legit", "pass", "rerun"), row("L1_19/wrong_dtype", "mismatch", "rerun")], expected))
    write(rerun, "eval_0of1.partial", [row("L1_19/legit", "pass", "rerun")])
    return full, rerun


def table_row(lines: list[str], key: str) -> list[str]:
    [line] = [line for line in lines if line.startswith(f"| {key} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_later_folder_supersedes_rerun_pairs_and_keeps_the_rest(load_script, runs):
    script = load_script("gpu_check_gym_paths")
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
    sections = {"service (full)": json.loads((full / "gym_paths_service.json").read_text()),
                "service (rerun)": json.loads((rerun / "gym_paths_service.json").read_text())}
    by_path, source, superseded = script.rows_per_path(sections, {"service (full)": 0, "service (rerun)": 1})
    assert {k: r["diagnostic"] for k, r in by_path["service"].items()} == {
        "L1_19/legit": "rerun", "L1_19/wrong_dtype": "rerun", "L1_1/legit": "full"}
    assert source["service"] == {"L1_19/legit": 1, "L1_19/wrong_dtype": 1, "L1_1/legit": 0}
    assert superseded == {"service (full)": 2, "service (rerun)": 0}


def test_command_line_order_decides_not_the_folder_names(load_script, runs):
    script = load_script("gpu_check_gym_paths")
    full, rerun = runs
    lines, ok = script.merge([rerun, full], PAIRS)  # the full run given last supersedes the rerun
    header = table_row(lines, "pair")
    cells = dict(zip(header, table_row(lines, "L1_19/legit")))
    assert cells["service"].startswith("reference_error") and cells["eval"].startswith("oom")
    assert not ok
    assert f"- service: 3 pairs from {full}" in "\n".join(lines)


def test_one_folder_per_path_is_unchanged(load_script, runs):
    script = load_script("gpu_check_gym_paths")
    full, _ = runs
    lines, ok = script.merge([full], PAIRS)
    text = "\n".join(lines)
    assert not ok and "Rows per path by folder" not in text and "superseded" not in text
    assert "Pairs run: eval 3/3, pool 3/3, service 3/3" in text
    assert dict(zip(table_row(lines, "pair"), table_row(lines, "L1_19/legit")))["service"].startswith("reference_error")


def test_select_pairs_filters_after_limit_and_stride_and_names_bad_keys(load_script):
    script = load_script("gpu_check_gym_paths")
    assert [p["key"] for p in script.select_pairs(PAIRS, None, 1, None)] == [p["key"] for p in PAIRS]
    assert [p["key"] for p in script.select_pairs(PAIRS, None, 1, "L1_1/legit, L1_19/legit")] == ["L1_19/legit", "L1_1/legit"]
    with pytest.raises(ValueError, match="unknown pair key.*L9_99/nope"):
        script.select_pairs(PAIRS, None, 1, "L1_19/legit,L9_99/nope")
    with pytest.raises(ValueError, match="L1_19/wrong_dtype.*--limit/--stride"):
        script.select_pairs(PAIRS, None, 2, "L1_19/wrong_dtype")
    with pytest.raises(ValueError, match="L1_1/legit.*--limit/--stride"):
        script.select_pairs(PAIRS, 2, 1, "L1_1/legit")


def test_pairs_on_the_command_line(load_script, monkeypatch, capsys, tmp_path):
    script = load_script("gpu_check_gym_paths")
    monkeypatch.setattr(script, "bank_pairs", lambda limit: PAIRS[:limit] if limit else PAIRS)
    monkeypatch.setattr(script, "gpus", lambda: [])
    monkeypatch.setattr(sys, "argv", ["gpu_check_gym_paths.py", "--pairs", "L1_19/legit,L9_99/nope", "--dry-run"])
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert exit_.value.code == 2 and "L9_99/nope" in capsys.readouterr().err

    monkeypatch.setattr(sys, "argv", ["gpu_check_gym_paths.py", "--sections", "pool+eval:0/2", "--pairs", "L1_19/legit,L1_1/legit", "--dry-run"])
    script.main()
    out = capsys.readouterr().out
    assert "2 bank pairs" in out and "pool (2 pairs)" in out and "eval:0/2 (1 pairs)" in out

    # lanes: every lane's process gets the same --pairs
    started = []

    class Lane:
        returncode = 0

        def __init__(self, command, env):
            started.append(command)

        def wait(self):
            return 0

    monkeypatch.setattr(script.subprocess, "Popen", Lane)
    monkeypatch.setattr(script.gpu_harness, "cold_caches", lambda move_home=True: {})
    monkeypatch.setattr(script.tempfile, "mkdtemp", lambda prefix="": str(tmp_path / "work"))
    (tmp_path / "work").mkdir()
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(sys, "argv", ["gpu_check_gym_paths.py", "--sections", "pool+service", "--pairs", "L1_1/legit"])
    with pytest.raises(SystemExit):
        script.main()
    assert len(started) == 2
    assert all(c[c.index("--pairs") + 1] == "L1_1/legit" for c in started)
