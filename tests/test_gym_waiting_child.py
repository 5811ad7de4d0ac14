"""A candidate child started before its job (kpipe.gym.confine.zygote.ZygoteLauncher): confined and
initialised ahead, stopped like any child while another times, given only the job it was prepared
for, and ended without a trace when it is not needed."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kpipe.gym import Protocol
from kpipe.gym.confine.isolate import WaitingChild
from kpipe.gym.confine.lease import ChildPauser, TimingLease
from kpipe.gym.confine.zygote import Zygote, ZygoteLauncher

PROTOCOL = Protocol(correct_trials=1, perf_trials=2, warmup=1, baseline="eager", device="cpu", timeout_s=30, reject_findings=())


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    zygote = Zygote(dict(os.environ))
    zygote.wait_ready()
    yield zygote
    zygote.close()


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def children_of(pid: int) -> list[int]:
    """The children of `pid`, zombies included: a sandbox's init killed with its waiter is
    reparented to the zygote (a subreaper), which must reap it when it ends."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    return [grandchild for child in children_of(pid) for grandchild in (child, *descendants(child))]


def hold_for(lock_dir: str, seconds: float, held: multiprocessing.synchronize.Event) -> None:
    with TimingLease("dev", 5.0, Path(lock_dir)).hold():
        held.set()
        time.sleep(seconds)


