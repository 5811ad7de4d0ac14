"""How the attack tests run their hostile candidates, each path in a process of its own as users
start it: ``kpipe gym eval`` (a fresh interpreter per child) and ``kpipe gym eval-batch`` (the pool:
children forked from its worker's zygote, an honest kernel after every attack). One helper per
path, so that every attack file judges its candidates the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

FIXTURES = Path(__file__).parent / "fixtures" / "gym"
RELU_REFERENCE = (FIXTURES / "relu_reference.py").read_text()
LEGIT = (FIXTURES / "relu_legit.py").read_text()
DEVICE = os.environ.get("KPIPE_TEST_GYM_DEVICE", "cpu")  # checks/gpu/confinement.py sets cuda


def kpipe_gym(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`kpipe gym ARGS` with `env` over this process's environment."""
    return subprocess.run([sys.executable, "-m", "kpipe.cli", "gym", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def evaluate_fresh(tmp_path: Path, candidate: str, protocol: dict[str, Any], env: dict[str, str] | None = None,
                   reference: str = RELU_REFERENCE) -> dict[str, Any]:
    """One candidate through ``kpipe gym eval``: its result row."""
    (tmp_path / "reference.py").write_text(reference)
    (tmp_path / "candidate.py").write_text(candidate)
    (tmp_path / "protocol.json").write_text(json.dumps(protocol))
    run = kpipe_gym("eval", "--reference", str(tmp_path / "reference.py"), "--candidate", str(tmp_path / "candidate.py"),
                    "--protocol", str(tmp_path / "protocol.json"), "--json", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def evaluate_pool(tmp_path: Path, candidates: list[str], protocol: dict[str, Any], env: dict[str, str] | None = None,
                  reference: str = RELU_REFERENCE) -> list[dict[str, Any]]:
    """Candidates in order through ``kpipe gym eval-batch`` with one worker: their result rows."""
    table = pa.table({"reference_src": [reference] * len(candidates), "candidate_src": candidates})
    pq.write_table(table, tmp_path / "candidates.parquet")
    (tmp_path / "protocol.json").write_text(json.dumps(protocol))
    run = kpipe_gym("eval-batch", "--input", str(tmp_path / "candidates.parquet"), "--output", str(tmp_path / "evals.parquet"),
                    "--protocol", str(tmp_path / "protocol.json"), "--workers", "1", "--cache", str(tmp_path / "cache.sqlite"),
                    "--quiet", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = pq.read_table(tmp_path / "evals.parquet").to_pylist()
    assert len(rows) == len(candidates)
    return rows


def evaluate_each_then_honest(tmp_path: Path, attacks: dict[str, str], protocol: dict[str, Any],
                              env: dict[str, str] | None = None, reference: str = RELU_REFERENCE,
                              honest: str = LEGIT) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every attack through one pool, each followed by the honest kernel: name -> (the attack's row,
    the next honest kernel's row), so a test sees whether an attack hurt the worker that judged it."""
    names = sorted(attacks)
    rows = evaluate_pool(tmp_path, [source for name in names for source in (attacks[name], honest)], protocol, env, reference)
    return {name: (rows[2 * index], rows[2 * index + 1]) for index, name in enumerate(names)}


def reasons_of(result: dict[str, Any]) -> str:
    """A result's hack reasons as one line (a list in a result, JSON text in a Parquet row)."""
    reasons = result.get("hack_reasons") or []
    return " | ".join(reasons if isinstance(reasons, list) else json.loads(str(reasons)))


def resource_attacks(memory_cap_mb: int) -> dict[str, str]:
    """Issue 52's class 5: code a candidate runs at its import to go after the machine's resources.
    Each is bounded by itself (twice the memory cap, 256 MiB of file, 300 sleeping processes), so a
    limit that failed costs the test machine little; the protocols' caps are smaller."""
    huge_file = '''
with open("big.bin", "wb") as handle:
    for _ in range(4):  # 256 MiB
        handle.write(b"x" * (64 << 20))
'''
    return {
        "allocates_past_the_memory_cap": f'''
hoard = [b"x" * (64 << 20) for _ in range({2 * memory_cap_mb // 64})]  # twice the cap, every page written
''',
        "writes_a_huge_file": huge_file,
        "ignores_sigxfsz_and_carries_on": '''
import signal

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
try:
''' + huge_file.replace("\n", "\n    ").rstrip() + '''
except OSError:
    pass
''',
        "starts_many_processes": '''
import os

try:
    for _ in range(300):
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "60"])
except OSError:
    pass
''',
        "starts_a_native_thread": '''
import _thread
import time

_thread.start_new_thread(time.sleep, (3600,))  # not a threading.Thread: threading.enumerate() never lists it
''',
    }
