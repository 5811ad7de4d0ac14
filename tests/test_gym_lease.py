"""The timing lease (kpipe.gym.confine.lease): evaluations share a device, their timed regions never
overlap — within a pool of several workers, and between processes that share the machine."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path

import pytest

from kpipe.data.kernelbench import select_problems, shrink_sizes
from kpipe.gym import Protocol
from kpipe.gym.bank import solutions_for
from kpipe.gym.confine.lease import LEASE_DIR_VARIABLE, ChildPauser, LeaseTimeout, TimingLease, lease_key
from kpipe.gym.serve.pool import GymPool, default_slots
from kpipe.gym.judge.result import EvalResult

REFERENCE = shrink_sizes(select_problems("main", [1], {1: [19]})[0].code, 48)
LEGIT = next(s.source for s in solutions_for(1, 19) if s.variant == "legit")
# long timed regions (each timed call sleeps), so that two children timed at once would overlap
SLOW = LEGIT + '''

import time as _time


class ModelNew(ModelNew):
    def forward(self, x):
        _time.sleep(0.05)
        return super().forward(x)
'''
PROTOCOL = Protocol(correct_trials=1, perf_trials=4, warmup=1, baseline="eager", device="cpu", timeout_s=60, reject_findings=())


def hold_for(lock_dir: str, seconds: float, held: multiprocessing.synchronize.Event) -> None:
    with TimingLease("dev", 5.0, Path(lock_dir)).hold():
        held.set()
        time.sleep(seconds)


def test_a_second_holder_waits_for_the_first_and_gives_up_past_its_bound(tmp_path: Path) -> None:
    held = multiprocessing.get_context("spawn").Event()
    other = multiprocessing.get_context("spawn").Process(target=hold_for, args=(str(tmp_path), 1.0, held))
    other.start()
    try:
        assert held.wait(30)
        with pytest.raises(LeaseTimeout, match="not free within 0.1 s"):
            with TimingLease("dev", 0.1, tmp_path).hold():
                pass
        with TimingLease("dev", 30.0, tmp_path).hold() as held_lease:
            assert held_lease.waited_s > 0.1  # it had to wait for the other process's release
        with TimingLease("another device", 0.1, tmp_path).hold() as held_lease:
            assert held_lease.waited_s < 0.1
    finally:
        other.join()


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_child_is_stopped_while_another_holds_the_lease_and_resumed_for_its_own(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"], start_new_session=True)
    lease = TimingLease("dev", 5.0, tmp_path)
    pauser = ChildPauser(child.pid, lease)
    pauser.start()
    held = multiprocessing.get_context("spawn").Event()
    other = multiprocessing.get_context("spawn").Process(target=hold_for, args=(str(tmp_path), 1.0, held))
    try:
        time.sleep(0.2)
        assert state(child.pid) != "T" and pauser.paused_s() == 0.0  # the lease is free
        other.start()
        assert held.wait(30)
        time.sleep(0.2)
        assert state(child.pid) == "T"  # another child times: this one is stopped
        other.join()
        time.sleep(0.2)
        assert state(child.pid) != "T" and 0.5 < pauser.paused_s() < 1.5  # resumed; its deadline moves by as much
        with lease.hold():
            pauser.take_over()
            time.sleep(0.2)
            assert state(child.pid) != "T"  # its own judge holds the lease: it runs
    finally:
        pauser.finish()
        child.kill()
        child.wait()


def test_a_device_is_named_by_its_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lease_key(None) == "cpu"
    assert lease_key("GPU-8f2c") == "GPU-8f2c"
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert lease_key("3") == "gpu3"


def test_a_pool_runs_several_workers_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert default_slots(None, per_gpu=3) == ["0", "0", "0", "1", "1", "1"]
    assert default_slots(1, per_gpu=2) == ["0", "0"]


def overlaps(spans: list[tuple[float, float]]) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    return [(a, b) for a, b in combinations(sorted(spans), 2) if b[0] < a[1]]


def test_evaluations_overlap_but_their_timed_regions_do_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEASE_DIR_VARIABLE, str(tmp_path / "leases"))
    monkeypatch.setenv("KPIPE_GYM_TRACE", str(tmp_path / "trace.jsonl"))
    jobs = [(REFERENCE, f"{SLOW}\n# variant {i}\n") for i in range(4)]
    with GymPool(PROTOCOL, workers=2, progress=False, reuse_reference=False) as pool:
        deadline = time.monotonic() + 120
        while not all(worker["alive"] for worker in pool.workers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        results = pool.evaluate_many(jobs)
    assert all(isinstance(r, EvalResult) and r.status == "pass" for r in results), [getattr(r, "diagnostic", r) for r in results]
    timed = [(start, end) for r in results for start, end in r.timed_spans]
    assert len(timed) >= 2 * len(jobs)  # every reference's and candidate's timed region
    assert overlaps(timed) == []
    traces = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    evaluations = [(t["started_unix"], t["started_unix"] + t["wall_s"]) for t in traces]
    assert overlaps(evaluations), "the two workers never evaluated at once: the test shows nothing"


def test_a_child_keeps_its_device_until_it_has_exited_and_lets_the_others_run_after_its_windows(tmp_path: Path) -> None:
    """A context's teardown is GPU work: a timing child's exit must not run beside the next one's
    timed region, so its judge releases the device only once the child is gone. Its windows are the
    last thing it times, so the timing part (which stops every other child) ends when the last is answered."""
    import threading

    from kpipe.gym.judge.evaluation import run_reference
    from kpipe.gym.confine.isolate import fresh_interpreter
    from kpipe.gym.confine.lease import DEVICE_BYTE

    lease = TimingLease("dev", 60.0, tmp_path)
    pids: list[int] = []

    def launch(*args):  # type: ignore[no-untyped-def]
        proc, streams = fresh_interpreter(*args)
        pids.append(proc.pid)
        return proc, streams

    seen: dict[str, bool] = {}
    done = threading.Event()

    def watch() -> None:
        fd = lease.open_file()
        while not done.is_set():
            timing, device = lease.held_elsewhere(fd), lease.held_elsewhere(fd, DEVICE_BYTE)
            if timing:
                seen["timing held"] = True
            elif seen.get("timing held") and "child alive when timing ended" not in seen:
                seen["child alive when timing ended"] = Path(f"/proc/{pids[0]}").exists()
                seen["device held when timing ended"] = device
            if device:
                seen["device held"] = True
            elif seen.get("device held"):
                seen["child alive at release"] = Path(f"/proc/{pids[0]}").exists()
                return
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        payload, ran = run_reference(REFERENCE, PROTOCOL, "cpu", False, launch, lease)
    finally:
        done.set()
        watcher.join()
    assert ran and payload["status"] == "ok" and payload["windows"]
    assert seen == {"timing held": True, "device held": True, "child alive when timing ended": True,
                    "device held when timing ended": True, "child alive at release": False}


def play_window_child(directory: Path, rounds: int, answer: bytes) -> None:
    """The child's side of the windows' exchange: ready, wait for the seed, answer; then wait for
    the judge's next word (a stop) as a child that was told to stop early does."""
    from kpipe.gym.exchange import WINDOW_ANSWER_FILE, WINDOW_FILE, WINDOW_READY_FILE

    for index in range(rounds):
        (directory / WINDOW_READY_FILE.format(round=index)).write_bytes(b"")
        while not (directory / WINDOW_FILE.format(round=index)).exists():
            time.sleep(0.0005)
        staged = directory / f"staged-{index}"
        staged.write_bytes(answer)
        staged.rename(directory / WINDOW_ANSWER_FILE.format(round=index))