def until(condition, timeout_s: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_next_candidate_child_waits_confined_and_is_stopped_while_another_times(zygote: Zygote, tmp_path: Path) -> None:
    launcher = ZygoteLauncher(lambda: zygote, "cpu", PROTOCOL.to_dict())
    lease = TimingLease("dev", 5.0, tmp_path)
    this_one = launcher.waiting_candidate(lease)
    launcher.start_next(lease)
    the_next = launcher._next
    assert the_next is not None and the_next.proc.pid != this_one.proc.pid
    held = multiprocessing.get_context("spawn").Event()
    other = multiprocessing.get_context("spawn").Process(target=hold_for, args=(str(tmp_path), 1.0, held))
    try:
        for child in (this_one, the_next):
            assert child.proc.poll() is None and state(child.proc.pid) != "T"
            preparation = json.loads((child.scratch.path / "preparation.json").read_text())
            assert preparation["workdir"] == str(child.scratch.path) and preparation["device"] == "cpu"
        other.start()
        assert held.wait(30)
        time.sleep(0.2)
        assert [state(child.proc.pid) for child in (this_one, the_next)] == ["T", "T"]  # before any job: stopped too
        other.join()
        assert until(lambda: all(state(child.proc.pid) != "T" for child in (this_one, the_next)), 5.0)
    finally:
        launcher.close()
        this_one.discard()
    assert not this_one.scratch.path.exists() and not the_next.scratch.path.exists()
    assert until(lambda: children_of(zygote.process.pid) == [], 10.0), "the zygote still has children"


def test_its_pauses_before_the_job_are_not_the_jobs(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"], start_new_session=True)
    pauser = ChildPauser(child.pid, TimingLease("dev", 5.0, tmp_path))
    pauser.start()
    held = multiprocessing.get_context("spawn").Event()
    other = multiprocessing.get_context("spawn").Process(target=hold_for, args=(str(tmp_path), 0.6, held))
    try:
        other.start()
        assert held.wait(30)
        time.sleep(0.2)
        pauser.restart_count()  # its job starts while it is stopped
        other.join()
        time.sleep(0.2)
        assert 0.2 < pauser.paused_s() < 0.55  # only the rest of that pause counts
    finally:
        pauser.finish()
        child.kill()
        child.wait()


def test_a_job_other_than_the_one_it_was_prepared_for_is_refused(zygote: Zygote) -> None:
    launcher = ZygoteLauncher(lambda: zygote, "cpu", PROTOCOL.to_dict())
    child: WaitingChild = launcher.waiting_candidate(None)
    launcher.close()
    try:
        preparation = json.loads((child.scratch.path / "preparation.json").read_text())
        job = {**preparation, "role": "candidate", "workdir": "/tmp"}
        job_file = child.scratch.path / "job.json"
        job_file.write_text(json.dumps(job))
        child.hand_over(job_file, 30.0)
        assert child.proc.wait(timeout=60) != 0
        assert "workdir is not the one this child was prepared with" in child.streams[1].read().decode()
    finally:
        child.discard()


def test_the_zygote_keeps_each_childs_exit_for_whoever_waits_for_it(zygote: Zygote) -> None:
    launcher = ZygoteLauncher(lambda: zygote, "cpu", PROTOCOL.to_dict())
    first = launcher.waiting_candidate(None)
    launcher.start_next(None)
    second, launcher._next = launcher._next, None
    assert second is not None
    second.release()  # no job: it exits on its own
    assert until(lambda: second.proc.pid not in children_of(zygote.process.pid), 60.0)
    first.release()
    assert first.proc.wait(timeout=60) == 0  # may read the second's exit first, and keeps it
    assert second.proc.wait(timeout=60) == 0
    for child in (first, second):
        child.discard()
    assert until(lambda: children_of(zygote.process.pid) == [], 10.0)


def test_a_child_whose_zygote_died_is_replaced_before_its_job_comes() -> None:
    """A candidate can kill the zygote (unconfined, or a bug): the child it had started ahead dies
    with it, and the next call gets a live child from the worker's new zygote."""
    zygotes: list[Zygote] = []

    def current() -> Zygote:  # as kpipe.gym.serve.worker's current_zygote
        if not zygotes or not zygotes[-1].alive():
            zygotes.append(Zygote(dict(os.environ)))
        return zygotes[-1]

    launcher = ZygoteLauncher(current, "cpu", PROTOCOL.to_dict())
    first = launcher.waiting_candidate(None)
    first.discard()
    os.kill(zygotes[0].process.pid, 9)
    zygotes[0].process.wait()
    child = launcher.waiting_candidate(None)
    try:
        assert len(zygotes) == 2 and child.proc.poll() is None
        assert child.proc.pid in children_of(zygotes[1].process.pid)
    finally:
        launcher.close()
        child.discard()
        for zygote in zygotes:
            zygote.close()


def test_a_failure_to_start_the_next_child_costs_the_current_one_nothing(zygote: Zygote, monkeypatch: pytest.MonkeyPatch) -> None:
    from kpipe.gym.confine.zygote import ZygoteDied

    launcher = ZygoteLauncher(lambda: zygote, "cpu", PROTOCOL.to_dict())
    start = launcher._start_waiting
    calls = []

    def second_fails(lease: TimingLease | None) -> WaitingChild:
        calls.append(lease)
        if len(calls) == 2:
            raise ZygoteDied("the fork server is gone")
        return start(lease)

    monkeypatch.setattr(launcher, "_start_waiting", second_fails)
    child = launcher.waiting_candidate(None)
    launcher.start_next(None)
    try:
        assert child.proc.poll() is None and launcher._next is None
    finally:
        child.discard()
        launcher.close()


def test_the_next_child_is_started_once_this_one_has_its_job(zygote: Zygote) -> None:
    """The next candidate's fork, scratch and context are made while this candidate runs, never
    between its evaluation's start and its hand-over (its critical path)."""
    from kpipe.gym.judge.evaluation import evaluate

    fixtures = Path(__file__).parent / "fixtures" / "gym"
    events: list[str] = []

    class Recording(ZygoteLauncher):
        def waiting_candidate(self, lease: TimingLease | None) -> WaitingChild:
            child = super().waiting_candidate(lease)
            events.append(f"this call's child {child.proc.pid}")
            hand_over = child.hand_over

            def recorded(job_file: Path, timeout_s: float) -> None:
                events.append("hand-over")
                hand_over(job_file, timeout_s)

            child.hand_over = recorded
            return child

        def start_next(self, lease: TimingLease | None) -> None:
            super().start_next(lease)
            events.append(f"next child {self._next.proc.pid if self._next else None}")

    launcher = Recording(lambda: zygote, "cpu", PROTOCOL.to_dict())
    reference, legit = ((fixtures / name).read_text() for name in ("relu_reference.py", "relu_legit.py"))
    try:
        for i in range(2):
            assert evaluate(reference, f"{legit}\n# {i}\n", PROTOCOL, launch=launcher).status == "pass"
    finally:
        launcher.close()
    first, second = (int(event.split()[-1]) for event in events if event.startswith("next child"))
    assert [event.split(" child")[0] for event in events] == ["this call's", "hand-over", "next"] * 2
    assert events[3] == f"this call's child {first}" and first != second  # the second call took the child started ahead
    assert until(lambda: children_of(zygote.process.pid) == [], 10.0)


def test_orphans_of_discarded_children_are_reaped_without_another_exit(zygote: Zygote) -> None:
    """Kill started-ahead children (and with them their sandboxes' inits, reparented to the
    zygote) with no other child exiting afterwards: the zygote is left with no child, not even a zombie."""
    launcher = ZygoteLauncher(lambda: zygote, "cpu", PROTOCOL.to_dict())
    for _ in range(6):
        child = launcher.waiting_candidate(None)
        assert until(lambda: len(descendants(zygote.process.pid)) == 3, 30.0)  # in its sandbox: waiter, init, candidate
        child.discard()
        assert until(lambda: children_of(zygote.process.pid) == [], 10.0), "the zygote kept a child or a zombie"


def test_the_judges_trace_splits_its_evaluation(zygote: Zygote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KPIPE_GYM_TRACE (benchmarks/gym_scaling.py's phases): the screen, the reference, the
    candidate's whole run and the verdict after it are parts of the evaluation's wall time."""
    from kpipe.gym.judge.evaluation import evaluate

    monkeypatch.setenv("KPIPE_GYM_TRACE", str(tmp_path / "trace.jsonl"))
    fixtures = Path(__file__).parent / "fixtures" / "gym"
    reference, legit = ((fixtures / name).read_text() for name in ("relu_reference.py", "relu_legit.py"))
    launcher = ZygoteLauncher(lambda: zygote, "cpu", PROTOCOL.to_dict())
    try:
        assert evaluate(reference, legit, PROTOCOL, launch=launcher).status == "pass"
    finally:
        launcher.close()
    [record] = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    parts = [record[name] for name in ("screen_s", "reference_s", "candidate_run_s", "verdict_s")]
    assert all(part >= 0 for part in parts) and record["candidate_run_s"] >= record["candidate"]["wall_s"] > 0
    assert sum(parts) <= record["wall_s"] < sum(parts) + 1.0, (parts, record["wall_s"])


def test_a_child_holds_none_of_the_zygotes_own_descriptors(zygote: Zygote) -> None:
    """The zygote's socket, its wake-up pipe and the other children's pidfds are closed in every
    child before the candidate's code runs: a candidate cannot talk to, wake or watch its zygote."""

    def targets(pid: int) -> set[str]:
        found = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            if int(fd.name) > 2:
                with contextlib.suppress(OSError):
                    found.add(os.readlink(fd))
        return found

    launcher = ZygoteLauncher(lambda: zygote, "cpu", PROTOCOL.to_dict())
    child = launcher.waiting_candidate(None)
    try:
        assert until(lambda: len(descendants(zygote.process.pid)) == 3, 30.0)  # in its sandbox: waiter, init, candidate
        own = {target for target in targets(zygote.process.pid) if target.startswith(("pipe:", "socket:"))}
        assert any(target.startswith("pipe:") for target in own)  # the wake-up pipe
        for pid in descendants(zygote.process.pid):
            assert not targets(pid) & own, (pid, targets(pid) & own)
    finally:
        child.discard()


def fork_probe(zygote: Zygote, tmp_path: Path, name: str, exit_after: Path | None = None) -> tuple[Any, Path]:
    """Fork a child of `zygote` whose reference writes to the returned report which of
    CANDIDATE_PRELOAD it was forked with (the zygote's deferred imports), then exits (with
    `exit_after`, once that file exists)."""
    from kpipe.gym.confine.zygote import CANDIDATE_PRELOAD

    workdir = tmp_path / name
    workdir.mkdir()
    report = workdir / "modules.json"
    wait = f"import time\nwhile not os.path.exists({str(exit_after)!r}): time.sleep(0.01)\n" if exit_after else ""
    probe = (f"import json, os, sys\nopen({str(report)!r}, 'w').write(json.dumps([m for m in {list(CANDIDATE_PRELOAD)!r} "
             f"if m in sys.modules]))\n{wait}os._exit(0)\n")
    job = {"role": "reference", "reference_src": probe, "protocol": PROTOCOL.to_dict(), "device": "cpu",
           "workdir": str(workdir), "result_path": str(workdir / "result.pt"), "environment": dict(os.environ)}
    (workdir / "job.json").write_text(json.dumps(job))
    streams = [os.pipe(), os.pipe()]
    child = zygote.spawn(workdir / "job.json", streams[0][1], streams[1][1], 60.0)
    for read_end, write_end in streams:
        os.close(write_end)
        os.close(read_end)
    return child, report


def modules_of(probe: tuple[Any, Path]) -> list[str]:
    child, report = probe
    assert child.wait(60) == 0
    return json.loads(report.read_text())


def test_a_gpu_zygote_is_ready_before_the_candidates_preload_and_has_it_for_every_later_child(tmp_path: Path) -> None:
    """A worker's first child is its first evaluation's reference, which needs none of
    CANDIDATE_PRELOAD (torch._dynamo alone was 40 % of a zygote's start on an H200 host): a zygote
    whose children compile for a GPU says it is ready without it and imports it beside that first
    child; every later child (the first candidate's next) is forked with all of it."""
    from kpipe.gym.confine.zygote import CANDIDATE_PRELOAD

    # as on a GPU (the compiler's warm-up runs on the host), its scratch in the test's directory
    zygote = Zygote({**os.environ, "TRITON_INTERPRET": "0", "TMPDIR": str(tmp_path)})
    try:
        zygote.wait_ready()
        assert list(zygote.start_phases) == ["zygote: imports"]
        first = fork_probe(zygote, tmp_path, "first")
        second = fork_probe(zygote, tmp_path, "second")  # asked for at once: the rest of the preload comes before its fork
        assert modules_of(first) == []
        assert modules_of(second) == list(CANDIDATE_PRELOAD)
    finally:
        zygote.close()


def test_an_interpreter_zygote_preloads_everything_before_it_is_ready(zygote: Zygote, tmp_path: Path) -> None:
    """On a CPU the children are timed on the host's own clock: nothing of the zygote's runs beside them."""
    from kpipe.gym.confine.zygote import CANDIDATE_PRELOAD

    assert "zygote: candidates' preload" in zygote.start_phases
    assert modules_of(fork_probe(zygote, tmp_path, "probe")) == list(CANDIDATE_PRELOAD)


# what a zygote's interpreter runs first: its import of torch._dynamo (the last step of the
# deferred preload) waits until `<hold>.go` exists, after saying so in `<hold>.held`
HOLD_DYNAMO = """
import os, sys, time

class HoldDynamo:
    def find_spec(self, name, path=None, target=None):
        hold = {hold!r}  # in the source: the zygote's environment holds only its children's allowlist
        if name == "torch._dynamo":
            open(hold + ".held", "w").close()
            while not os.path.exists(hold + ".go"):
                time.sleep(0.01)
            sys.meta_path.remove(self)
        return None

sys.meta_path.insert(0, HoldDynamo())
"""


def test_a_childs_exit_is_reported_while_the_zygote_still_preloads(tmp_path: Path) -> None:
    """The zygote's preload after its first fork (seconds on a GPU host) runs beside its loop: a
    child that exits meanwhile is reported at once. Reported only after the preload, a worker's
    first child held its GPU's timing lease that long, and the other worker's child on the GPU
    stayed stopped. A later child still starts with all of the preload."""
    from kpipe.gym.confine.zygote import CANDIDATE_PRELOAD

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    hold = tmp_path / "hold"
    (hooks / "sitecustomize.py").write_text(HOLD_DYNAMO.replace("{hold!r}", repr(str(hold))))
    held, go = Path(f"{hold}.held"), Path(f"{hold}.go")
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    zygote = Zygote({**os.environ, "TRITON_INTERPRET": "0", "TMPDIR": str(tmp_path), "PYTHONPATH": path})
    try:
        zygote.wait_ready()
        first, _ = fork_probe(zygote, tmp_path, "first", exit_after=held)  # exits once the preload is held
        assert until(held.exists, 120.0)
        assert first.wait(60) == 0  # its exit reported while the preload's last step is still held
        go.touch()
        assert modules_of(fork_probe(zygote, tmp_path, "second")) == list(CANDIDATE_PRELOAD)
    finally:
        go.touch()
        zygote.close()


def test_the_deferred_preload_pauses_between_steps_completes_before_a_later_fork_and_reports_a_failure() -> None:
    """``DeferredPreload``: a first fork waits only for the step under way, a later one for every
    step; a step that raises stops the preload, which is not begun again, and its exception reaches
    the zygote's loop (whose zygote then exits)."""
    import threading

    from kpipe.gym.confine.zygote import DeferredPreload

    ran: list[int] = []
    under_way, go_on = threading.Event(), threading.Event()

    def slow_first() -> None:
        under_way.set()
        go_on.wait(30)
        ran.append(1)

    wake_r, wake_w = os.pipe()
    try:
        preload = DeferredPreload([slow_first, lambda: ran.append(2), lambda: ran.append(3)], wake_w)
        preload.begin()
        assert under_way.wait(30) and preload.running() and not preload.unbegun()
        threading.Timer(0.2, go_on.set).start()
        preload.before_fork()  # the first fork: the step under way only
        assert ran == [1] and not preload.running() and preload.unbegun()
        preload.begin()
        preload.before_fork()  # a later fork: all of it
        assert ran == [1, 2, 3] and not preload.unbegun()

        def broken() -> None:
            raise ModuleNotFoundError("no module named 'torch._dynamo'")

        failing = DeferredPreload([broken, lambda: ran.append(4)], wake_w)
        failing.begin()
        assert until(lambda: not failing.running(), 30)
        assert not failing.unbegun() and os.read(wake_r, 16)  # the loop was woken
        with pytest.raises(ModuleNotFoundError):
            failing.raise_failure()
        assert ran == [1, 2, 3]
    finally:
        os.close(wake_r)
        os.close(wake_w)
