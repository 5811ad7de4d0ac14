"""A candidate's limits (kpipe.gym.confine.limits, issue 52 class 5): the protocol's settings, the judge's
reading of which limit a child hit, the watchdog, and the native-thread count. The attacks
themselves run end to end in tests/test_gym_attack_limits.py."""

from __future__ import annotations

import _thread
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kpipe.gym.candidate.child import side_os_threads, os_threads
from kpipe.gym.judge.evaluation import CHILD_FAILURES
from kpipe.gym.judge.feedback import STATUS_LINES
from kpipe.gym.confine.isolate import ScratchDir
from kpipe.gym.confine.limits import (MiB, CgroupSupport, ChildLimits, Limits, Watchdog, apply_rlimits, cgroup_directory,
                              detect_cgroups, remove_orphaned_cgroups, tree_usage)
from kpipe.gym.protocol import PROTOCOL_VERSION, Protocol
from kpipe.gym.judge.result import STATUSES, EvalResult


def test_every_candidate_has_limits_by_default_and_bad_values_are_refused() -> None:
    protocol = Protocol()
    assert PROTOCOL_VERSION == "kgym-20"
    assert protocol.limits() == Limits(memory_mb=16384, file_size_mb=1024, tasks=1024, disk_mb=4096)
    assert Protocol(memory_limit_mb=None, file_size_limit_mb=None, task_limit=None, disk_limit_mb=None).limits().any() is False
    for name, bad in (("memory_limit_mb", 255), ("file_size_limit_mb", 0), ("task_limit", 15), ("task_limit", 64.0),
                      ("memory_limit_mb", True)):
        with pytest.raises(ValueError, match=name):
            Protocol(**{name: bad})
    assert Protocol.from_json(Protocol(task_limit=64).to_json()).task_limit == 64


def test_a_protocol_written_before_kgym_12_loads_without_limits() -> None:
    written = {k: v for k, v in Protocol().to_dict().items()
               if k not in ("memory_limit_mb", "file_size_limit_mb", "task_limit", "disk_limit_mb")}
    earlier = Protocol.from_dict({**written, "version": "kgym-11"})
    assert earlier.limits() == Limits(None, None, None)
    assert Protocol.from_dict({**written, "version": "kgym-11", "memory_limit_mb": 6000}).memory_limit_mb == 6000


def test_the_limit_status_is_the_judges_alone() -> None:
    assert "resource_limit" in STATUSES and "resource_limit" in STATUS_LINES
    assert "resource_limit" not in CHILD_FAILURES  # a child writing it is judged a forger
    assert EvalResult(key="k", reference_hash="r", candidate_hash="c", status="resource_limit").status == "resource_limit"