@pytest.mark.parametrize("rounds, stop_after", [(1, None), (3, 0), (2, None)])
def test_the_judge_lets_the_others_run_once_the_last_answer_is_there_before_reading_it(
        tmp_path: Path, rounds: int, stop_after: int | None) -> None:
    """The timing part of the lease stops every other child on the device. Once the last window is
    answered (the last of all, or one the judge finds enough) the child times nothing more, so the
    judge ends the timing part before it reads that answer (up to 64 MiB) and before it tells the
    child to stop; earlier rounds are read with the timing part still held."""
    import threading

    from kpipe.gym.confine.isolate import ScratchDir, Windows, ask_windows
    from kpipe.gym.exchange import WINDOW_ANSWER_FILE, WINDOW_FILE

    answer = b"answer" * 1000
    seeds = tuple(range(1, rounds + 1))
    last = rounds - 1 if stop_after is None else stop_after
    read_before_timing_done: list[str] = []
    directory = ScratchDir(tmp_path)
    reads = directory.read

    def read(name: str, max_bytes: int) -> bytes | None:
        if not ended and name.startswith("window-") and name.endswith(".safetensors"):
            read_before_timing_done.append(name)
        return reads(name, max_bytes)

    directory.read = read  # type: ignore[method-assign]
    ended: list[tuple[bool, bool]] = []

    def timing_done() -> None:
        ended.append(((tmp_path / WINDOW_ANSWER_FILE.format(round=last)).exists(),
                      (tmp_path / WINDOW_FILE.format(round=last + 1)).exists()))

    enough = None if stop_after is None else (lambda answered, answered_bytes: answered == stop_after + 1)
    child = threading.Thread(target=play_window_child, args=(tmp_path, last + 1, answer))
    child.start()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        answers, seconds, _ = ask_windows(proc, directory, lambda: time.monotonic() + 30,
                                         Windows(seeds=seeds, calls=2, enough=enough), 1 << 20, timing_done)
    finally:
        proc.kill()
        proc.wait()
        child.join()
        directory.close()
    assert answers == [answer] * (last + 1) and seconds is not None and len(seconds) == last + 1
    assert ended == [(True, False)]  # once, with the last answer there and no stop written yet
    assert read_before_timing_done == [WINDOW_ANSWER_FILE.format(round=index) for index in range(last)]
    assert (tmp_path / WINDOW_FILE.format(round=last + 1)).exists() == (stop_after is not None)


def test_a_long_wait_for_the_lease_is_taken_off_the_childs_wall_time_once(tmp_path: Path) -> None:
    """The child waits at its gate while another holds the lease, and its pauser stops it for the
    same seconds: counted twice, a long wait left a wall time shorter than the child's own timed
    trials, and honest kernels were judged timing_inconsistent on a busy GPU."""
    from kpipe.gym.confine.isolate import run_isolated

    held = multiprocessing.get_context("spawn").Event()
    other = multiprocessing.get_context("spawn").Process(target=hold_for, args=(str(tmp_path), 4.0, held))

    def another_takes_the_lease_first(partial: dict) -> bool:  # while this child waits at its gate
        other.start()
        assert held.wait(30)
        return True

    job = {"role": "reference", "reference_src": REFERENCE, "protocol": PROTOCOL.to_dict(), "device": "cpu"}
    started = time.monotonic()
    try:
        run = run_isolated(job, 60.0, gate=another_takes_the_lease_first, lease=TimingLease("dev", 60.0, tmp_path))
    finally:
        other.join()
    elapsed = time.monotonic() - started
    assert run.payload is not None and run.lease_wait_s > 2.0
    assert run.wall_s + run.lease_wait_s == pytest.approx(elapsed, abs=1.0)
