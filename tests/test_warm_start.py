"""kpipe.infra.warm_start: a forked job is its Snakemake job (output, environment, directory, exit
status), dies with it, and the starter ends with its run (the DAG tests run sft and RL through it)."""

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kpipe.infra import warm_start
from kpipe.infra.process import process_start

FAST = ("click",)  # the tests' starter imports little: what is forked is the same either way


def starter_pid(path: Path) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(path))
        return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process_start(pid) is None:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def starter(tmp_path, monkeypatch):
    path = warm_start.start(tmp_path / "run", os.getpid(), FAST)
    monkeypatch.setenv(warm_start.WARM_START_ENV, str(path))
    yield path
    pid = starter_pid(path)
    warm_start.stop(tmp_path / "run")
    assert gone(pid), "the starter outlived its stop request"


def test_a_forked_job_has_the_jobs_output_environment_directory_and_exit_status(starter, tmp_path, monkeypatch):
    monkeypatch.setenv("KPIPE_TEST_MARK", "from-the-job")
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        code = warm_start.run_job(warm_start.connect(), ["gpu", "run", "-n", "0", "--", "sh", "-c",
                                                         "echo $KPIPE_TEST_MARK; pwd; exit 3"], out.fileno())
    assert code == 3
    assert log.read_text().split() == ["from-the-job", str(tmp_path)]


def test_a_job_whose_client_is_killed_is_killed_with_it(starter, tmp_path):
    """Snakemake cancelling a job kills its process (the client): the work must not go on."""
    pid_file = tmp_path / "work.pid"
    client = subprocess.Popen([sys.executable, "-c", (
        "import sys; from kpipe.infra import warm_start; "
        f"sys.exit(warm_start.run_job(warm_start.connect(), ['gpu', 'run', '-n', '0', '--', 'sh', '-c', "
        f"'echo $$ > {pid_file}; sleep 60'], 1))")], env=os.environ)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    work = int(pid_file.read_text())
    assert process_start(work) is not None
    client.send_signal(signal.SIGKILL)
    client.wait()
    assert gone(work), "the job's work outlived its killed Snakemake job"


def test_the_starter_ends_with_its_run_and_without_one_jobs_start_the_usual_way(tmp_path, monkeypatch):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = warm_start.start(tmp_path / "run", owner.pid, FAST)
    pid = starter_pid(path)
    owner.kill()
    owner.wait()
    assert gone(pid), "the starter outlived the run (its owner)"
    monkeypatch.setenv(warm_start.WARM_START_ENV, str(path))
    assert warm_start.connect() is None
    monkeypatch.delenv(warm_start.WARM_START_ENV)
    assert warm_start.connect() is None



def test_a_job_that_needs_no_wait_is_forked_only_once_the_starter_is_done_importing(tmp_path, monkeypatch):
    """``connect(ready_only=True)`` (an evaluation's job, kpipe.infra.launch.job_function): a
    starter still importing its preload at the run's start is not waited for."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "kpipe_test_slow_module.py").write_text("import time\ntime.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    path = warm_start.start(tmp_path / "run", os.getpid(), ("kpipe_test_slow_module",))
    monkeypatch.setenv(warm_start.WARM_START_ENV, str(path))
    try:
        assert warm_start.connect(ready_only=True) is None  # still importing
        deadline = time.monotonic() + 60
        while not warm_start.ready_path(path).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        conn = warm_start.connect(ready_only=True)
        assert conn is not None
        with open(tmp_path / "job.log", "w") as out:
            assert warm_start.run_job(conn, ["gpu", "run", "-n", "0", "--", "true"], out.fileno()) == 0
    finally:
        warm_start.stop(tmp_path / "run")
    assert not warm_start.ready_path(path).exists()


def test_a_job_function_runs_in_its_snakemake_job_when_no_starter_is_ready(tmp_path, monkeypatch):
    """``job_function`` without a warm starter: the function runs in the job's own process,
    logged to the rule's log as every script's body is (kpipe.infra.jobs.snakemake_job)."""
    from types import SimpleNamespace

    from kpipe.infra.launch import job_function

    monkeypatch.delenv(warm_start.WARM_START_ENV, raising=False)
    log = tmp_path / "rule.log"
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")  # the user's: snakemake_job keeps it (and the test's process its own)
    smk = SimpleNamespace(log=[str(log)], resources=SimpleNamespace(gpu_slots=0), config={"gpu": {"slots_per_gpu": 8}},
                          rule="eval", threads=1)
    made = tmp_path / "made.txt"
    job_function(smk, shutil.copyfile, __file__, str(made))  # no starter: called here
    with pytest.raises(TypeError):  # JSON values only, starter or not: a job runs alike either way
        job_function(smk, shutil.copyfile, Path(__file__), made)
    assert made.read_text() == Path(__file__).read_text()
    assert os.environ["RAYON_NUM_THREADS"] == "3"
    assert "rule eval: 0 of 8 GPU slot(s)" in log.read_text()


def test_kpipe_job_runs_a_function_on_its_json_arguments(tmp_path):
    """What a warm-started job runs: ``kpipe job MODULE:FUNCTION CALL``."""
    import json

    from click.testing import CliRunner

    from kpipe.cli import main

    target = tmp_path / "made.txt"
    result = CliRunner().invoke(main, ["job", "shutil:copyfile", json.dumps({"args": [__file__, str(target)], "kwargs": {}})])
    assert result.exit_code == 0, result.output
    assert target.read_text() == Path(__file__).read_text()
