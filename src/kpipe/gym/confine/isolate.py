"""Running one child in isolation: a fresh interpreter in its own session and scratch
directory, with the environment ``kpipe.gym.confine.environment`` builds (secrets scrubbed, compile
caches per ``kpipe.gym.confine.compile_caches``, a candidate's home and temporary directory inside its
scratch), a candidate confined by the kernel to that scratch (``kpipe.gym.confine.sandbox``), a
wall-clock timeout that kills its whole process group, bounded capture of stdout/stderr (kept
for diagnostics, never parsed for results), and an optional gate between its correctness and
timing stages, past which the child runs holding its device's timing lease
(``kpipe.gym.confine.lease``)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
import typing
from collections.abc import Callable
from contextlib import ExitStack
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


from kpipe.gym.confine.compile_caches import process_caches
from kpipe.gym.confine.environment import child_environment
from kpipe.gym.exchange import (GATE_FILE, JOB_FILE, PARTIAL_FILE, PHASE_FILE, PHASE_MAX_BYTES, RESULT_FILE, WINDOW_ANSWER_FILE, WINDOW_FILE,
                                WINDOW_POLL_S, WINDOW_READY_FILE, MalformedFile, decode, gc_paused)
from kpipe.gym.confine.lease import ChildPauser, TimingLease
from kpipe.gym.confine.limits import ChildLimits, Limits, cgroup_support
from kpipe.gym.protocol import Protocol
from kpipe.gym.confine.sandbox import require_confinement, sandbox_for
from kpipe.gym.confine.scratch_tree import remove_tree, walk
from kpipe.infra.process import kill_group, tied_to_this_process

HEAD_BYTES = 2048
TAIL_BYTES = 8192
GATE_POLL_S = 0.005


class BoundedCapture(threading.Thread):
    """Drains a pipe, keeping only its head and tail: a candidate printing gigabytes costs
    the parent nothing but the read."""

    def __init__(self, stream: IO[bytes]) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.head = b""
        self.tail = b""
        self.total = 0

    def run(self) -> None:
        while chunk := self.stream.read1(65536):  # type: ignore[attr-defined]
            self.total += len(chunk)
            if len(self.head) < HEAD_BYTES:
                self.head += chunk[: HEAD_BYTES - len(self.head)]
            self.tail = (self.tail + chunk)[-TAIL_BYTES:]

    def text(self) -> str:
        if self.total <= HEAD_BYTES + TAIL_BYTES:  # nothing lost: head, then the rest from the tail
            rest = self.tail[len(self.tail) - (self.total - len(self.head)) :]
            return (self.head + rest).decode(errors="replace")
        skipped = self.total - len(self.head) - len(self.tail)
        return (self.head.decode(errors="replace") + f"\n[... {skipped} bytes omitted ...]\n" + self.tail.decode(errors="replace"))


@dataclass
class ChildRun:
    payload: dict[str, Any] | None  # the child's result file; None if it died without one
    partial: dict[str, Any] | None  # what it wrote at the gate, if it got there
    returncode: int | None
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str
    output_bytes: int
    phase: str
    result_bytes: int = 0  # size of the result file (what keeping the payload costs, roughly)
    lease_wait_s: float = 0.0  # how long it waited at the gate for its device's timing lease
    # the judge's side of the run (instrumentation, never judged): before the child had its job
    # (scratch, job file, hand-over), from then until its exit was seen, and after (reading its
    # result, removing its scratch); what the second has beyond the child's own phases is its
    # start and exit (a CUDA context's teardown)
    setup_s: float = 0.0
    child_s: float = 0.0
    cleanup_s: float = 0.0
    handed_over_unix: float = 0.0  # when the child had its job (its own stats say when it began)
    # the judge's timing windows (``Windows``), one each: the bytes of the child's answer, and the
    # judge's clock from revealing the window's seed to the answer appearing (seconds, and the Unix
    # times of both ends: the window's span)
    windows: list[bytes] | None = None
    window_s: list[float] | None = None
    window_spans: list[list[float]] = dataclasses.field(default_factory=list)
    tampered: str = ""  # why the judge ended the child: an exchange file it planted or replaced (``Tampered``)
    limit: str = ""  # the limits it ran into (``kpipe.gym.confine.limits.ChildLimits.hit``), on the judge's evidence
    peaks: dict[str, float] | None = None  # the most memory and tasks it held, where limited (instrumentation)


class Tampered(Exception):
    """An entry of a candidate's scratch directory that is not what the judge wrote or asked for
    (a link, a FIFO, a directory, a file past its size cap): evidence of tampering, never read."""


class ScratchDir:
    """A child's scratch directory as the judge reaches it: through a descriptor opened when the
    judge made it, never by path. The candidate owns what is inside, so every entry is input:
    opened without following links (``O_NOFOLLOW``), without blocking (``O_NONBLOCK``: a FIFO in
    place of a result cannot hang the judge), read only when a regular file under its cap, and
    written only as a new file (``O_EXCL``: a planted entry makes the write fail, not land
    elsewhere)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def has(self, name: str) -> bool:
        """Whether an entry of that name exists, whatever it is (a link is not followed)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def size(self, name: str) -> int:
        """Bytes of regular file `name` (0 for none, or for anything else)."""
        try:
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        return info.st_size if stat.S_ISREG(info.st_mode) else 0

    def read(self, name: str, max_bytes: int) -> bytes | None:
        """The bytes of regular file `name`, None when there is none; Tampered otherwise."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symbolic link
            raise Tampered(f"{name} could not be opened safely ({exc.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise Tampered(f"{name} is not a regular file")
            if info.st_size > max_bytes:
                raise Tampered(f"{name} holds {info.st_size} bytes, over its cap of {max_bytes}")
            chunks, left = [], max_bytes + 1
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
            if len(data) > max_bytes:
                raise Tampered(f"{name} grew past its cap of {max_bytes} bytes while read")
            return data
        finally:
            os.close(fd)

    def file_of_size(self, size: int, max_entries: int = 10000) -> str | None:
        """The path (relative to the directory) of a regular file at least `size` bytes large, if
        the first `max_entries` entries hold one (``kpipe.gym.confine.scratch_tree.walk``: iterative, no link followed)."""
        return next((entry.path for entry in walk(self.fd, max_entries)
                     if stat.S_ISREG(entry.info.st_mode) and entry.info.st_size >= size), None)

    def write_new(self, name: str, data: bytes) -> None:
        """Create `name` holding `data`, all at once (a child polling for it never sees it empty:
        written under a temporary name, then hard-linked into place, which fails rather than
        replace an entry that is there); Tampered when one of the two names was planted."""
        temporary = f".{name}.judge"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=self.fd)
        except FileExistsError:
            raise Tampered(f"{temporary} was planted before the judge wrote it") from None
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        try:
            os.link(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
        except FileExistsError:
            raise Tampered(f"{name} was planted before the judge wrote it") from None
        finally:
            os.unlink(temporary, dir_fd=self.fd)


def load_payload(scratch: ScratchDir, name: str, max_bytes: int) -> dict[str, Any] | None:
    """Read a child's result file `name` (``kpipe.gym.exchange``: no pickle); anything but a
    regular file under `max_bytes` is a crashed result naming why."""
    try:
        data = scratch.read(name, max_bytes)
    except Tampered as exc:
        return {"status": "crashed", "tampered": True, "error": f"tampered result: {exc}"}
    return None if data is None else decode_payload(data)


def decode_payload(data: bytes) -> dict[str, Any]:
    """A child's result file's bytes as its payload, or, when it is not a well-formed exchange file
    holding a record, the judge's runtime_error naming why (``malformed``). Its schema is the
    judge's to check (kpipe.gym.judge.evaluation)."""
    try:
        payload = decode(data)
    except MalformedFile as exc:
        return {"status": "runtime_error", "malformed": True, "error": str(exc)}
    if not isinstance(payload, dict):
        return {"status": "runtime_error", "malformed": True, "error": "it holds no record"}
    return payload


Launcher = Callable[[Path, dict[str, str], float], tuple[Any, list[IO[bytes]]]]
"""Starts ``kpipe.gym.candidate.child`` on a job file (args: job file, the child's complete environment,
timeout) in its own process group; returns a Popen-like process (poll, wait, pid, args,
returncode) and its stdout and stderr streams."""


def fresh_interpreter(job_file: Path, env: dict[str, str], timeout_s: float) -> tuple[Any, list[IO[bytes]]]:
    """A new Python interpreter per child: slow to start, shares nothing with anyone. It enters
    the job's sandbox (if any) before torch starts threads, then runs the child."""
    proc = subprocess.Popen(
        tied_to_this_process([sys.executable, "-m", "kpipe.gym.confine.sandbox", str(job_file)]),
        cwd=job_file.parent,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the timeout kills everything it started
    )
    return proc, [proc.stdout, proc.stderr]  # type: ignore[list-item]


@dataclass
class Windows:
    """The judge's timing windows of one child (kpipe.gym.judge.evaluation): per window a secret seed,
    revealed only when the child is ready and has run its correctness trials; the child draws fresh
    inputs for `calls` calls from it (the reference's child picks `calls` itself: None), runs them
    back to back and writes their outputs; the judge clocks it from the seed to the answer. Windows
    run until the seeds are spent or `enough(windows answered, their answers' bytes)` says stop."""

    seeds: tuple[int, ...]
    calls: int | None
    enough: Callable[[int, int], bool] | None = None


RESULT_MAX_BYTES = 1 << 40  # a trusted (reference) child's result: no cap beyond the disk


def run_isolated(
    job: dict[str, Any],
    timeout_s: float,
    gate: Callable[[dict[str, Any]], bool] | None = None,
    launch: Launcher = fresh_interpreter,
    lease: TimingLease | None = None,
    windows: Windows | None = None,
    max_result_bytes: int = RESULT_MAX_BYTES,
) -> ChildRun:
    """Run ``kpipe.gym.candidate.child`` on `job` in a fresh process; never raises for what the child does.

    With `gate`, the child stops after its correctness stage and writes a partial result;
    `gate(partial)` (run here, in the parent) decides whether it goes on to timing. With `lease`
    (``kpipe.gym.confine.lease``), a child told to go first waits for its device's timing lease, its device
    held until the child has exited and its timing part until the child has answered its last window,
    and the child is stopped whenever another child holds the timing part; both are added to its
    deadline (they are nobody's fault).
    With `windows`, a child that went on is asked for its timing windows' outputs, clocked here. `launch` starts the process (the worker pool forks it from a warm
    zygote instead). Every file the child leaves is read through ``ScratchDir`` and at most
    `max_result_bytes` of it. Raises ``LeaseTimeout`` (the child killed) only when the lease never
    came free.
    """
    entered = time.monotonic()
    trusted = job["role"] == "reference"
    lease_wait_bound = lease.max_wait_s if lease is not None else 0.0
    preparer = launch if not trusted and isinstance(launch, PreparesCandidates) else None
    waiting = preparer.waiting_candidate(lease) if preparer is not None else None
    limits = None if trusted else Protocol.from_dict(job["protocol"]).limits()
    scratch = waiting.scratch if waiting is not None else make_scratch(job["role"], job["device"], limits)
    try:
        directory = ScratchDir(scratch.path)
        job = {
            **job,
            **scratch.confinement,
            "workdir": str(scratch.path),
            "result_path": str(scratch.path / RESULT_FILE),
            "phase_path": str(scratch.path / PHASE_FILE),
            "gate_path": str(scratch.path / GATE_FILE) if gate else None,
            "gate_wait_s": timeout_s + 2 * lease_wait_bound,
            "window_calls": windows.calls if windows is not None and gate else None,
            "window_rounds": len(windows.seeds) if windows is not None and gate else None,
            "environment": scratch.env,  # a forked child takes it whole (kpipe.gym.serve.pool)
        }
        job_file = scratch.path / JOB_FILE
        job_file.write_text(json.dumps(job))  # before any candidate code runs; the child removes it at once
    except BaseException:
        if waiting is not None:
            waiting.discard()
        scratch.remove()
        raise
    try:
        start, handed_over_unix = time.monotonic(), time.time()
        if preparer is not None and waiting is not None:
            proc, streams, pauser = waiting.proc, waiting.streams, waiting.pauser
            if pauser is not None:
                pauser.restart_count()  # stopped while it waited for this job: nobody's time
            waiting.hand_over(job_file, timeout_s + 2 * lease_wait_bound)
            preparer.start_next(lease)  # the next call's child, started while this one runs
        else:
            proc, streams = launch(job_file, scratch.env, timeout_s + 2 * lease_wait_bound)
            pauser = ChildPauser(proc.pid, lease) if lease is not None else None
            if pauser is not None:
                pauser.start()
        if scratch.limits is not None:
            scratch.limits.watch(proc.pid, lambda: kill_group(proc.pid))
        captures = [BoundedCapture(stream) for stream in streams]
        for capture in captures:
            capture.start()
        partial = None
        timed_out = False
        lease_wait_s = 0.0
        answer: tuple[list[bytes] | None, list[float] | None, list[list[float]]] = (None, None, [])

        def held_up() -> float:
            """Seconds the child could not run, which are nobody's fault: waiting at the gate for the
            lease, or stopped while another child timed. Its pauser stops it during the wait too (the
            lease is held elsewhere), so the two overlap and count once: subtracting both made a
            long wait shrink the child's wall time below its own timed trials, and honest kernels
            were judged timing_inconsistent when many evaluations shared a GPU."""
            return max(lease_wait_s, pauser.paused_s()) if pauser is not None else lease_wait_s

        def deadline() -> float:
            return start + timeout_s + held_up()

        tampered = ""
        with ExitStack() as held:
            try:
                if gate is not None:
                    partial, go = wait_at_gate(proc, directory, deadline, gate, max_result_bytes)
                    held_lease = held.enter_context(lease.hold()) if go and lease is not None else None
                    if held_lease is not None:
                        lease_wait_s = held_lease.waited_s
                        pauser.take_over()  # type: ignore[union-attr]
                    if partial is not None:
                        go = answer_gate(directory, go)
                    if go and windows is not None:  # the windows are the last thing the child times
                        timing_done = held_lease.end_timing if held_lease is not None else (lambda: None)
                        answer = ask_windows(proc, directory, deadline, windows, max_result_bytes, timing_done)
                # a leased child keeps the device until it has exited: its context's teardown (GPU
                # memory freed, page tables unmapped) is GPU work, which no timed region may run beside
                wait_for_exit(proc, deadline)
            except subprocess.TimeoutExpired:
                timed_out = True
            except Tampered as exc:  # the exchange with the child was tampered with: it ends now
                tampered = str(exc)
            finally:
                kill_group(proc.pid)  # also reaps anything the child left behind in its group
                proc.wait()  # a lease still held (a timeout) is released only after this
                if scratch.limits is not None:
                    scratch.limits.stop()
                if pauser is not None:
                    pauser.finish()
                if trusted:
                    process_caches().seal()
        exited = time.monotonic()
        wall_s = exited - start
        for capture in captures:
            capture.join(timeout=5)
            capture.stream.close()
        payload = None if timed_out or tampered else load_payload(directory, RESULT_FILE, max_result_bytes)
        try:
            phase = (directory.read(PHASE_FILE, PHASE_MAX_BYTES) or b"").decode(errors="replace")
        except Tampered as exc:
            phase = f"unknown ({exc})"
        result_bytes = directory.size(RESULT_FILE)
        limit = scratch.limits.hit(proc.returncode, directory.file_of_size) if scratch.limits is not None else ""
        peaks = scratch.limits.peaks() if scratch.limits is not None else None
        directory.close()
        scratch.remove()
        return ChildRun(
            payload=payload,
            partial=partial,
            returncode=proc.returncode,
            timed_out=timed_out,
            wall_s=wall_s - held_up(),
            stdout=captures[0].text(),
            stderr=captures[1].text(),
            output_bytes=captures[0].total + captures[1].total,
            phase=phase,
            result_bytes=result_bytes,
            lease_wait_s=lease_wait_s,
            setup_s=start - entered,
            child_s=wall_s,
            cleanup_s=time.monotonic() - exited,
            handed_over_unix=handed_over_unix,
            windows=answer[0],
            window_s=answer[1],
            window_spans=answer[2],
            tampered=tampered,
            limit=limit,
            peaks=peaks,
        )
    except BaseException:  # the scratch is removed above on the way out; here on every other
        scratch.remove()
        raise


@dataclass
class Scratch:
    """A child's scratch directory (its cwd, temporary files and, for a candidate, its compile
    caches and all it may write), its environment, the job keys that confine it, and a
    candidate's limits as the judge holds them (its cgroups)."""

    path: Path
    env: dict[str, str]
    confinement: dict[str, Any]
    limits: ChildLimits | None = None

    def remove(self) -> None:
        """Remove the directory (however deep the candidate nested it) and the child's cgroups."""
        remove_tree(self.path)
        if self.limits is not None:
            self.limits.remove()


def make_scratch(role: str, device: str, limits: Limits | None = None) -> Scratch:
    """A new scratch directory and the environment of a child of `role` (``kpipe.gym.confine.environment``
    with the compile caches of ``kpipe.gym.confine.compile_caches``); a candidate's is sandboxed to it and
    held to `limits` (``kpipe.gym.confine.limits``)."""
    scratch = Scratch(Path(tempfile.mkdtemp(prefix=f"kgym-{role}-")), {}, {})
    try:
        caches = process_caches()
        trusted = role == "reference"
        scratch.env = child_environment(device, os.environ,
                                        caches.for_reference() if trusted else caches.for_candidate(scratch.path / "compile-cache"))
        if not trusted:
            scratch.confinement = candidate_confinement(scratch.path, scratch.env)
            if limits is not None and limits.any():
                scratch.limits = ChildLimits(limits, cgroup_support(), scratch.path)
                scratch.confinement.update(scratch.limits.job_keys())
        return scratch
    except BaseException:
        scratch.remove()
        raise


@dataclass
class WaitingChild:
    """A candidate child started before its job (``kpipe.gym.confine.zygote.ZygoteLauncher``): in its
    scratch and sandbox, its device initialised, reading its job's path from a pipe. Its pauser
    runs from its start: it is stopped whenever another child times on its device."""

    scratch: Scratch
    proc: Any
    streams: list[IO[bytes]]
    pauser: ChildPauser | None
    hand_over: Callable[[Path, float], None]  # (job file, timeout): its job and its timeout start
    job_pipe: int  # the pipe's write end: closed without a path, it tells the child to exit

    def release(self) -> None:
        """Close the job pipe (after its job's path, or without one: not wanted)."""
        if self.job_pipe >= 0:
            os.close(self.job_pipe)
            self.job_pipe = -1

    def discard(self) -> None:
        """End an unused child: kill its group, reap it, remove its scratch."""
        self.release()
        if self.pauser is not None:
            self.pauser.finish()
        kill_group(self.proc.pid)
        self.proc.wait()
        for stream in self.streams:
            stream.close()
        self.scratch.remove()


@typing.runtime_checkable
class PreparesCandidates(typing.Protocol):
    """A launcher that keeps a candidate child started ahead of its job."""

    def waiting_candidate(self, lease: TimingLease | None) -> WaitingChild: ...

    def start_next(self, lease: TimingLease | None) -> None: ...


def candidate_confinement(scratch: Path, env: dict[str, str]) -> dict[str, Any]:
    """A candidate's home and temporary files go to its scratch (where the sandbox lets it
    write), and, unless the user opted out by name, the sandbox it runs in. `env` is updated."""
    (scratch / "tmp").mkdir()
    env.update(HOME=str(scratch), TMPDIR=str(scratch / "tmp"))
    if not require_confinement():
        return {}
    return {"sandbox": sandbox_for(scratch, env).to_dict()}




def wait_at_gate(proc: subprocess.Popen[bytes], scratch: ScratchDir, deadline: Callable[[], float],
                 gate: Callable[[dict[str, Any]], bool], max_bytes: int) -> tuple[dict[str, Any] | None, bool]:
    """Wait for the child's partial result (or its exit); return it and the gate's go/stop."""
    if not wait_for_file(proc, scratch, PARTIAL_FILE, deadline):
        return None, False
    partial = load_payload(scratch, PARTIAL_FILE, max_bytes)
    if partial is not None and partial.get("tampered"):
        raise Tampered(partial["error"])
    return partial, partial is not None and "status" not in partial and gate(partial)


def wait_for_file(proc: subprocess.Popen[bytes], scratch: ScratchDir, name: str, deadline: Callable[[], float],
                  poll_s: float = GATE_POLL_S) -> bool:
    """Whether the child made entry `name` (False: it exited first); TimeoutExpired past `deadline()`."""
    while not scratch.has(name):
        if proc.poll() is not None:
            return scratch.has(name)
        if time.monotonic() > deadline():
            raise subprocess.TimeoutExpired(proc.args, 0)
        time.sleep(poll_s)
    return True


def wait_for_exit(proc: subprocess.Popen[bytes], deadline: Callable[[], float]) -> None:
    """Wait for the child's exit; TimeoutExpired past `deadline()`, which may move while it waits."""
    while True:
        remaining = deadline() - time.monotonic()
        if remaining <= 0:
            raise subprocess.TimeoutExpired(proc.args, 0)
        try:
            proc.wait(timeout=min(remaining, 0.5))
            return
        except subprocess.TimeoutExpired:
            continue


def answer_gate(scratch: ScratchDir, go: bool) -> bool:
    """Tell the child go or stop (Tampered when an answer was planted before ours)."""
    scratch.write_new(GATE_FILE, b"go" if go else b"stop")
    return go


def read_exchange_file(scratch: ScratchDir, name: str, max_bytes: int) -> bytes | None:
    """The bytes of a file the child writes during its windows (None: it is not there); Tampered,
    which ends the exchange, when it is not a regular file or is past the cap."""
    try:
        return scratch.read(name, max_bytes)
    except Tampered as exc:
        raise Tampered(f"tampered result: {exc}") from exc


def ask_windows(proc: subprocess.Popen[bytes], scratch: ScratchDir, deadline: Callable[[], float], windows: Windows,
                max_bytes: int, timing_done: Callable[[], None]) -> tuple[list[bytes] | None, list[float] | None, list[list[float]]]:
    """Reveal each window's seed once the child waits for it and clock its answer: (the answers'
    bytes, the seconds from revealing a seed to its answer's file appearing, and the Unix times of
    both), or (None, None, spans) when the child exited first; Tampered when the exchange was.
    `timing_done` is called as soon as the last window's answer is there, before its bytes are read:
    the child times nothing more, and the other children on its device need not stay stopped. The
    answers are parsed by the judge afterwards (kpipe.gym.judge.evaluation)."""
    answers: list[bytes] = []
    seconds: list[float] = []
    spans: list[list[float]] = []
    for index, seed in enumerate(windows.seeds):
        if not wait_for_file(proc, scratch, WINDOW_READY_FILE.format(round=index), deadline):
            return None, None, spans
        with gc_paused():
            revealed, revealed_unix = time.monotonic(), time.time()
            scratch.write_new(WINDOW_FILE.format(round=index), json.dumps({"seed": seed}).encode())
            if not wait_for_file(proc, scratch, WINDOW_ANSWER_FILE.format(round=index), deadline, WINDOW_POLL_S):
                return None, None, spans
            answered = time.monotonic()
        seconds.append(answered - revealed)
        spans.append([revealed_unix, revealed_unix + seconds[-1]])
        last = index + 1 == len(windows.seeds)
        answered_bytes = sum(map(len, answers)) + scratch.size(WINDOW_ANSWER_FILE.format(round=index))
        stop = not last and windows.enough is not None and windows.enough(index + 1, answered_bytes)
        if last or stop:
            timing_done()
        data = read_exchange_file(scratch, WINDOW_ANSWER_FILE.format(round=index), max_bytes)
        if data is None:
            return None, None, spans
        answers.append(data)
        if stop:  # after the read: the child may not rewrite an answer the judge has not kept
            scratch.write_new(WINDOW_FILE.format(round=index + 1), json.dumps({"stop": True}).encode())
            break
    return answers, seconds, spans
