"""A killed run's Snakemake lock (kpipe.infra.run_lock): the same command clears it when the run
that took it is gone, and leaves it, naming the command that clears it, when it cannot tell."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPOSITORY
from kpipe.data.io import read_table
from kpipe.infra import run_lock

TARGET = "decontaminate"  # ingest_tasks, ingest_queries, then decontaminate
# the outputs, in folders named by digests of their config sections (rules/inputs.smk)
OUTPUTS = {"results/tasks/*/tasks.parquet": "tasks", "results/queries/*/queries.parquet": "queries"}
WAIT_S = 300.0


def lock_in(workdir: Path) -> None:
    (workdir / run_lock.LOCK_DIR).mkdir(parents=True)
    (workdir / run_lock.LOCK_DIR / "0.output.lock").write_text("results/tasks/tasks.parquet\n")


def record(workdir: Path, owner: run_lock.Owner) -> None:
    (workdir / run_lock.OWNER_DIR).mkdir(parents=True, exist_ok=True)
    (workdir / run_lock.OWNER_DIR / owner.file_name).write_text(json.dumps(owner.__dict__))


def ended_process() -> run_lock.Owner:
    """The owner record of a process that ran on this host and has ended."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    owner = run_lock.Owner(**{**run_lock.this_process().__dict__, "pid": child.pid,
                              "started": run_lock._process_start(child.pid)})
    child.kill()
    child.wait()
    return owner


def test_a_lock_whose_run_ended_is_removed_with_one_line(tmp_path):
    lock_in(tmp_path)
    record(tmp_path, ended_process())
    message = run_lock.clear_stale_lock(tmp_path)
    assert message.startswith("kpipe: removed Snakemake's stale lock") and "\n" not in message
    assert not run_lock.lock_files(tmp_path)
    # only this process's own record is left
    assert [path.name for path in (tmp_path / run_lock.OWNER_DIR).iterdir()] == [run_lock.this_process().file_name]


def test_a_lock_of_a_living_run_stays(tmp_path):
    lock_in(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record(tmp_path, run_lock.Owner(**{**run_lock.this_process().__dict__, "pid": child.pid,
                                           "started": run_lock._process_start(child.pid)}))
        assert run_lock.clear_stale_lock(tmp_path) == ""
        assert run_lock.lock_files(tmp_path)
    finally:
        child.kill()
        child.wait()


def test_a_reused_pid_counts_as_ended(tmp_path):
    """A record whose pid now names a process started at another time (pid reuse) is stale."""
    lock_in(tmp_path)
    record(tmp_path, run_lock.Owner(**{**run_lock.this_process().__dict__, "pid": os.getppid(), "started": "1"}))
    assert run_lock.clear_stale_lock(tmp_path).startswith("kpipe: removed")


def test_a_lock_of_another_host_or_unrecorded_stays_and_the_command_is_named(tmp_path):
    lock_in(tmp_path)
    record(tmp_path, run_lock.Owner(**{**ended_process().__dict__, "host": "elsewhere"}))
    message = run_lock.clear_stale_lock(tmp_path)
    assert "elsewhere" in message and "`snakemake --unlock`" in message
    assert run_lock.lock_files(tmp_path)
    shutil.rmtree(tmp_path / run_lock.OWNER_DIR)
    assert "`snakemake --unlock`" in run_lock.clear_stale_lock(tmp_path / ".")
    assert run_lock.lock_files(tmp_path)


def test_an_earlier_run_of_a_requeued_slurm_job_counts_as_ended(tmp_path, monkeypatch):
    """A requeued SLURM job may run on another node: its earlier run (a lower SLURM_RESTART_COUNT of
    the same job) has ended there."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock_in(tmp_path)
    record(tmp_path, run_lock.Owner(host="node-a", pid=1, boot_id="x", started="1", slurm_job="4242", slurm_restart=0))
    assert run_lock.clear_stale_lock(tmp_path).startswith("kpipe: removed")
    assert not run_lock.lock_files(tmp_path)


def test_processes_of_a_killed_run_still_running_here_keep_the_lock(tmp_path):
    """The OOM killer ends Snakemake alone: its jobs (their scripts under .snakemake/scripts) may
    still write outputs, so the lock stays until they end."""
    lock_in(tmp_path)
    record(tmp_path, ended_process())
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", ".snakemake/scripts/tmp.job.py"],
                              cwd=tmp_path)
    try:
        message = run_lock.clear_stale_lock(tmp_path)
        assert f"processes {orphan.pid}" in message and run_lock.lock_files(tmp_path)
    finally:
        orphan.kill()
        orphan.wait()
    assert run_lock.clear_stale_lock(tmp_path).startswith("kpipe: removed")


def snakemake_command() -> list[str]:
    return [sys.executable, "-m", "snakemake", TARGET, "--cores", "1"]


def copy_of_workflow(path: Path) -> Path:
    path.mkdir()
    shutil.copytree(REPOSITORY / "workflow", path / "workflow")
    shutil.copytree(REPOSITORY / "config", path / "config")
    return path


def outputs(workdir: Path) -> dict[str, list[dict]]:
    return {pattern: read_table(only(workdir, pattern), table).to_pylist() for pattern, table in OUTPUTS.items()}


def only(workdir: Path, pattern: str) -> Path:
    """The one file of `workdir` that `pattern` matches."""
    (path,) = workdir.glob(pattern)
    return path


@pytest.mark.slow
def test_sigkill_mid_run_then_the_same_command_completes_as_an_uninterrupted_run(tmp_path):
    """SIGKILL of a real run and its jobs (a SLURM time limit, a preemption) once its first job is
    done; the same command then exits 0 with the outputs of an uninterrupted run."""
    killed = copy_of_workflow(tmp_path / "killed")
    process = subprocess.Popen(snakemake_command(), cwd=killed, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.monotonic() + WAIT_S
    while not (list(killed.glob("results/tasks/*/tasks.parquet")) and run_lock.lock_files(killed)):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its first job's output"
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert run_lock.lock_files(killed) and not list(killed.glob("results/queries/*/queries.parquet"))

    rerun = subprocess.run(snakemake_command(), cwd=killed, capture_output=True, text=True)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    assert "kpipe: removed Snakemake's stale lock" in rerun.stderr
    assert not run_lock.lock_files(killed)

    uninterrupted = copy_of_workflow(tmp_path / "uninterrupted")
    subprocess.run(snakemake_command(), cwd=uninterrupted, capture_output=True, check=True)
    assert outputs(killed) == outputs(uninterrupted)
