"""``kpipe gym eval-batch``: both input forms, an evals table out, and resumption — a run
killed halfway, then rerun, evaluates only what the first one did not finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from kpipe.data.io import read_table
from kpipe.data.kernelbench import select_problems, shrink_sizes
from kpipe.gym.bank import solutions_for
from kpipe.gym.serve.cache import ResultCache
from kpipe.gym.serve.scale_cli import eval_batch_command

REFERENCE = shrink_sizes(select_problems("main", [1], {1: [19]})[0].code, 48)
LEGIT = next(s.source for s in solutions_for(1, 19) if s.variant == "legit")
WRONG = next(s.source for s in solutions_for(1, 19) if s.variant == "wrong_index")
PROTOCOL = {"correct_trials": 2, "perf_trials": 3, "warmup": 1, "baseline": "eager", "device": "cpu", "timeout_s": 60}


def variants(count: int) -> list[str]:
    return [f"{LEGIT if i % 3 else WRONG}\n# candidate {i}\n" for i in range(count)]


def batch_args(tmp_path: Path, input_path: Path, output: Path) -> list[str]:
    protocol = tmp_path / "protocol.json"
    protocol.write_text(json.dumps(PROTOCOL))
    return ["--input", str(input_path), "--output", str(output), "--cache", str(tmp_path / "cache.sqlite"),
            "--protocol", str(protocol), "--workers", "1", "--quiet"]


def test_task_id_and_code_input_gives_one_evals_row_per_input_row(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.parquet"
    pq.write_table(pa.table({"task_id": ["t19"], "reference_src": [REFERENCE]}), tasks)
    candidates = tmp_path / "cands.parquet"
    pq.write_table(pa.table({"task_id": ["t19", "t19", "t19"], "code": [LEGIT, None, LEGIT], "turn": [1, 2, 3]}), candidates)
    output = tmp_path / "evals.parquet"
    run = CliRunner().invoke(eval_batch_command, batch_args(tmp_path, candidates, output) + ["--references", str(tasks)])
    assert run.exit_code == 0, run.output
    assert "3 rows, 2 unique: 0 from the cache, 2 evaluated" in run.output
    rows = read_table(output, "evals").to_pylist()
    assert [r["status"] for r in rows] == ["pass", "format_error", "pass"]
    assert rows[0]["key"] == rows[2]["key"]


def test_bad_input_is_a_usage_error(tmp_path: Path) -> None:
    candidates = tmp_path / "cands.parquet"
    pq.write_table(pa.table({"task_id": ["t19"], "code": [LEGIT]}), candidates)
    run = CliRunner().invoke(eval_batch_command, batch_args(tmp_path, candidates, tmp_path / "o.parquet"))
    assert run.exit_code == 2 and "--references" in run.output


def test_killed_batch_resumes_with_only_the_missing_evaluations(tmp_path: Path) -> None:
    candidates = tmp_path / "cands.parquet"
    sources = variants(8)
    pq.write_table(pa.table({"reference_src": [REFERENCE] * 8, "candidate_src": sources}), candidates)
    output = tmp_path / "evals.parquet"
    args = batch_args(tmp_path, candidates, output)
    code = "import sys; from kpipe.gym.serve.scale_cli import eval_batch_command; eval_batch_command(sys.argv[1:])"
    first = subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cache = ResultCache(tmp_path / "cache.sqlite")
    deadline = time.monotonic() + 240
    while len(cache) < 3 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)  # its workers (own sessions) see the pipe close and exit
    first.wait()
    done_before = len(cache)
    assert 3 <= done_before < 8 and not output.exists()

    run = CliRunner().invoke(eval_batch_command, args)
    assert run.exit_code == 0, run.output
    assert f"8 rows, 8 unique: {done_before} from the cache, {8 - done_before} evaluated" in run.output
    rows = read_table(output, "evals").to_pylist()
    assert [r["status"] for r in rows] == ["mismatch" if i % 3 == 0 else "pass" for i in range(8)]
    assert len(cache) == 8