def test_rlimits_are_no_core_files_and_the_jobs_file_size() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # in a child: the test process keeps its own limits
        try:
            apply_rlimits({"file_size_mb": 3})
            os.write(write, f"{resource.getrlimit(resource.RLIMIT_CORE)} {resource.getrlimit(resource.RLIMIT_FSIZE)}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 200).decode() == f"(0, 0) ({3 * MiB}, {3 * MiB})"
    os.close(read)


def test_cgroup_paths_resolve_under_their_mount() -> None:
    assert cgroup_directory("/", "/", "/") == "/"
    assert cgroup_directory("/elsewhere", "/sys/fs/cgroup", "/not/under/it") is None
    assert cgroup_directory("/", "/nonexistent-mount", "/a") is None


def test_a_delegated_cgroup_that_cannot_serve_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cgroup.subtree_control").write_text("memory pids\n")  # a plain directory: its children get no limit files
    monkeypatch.setenv("KPIPE_GYM_CGROUP", str(tmp_path))
    with pytest.raises(ValueError, match="KPIPE_GYM_CGROUP=.* is no cgroup v2 directory with memory and pids"):
        detect_cgroups()
    assert list(tmp_path.iterdir()) == [tmp_path / "cgroup.subtree_control"]  # its probe cleaned up


def fake_cgroups(tmp_path: Path, version: int) -> ChildLimits:
    """A ChildLimits over plain directories standing in for cgroup hierarchies."""
    memory, pids = tmp_path / "memory", tmp_path / "pids"
    memory.mkdir()
    pids.mkdir()
    support = CgroupSupport(version, str(memory), str(memory) if version == 2 else str(pids))
    return ChildLimits(Limits(memory_mb=512, file_size_mb=8, tasks=64), support)


@pytest.mark.parametrize("version", [1, 2])
def test_the_judge_reads_which_limit_was_hit_from_the_kernels_counters(tmp_path: Path, version: int) -> None:
    limits = fake_cgroups(tmp_path, version)
    memory, tasks = limits.cgroups["memory"], limits.cgroups["pids"]
    assert limits.job_keys()["limits"]["cgroups"] == sorted({memory, tasks})
    limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
    assert Path(memory, limit_file).read_text() == str(512 * MiB) and Path(tasks, "pids.max").read_text() == "64"
    nothing = lambda size: None  # noqa: E731 - no file at the cap in the scratch
    assert limits.hit(0, nothing) == ""
    if version == 2:
        Path(memory, "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    else:
        Path(memory, "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    Path(tasks, "pids.events").write_text("max 3\n")
    hit = limits.hit(-signal.SIGKILL, nothing)
    assert f"memory: its processes passed the host memory cap of 512 MiB (killed by the kernel, cgroup v{version})" in hit
    assert f"processes: it tried to run more than 64 processes and threads (a fork refused, cgroup v{version})" in hit


def test_the_empty_cgroups_of_a_judge_that_is_gone_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    for name in (f"kpipe-candidate-{gone}-2", f"kpipe-candidate-{os.getpid()}-2", "kpipe-candidate-x-1", "someone-elses"):
        (tmp_path / name).mkdir()
    (tmp_path / f"kpipe-candidate-{gone}-3").mkdir()
    (tmp_path / f"kpipe-candidate-{gone}-3" / "busy").write_text("")  # rmdir fails: left as it is
    remove_orphaned_cgroups(CgroupSupport(2, str(tmp_path), str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"kpipe-candidate-{gone}-3", f"kpipe-candidate-{os.getpid()}-2",
                                                                 "kpipe-candidate-x-1", "someone-elses"])


def test_a_file_at_the_cap_or_death_by_sigxfsz_is_the_file_size_limit(tmp_path: Path) -> None:
    limits = ChildLimits(Limits(memory_mb=None, file_size_mb=1, tasks=None), None)
    scratch = tmp_path / "scratch"
    (scratch / "deep" / "er").mkdir(parents=True)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * (2 * MiB))
    (scratch / "link.bin").symlink_to(outside)  # a link to a big file is not followed
    (scratch / "small.bin").write_bytes(b"x" * 10)
    directory = ScratchDir(scratch)
    try:
        assert limits.hit(0, directory.file_of_size) == ""
        assert "(killed by SIGXFSZ)" in limits.hit(-signal.SIGXFSZ, directory.file_of_size)
        (scratch / "deep" / "er" / "big.bin").write_bytes(b"x" * MiB)
        assert limits.hit(0, directory.file_of_size) == "file size: it wrote past the file size cap of 1 MiB: deep/er/big.bin reached it"
    finally:
        directory.close()


CHILD_TREE = """
import os, sys, time
for _ in range(int(sys.argv[1])):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
hoard = b"x" * (int(sys.argv[2]) << 20)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("children, megabytes, expected", [(20, 1, "processes: it ran more than 16 processes and threads"),
                                                           (0, 300, "memory: its processes passed the host memory cap of 256 MiB")])
def test_the_watchdog_kills_a_tree_past_a_cap_and_says_which(children: int, megabytes: int, expected: str) -> None:
    process = subprocess.Popen([sys.executable, "-c", CHILD_TREE, str(children), str(megabytes)], start_new_session=True)
    killed = threading.Event()

    def kill() -> None:
        os.killpg(process.pid, signal.SIGKILL)
        killed.set()

    watchdog = Watchdog(process.pid, 256, 16, kill)
    watchdog.start()
    try:
        assert process.wait(timeout=60) == -signal.SIGKILL and killed.is_set()
        assert watchdog.record.startswith(expected), watchdog.record
    finally:
        watchdog.stop()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# a process with two side threads and a child process of one thread: four tasks in its tree
THREE_THREADS_AND_A_CHILD = """
import subprocess, sys, threading, time
for _ in range(2):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen(["sleep", "60"])
print("ready", flush=True)
time.sleep(60)
"""


def test_tree_usage_counts_threads_and_resident_memory_of_descendants() -> None:
    """Counted in a tree that holds still (this test process's own threads come and go)."""
    process = subprocess.Popen([sys.executable, "-c", THREE_THREADS_AND_A_CHILD], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        tasks, memory = tree_usage(process.pid)
        assert tasks == 4 and memory > 0
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_thread_started_by_the_low_level_api_is_counted_from_the_kernels_list() -> None:
    before, python_before = os_threads(), set(sys._current_frames())
    name = Path("/proc/self/comm").read_text().strip()
    release = threading.Lock()
    release.acquire()
    _thread.start_new_thread(release.acquire, ())  # lives until released
    python_thread = threading.Thread(target=time.sleep, args=(0.5,))
    python_thread.start()  # seen by threading's own record (and its hook in the child), not counted twice
    try:
        deadline = time.monotonic() + 10
        while not (found := side_os_threads(before, {name}, False, python_before)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(found) == 1 and found[0].startswith("native thread ") and found[0].endswith(f"({name})")
        assert side_os_threads(before, {"another-name"}, False, python_before) == []  # the runtime's helpers name themselves
    finally:
        release.release()
        python_thread.join()


def start_named_thread(name: str, runs_python: bool) -> Callable[[], None]:
    """A low-level thread named `name`, waiting blocked in C with no Python frame (as a native
    thread would) or in a loop of Python; returns what releases it."""
    before = set(os_threads())
    if runs_python:
        release = threading.Event()

        def body() -> None:
            while not release.is_set():
                time.sleep(0.005)

        _thread.start_new_thread(body, ())
        stop = release.set
    else:
        lock = threading.Lock()
        lock.acquire()
        _thread.start_new_thread(lock.acquire, ())  # no Python frame while it waits
        stop = lock.release
    deadline = time.monotonic() + 10
    while not (new := set(os_threads()) - before) and time.monotonic() < deadline:
        time.sleep(0.005)
    Path(f"/proc/self/task/{new.pop()}/comm").write_text(name)  # a thread's name is the process's to set
    return stop


@pytest.mark.parametrize("name, cuda, seen", [("cuda-EvtHandlr", False, True), ("cuda00001400006", False, True),
                                              ("cuda-EvtHandlr", True, True), ("llvm-worker-3", True, False)])
def test_a_thread_renamed_to_pass_for_cudas_is_still_seen(name: str, cuda: bool, seen: bool) -> None:
    """On a CPU no thread is CUDA's; on a GPU the driver's event handler, one a process, was running
    before the candidate (the snapshot holds it here as it does after ``prime_lazy_state``)."""
    before, python_before = os_threads(), set(sys._current_frames())
    before_with_cuda = {**before, -1: "cuda-EvtHandlr"} if cuda else before
    release = start_named_thread(name, runs_python=False)
    try:
        found = side_os_threads(before_with_cuda, {"an-inherited-name"}, cuda, python_before)
        assert bool(found) is seen, found
        if seen:
            assert found[0].endswith(f"({name}, named like a CUDA driver thread)")
    finally:
        release()


def test_a_renamed_thread_running_python_is_seen_whatever_its_name() -> None:
    before, python_before = os_threads(), set(sys._current_frames())
    release = start_named_thread("llvm-worker-0", runs_python=True)
    try:
        deadline = time.monotonic() + 10
        while not (found := side_os_threads(before, {"an-inherited-name"}, True, python_before)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(found) == 1 and found[0].startswith("python thread "), found
    finally:
        release()
