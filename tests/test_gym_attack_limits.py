"""Hostile candidates that go after the machine's resources (issue 52, class 5): memory past the cap,
a huge file in the scratch directory, a swarm of processes, a thread started with the low-level
thread API. Each runs for real through ``kpipe gym eval`` (a fresh interpreter per child) and
``kpipe gym eval-batch`` (the pool's zygote), with an honest kernel after every attack in the batch,
and must end with the judge's status naming its limit, never ``pass``.

Every attack is bounded by itself (twice the memory cap, 256 MiB, 300 sleeping processes) so that a limit that
failed costs this machine little; the protocol's caps are smaller. The memory and process attacks
run again with the judge's watchdog in place of cgroups (``KPIPE_GYM_NO_CGROUP=1``): where no
cgroup can be made, that is what bounds them. ``checks/gpu/confinement.py`` runs this file on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "gym"
RELU_REFERENCE = (FIXTURES / "relu_reference.py").read_text()
LEGIT = (FIXTURES / "relu_legit.py").read_text()

DEVICE = os.environ.get("KPIPE_TEST_GYM_DEVICE", "cpu")
# an honest child's tree holds 0.25-0.7 GiB on the CPU as the watchdog counts it (a forked child's pages
# shared with its sandbox's waiter and init count once each); a CUDA context adds its own
MEMORY_CAP_MB = 2048 if DEVICE == "cpu" else 8192
PROTOCOL = {"correct_trials": 2, "perf_trials": 3, "warmup": 0, "baseline": "eager", "timeout_s": 120, "reject_findings": [],
            "device": DEVICE, "memory_limit_mb": MEMORY_CAP_MB, "file_size_limit_mb": 64, "task_limit": 128}

# each attack is the honest kernel (relu_legit.py) with the attack at its import: only its limit stops it passing
ATTACKS = {
    "allocates_past_the_memory_cap": LEGIT + '''
hoard = [b"x" * (64 << 20) for _ in range(HOARD_BLOCKS)]  # twice the cap, every page written
'''.replace("HOARD_BLOCKS", str(2 * MEMORY_CAP_MB // 64)),
    "writes_a_huge_file": LEGIT + '''
with open("big.bin", "wb") as handle:
    for _ in range(4):  # 256 MiB
        handle.write(b"x" * (64 << 20))
''',
    "ignores_sigxfsz_and_carries_on": LEGIT + '''
import signal

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
try:
    with open("big.bin", "wb") as handle:
        for _ in range(4):
            handle.write(b"x" * (64 << 20))
except OSError:
    pass
''',
    "starts_many_processes": LEGIT + '''
import os

try:
    for _ in range(300):
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "60"])
except OSError:
    pass
''',
    "starts_a_native_thread": LEGIT + '''
import _thread
import time

_thread.start_new_thread(time.sleep, (3600,))  # not a threading.Thread: threading.enumerate() never lists it
''',
}
EXPECTED = {  # the status each attack must end with and what its diagnostic or reasons must say
    "allocates_past_the_memory_cap": ("resource_limit", f"memory: its processes passed the host memory cap of {MEMORY_CAP_MB} MiB"),
    "writes_a_huge_file": ("resource_limit", "file size: it wrote past the file size cap of 64 MiB"),
    "ignores_sigxfsz_and_carries_on": ("resource_limit", "file size: it wrote past the file size cap of 64 MiB: big.bin reached it"),
    "starts_many_processes": ("resource_limit", "processes: it"),
    "starts_a_native_thread": ("hacked", "side_thread: started thread(s) native thread"),
}
WATCHED = ("allocates_past_the_memory_cap", "starts_many_processes")  # again under the judge's watchdog


def kpipe_gym(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kpipe.cli", "gym", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


def verdict_text(result: dict[str, object]) -> str:
    reasons = result.get("hack_reasons") or []
    reasons = reasons if isinstance(reasons, list) else json.loads(str(reasons))
    return " | ".join([str(result.get("diagnostic", "")), *reasons])


def assert_judged(name: str, result: dict[str, object]) -> None:
    status, text = EXPECTED[name]
    assert result["status"] == status and text in verdict_text(result), f"{name}: {json.dumps(result, default=str)[:3000]}"


def evaluate_once(tmp_path: Path, source: str, env: dict[str, str] | None = None) -> dict[str, object]:
    (tmp_path / "reference.py").write_text(RELU_REFERENCE)
    (tmp_path / "candidate.py").write_text(source)
    (tmp_path / "protocol.json").write_text(json.dumps(PROTOCOL))
    run = kpipe_gym("eval", "--reference", str(tmp_path / "reference.py"), "--candidate", str(tmp_path / "candidate.py"),
                    "--protocol", str(tmp_path / "protocol.json"), "--json", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_limit_holds_through_kpipe_gym_eval(tmp_path: Path, name: str) -> None:
    assert_judged(name, evaluate_once(tmp_path, ATTACKS[name]))


@pytest.mark.parametrize("name", WATCHED)
def test_the_judges_watchdog_holds_where_no_cgroup_is_made(tmp_path: Path, name: str) -> None:
    assert_judged(name, evaluate_once(tmp_path, ATTACKS[name], env={"KPIPE_GYM_NO_CGROUP": "1"}))


def test_every_limit_holds_through_the_pool_and_each_next_honest_kernel_passes(tmp_path: Path) -> None:
    names = sorted(ATTACKS)
    batch = [source for name in names for source in (ATTACKS[name], LEGIT)]
    pq.write_table(pa.table({"reference_src": [RELU_REFERENCE] * len(batch), "candidate_src": batch}), tmp_path / "candidates.parquet")
    (tmp_path / "protocol.json").write_text(json.dumps(PROTOCOL))
    run = kpipe_gym("eval-batch", "--input", str(tmp_path / "candidates.parquet"), "--output", str(tmp_path / "evals.parquet"),
                    "--protocol", str(tmp_path / "protocol.json"), "--workers", "1", "--cache", str(tmp_path / "cache.sqlite"),
                    "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = pq.read_table(tmp_path / "evals.parquet").to_pylist()
    assert len(rows) == len(batch)
    for index, name in enumerate(names):
        attacked, honest = rows[2 * index], rows[2 * index + 1]
        assert_judged(name, attacked)
        assert honest["status"] == "pass", f"the honest kernel after {name}: {honest['status']} {honest['diagnostic']}"

