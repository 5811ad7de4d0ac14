"""Running one child in isolation: a fresh interpreter in its own session and scratch
directory, with the environment ``kpipe.gym.environment`` builds (secrets scrubbed, compile
caches per ``kpipe.gym.compile_caches``, a candidate's home and temporary directory inside its
scratch), a candidate confined by the kernel to that scratch (``kpipe.gym.sandbox``), a
wall-clock timeout that kills its whole process group, bounded capture of stdout/stderr (kept
for diagnostics, never parsed for results), and an optional gate between its correctness and
timing stages, past which the child runs holding its device's timing lease
(``kpipe.gym.lease``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import typing
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from kpipe.gym.compile_caches import process_caches
from kpipe.gym.environment import child_environment
from kpipe.gym.lease import ChildPauser, TimingLease
from kpipe.gym.sandbox import require_confinement, sandbox_for
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


def load_payload(path: Path) -> dict[str, Any] | None:
    """Read a child's result file. weights_only=True: a forged pickle cannot run code here; a
    link (to another evaluation's result, say) is not followed."""
    if path.is_symlink():
        return {"status": "crashed", "error": "the result file is a symbolic link"}
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        return {"status": "crashed", "error": f"unreadable result file ({type(exc).__name__}: {str(exc)[:200]})"}
    if not isinstance(payload, dict):
        return {"status": "crashed", "error": "the result file holds no result"}
    return payload


Launcher = Callable[[Path, dict[str, str], float], tuple[Any, list[IO[bytes]]]]
"""Starts ``kpipe.gym.child`` on a job file (args: job file, the child's complete environment,
timeout) in its own process group; returns a Popen-like process (poll, wait, pid, args,
returncode) and its stdout and stderr streams."""


def fresh_interpreter(job_file: Path, env: dict[str, str], timeout_s: float) -> tuple[Any, list[IO[bytes]]]:
    """A new Python interpreter per child: slow to start, shares nothing with anyone. It enters
    the job's sandbox (if any) before torch starts threads, then runs the child."""
    proc = subprocess.Popen(
        tied_to_this_process([sys.executable, "-m", "kpipe.gym.sandbox", str(job_file)]),
        cwd=job_file.parent,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the timeout kills everything it started
    )
    return proc, [proc.stdout, proc.stderr]  # type: ignore[list-item]


def run_isolated(
    job: dict[str, Any],
    timeout_s: float,
    gate: Callable[[dict[str, Any]], bool] | None = None,
    launch: Launcher = fresh_interpreter,
    lease: TimingLease | None = None,
) -> ChildRun:
    """Run ``kpipe.gym.child`` on `job` in a fresh process; never raises for what the child does.

    With `gate`, the child stops after its correctness stage and writes a partial result;
    `gate(partial)` (run here, in the parent) decides whether it goes on to timing. With `lease`
    (``kpipe.gym.lease``), a child told to go first waits for its device's timing lease, held
    until the child has exited, and the child is stopped whenever
    another child holds the lease; both are added to its deadline (they are nobody's fault).
    `launch` starts the process (the worker pool forks it from a warm zygote instead). Raises
    ``LeaseTimeout`` (the child killed) only when the lease never came free.
    """
    entered = time.monotonic()
    trusted = job["role"] == "reference"
    lease_wait_bound = lease.max_wait_s if lease is not None else 0.0
    preparer = launch if not trusted and isinstance(launch, PreparesCandidates) else None
    waiting = preparer.waiting_candidate(lease) if preparer is not None else None
    scratch = waiting.scratch if waiting is not None else make_scratch(job["role"], job["device"])
    try:
        job = {
            **job,
            **scratch.confinement,
            "workdir": str(scratch.path),
            "result_path": str(scratch.path / "result.pt"),
            "phase_path": str(scratch.path / "phase"),
            "gate_path": str(scratch.path / "gate") if gate else None,
            "gate_wait_s": timeout_s + 2 * lease_wait_bound,
            "environment": scratch.env,  # a forked child takes it whole (kpipe.gym.pool)
        }
        job_file = scratch.path / "job.json"
        job_file.write_text(json.dumps(job))
    except BaseException:
        if waiting is not None:
            waiting.discard()
        shutil.rmtree(scratch.path, ignore_errors=True)
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
        captures = [BoundedCapture(stream) for stream in streams]
        for capture in captures:
            capture.start()
        partial = None
        timed_out = False
        lease_wait_s = 0.0

        def held_up() -> float:
            """Seconds the child could not run, which are nobody's fault: waiting at the gate for the
            lease, or stopped while another child timed. Its pauser stops it during the wait too (the
            lease is held elsewhere), so the two overlap and count once: subtracting both made a
            long wait shrink the child's wall time below its own timed trials, and honest kernels
            were judged timing_inconsistent when many evaluations shared a GPU."""
            return max(lease_wait_s, pauser.paused_s()) if pauser is not None else lease_wait_s

        def deadline() -> float:
            return start + timeout_s + held_up()

        with ExitStack() as held:
            try:
                if gate is not None:
                    partial, go = wait_at_gate(proc, scratch.path, deadline, gate)
                    leased = go and lease is not None
                    if leased:
                        lease_wait_s = held.enter_context(lease.hold())  # type: ignore[union-attr]
                        pauser.take_over()  # type: ignore[union-attr]
                    if partial is not None:
                        answer_gate(scratch.path, go)
                # a leased child keeps the lease until it has exited: its context's teardown (GPU
                # memory freed, page tables unmapped) is GPU work, which no timed region may run beside
                wait_for_exit(proc, deadline)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                kill_group(proc.pid)  # also reaps anything the child left behind in its group
                proc.wait()  # a lease still held (a timeout) is released only after this
                if pauser is not None:
                    pauser.finish()
                if trusted:
                    process_caches().seal()
        exited = time.monotonic()
        wall_s = exited - start
        for capture in captures:
            capture.join(timeout=5)
            capture.stream.close()
        phase_file = scratch.path / "phase"
        result_file = scratch.path / "result.pt"
        payload = None if timed_out else load_payload(result_file)
        phase = phase_file.read_text() if phase_file.exists() else ""
        result_bytes = result_file.stat().st_size if result_file.exists() else 0
        shutil.rmtree(scratch.path, ignore_errors=True)
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
        )
    except BaseException:  # the scratch is removed above on the way out; here on every other
        shutil.rmtree(scratch.path, ignore_errors=True)
        raise


@dataclass
class Scratch:
    """A child's scratch directory (its cwd, temporary files and, for a candidate, its compile
    caches and all it may write), its environment, and the job keys that confine it."""

    path: Path
    env: dict[str, str]
    confinement: dict[str, Any]


def make_scratch(role: str, device: str) -> Scratch:
    """A new scratch directory and the environment of a child of `role` (``kpipe.gym.environment``
    with the compile caches of ``kpipe.gym.compile_caches``); a candidate's is sandboxed to it."""
    path = Path(tempfile.mkdtemp(prefix=f"kgym-{role}-"))
    try:
        caches = process_caches()
        trusted = role == "reference"
        env = child_environment(device, os.environ, caches.for_reference() if trusted else caches.for_candidate(path / "compile-cache"))
        return Scratch(path, env, {} if trusted else candidate_confinement(path, env))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


@dataclass
class WaitingChild:
    """A candidate child started before its job (``kpipe.gym.zygote.ZygoteLauncher``): in its
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
        shutil.rmtree(self.scratch.path, ignore_errors=True)


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


def wait_at_gate(
    proc: subprocess.Popen[bytes], scratch: Path, deadline: Callable[[], float], gate: Callable[[dict[str, Any]], bool]
) -> tuple[dict[str, Any] | None, bool]:
    """Wait for the child's partial result (or its exit); return it and the gate's go/stop."""
    partial_path = scratch / "partial.pt"
    if not wait_for_file(proc, partial_path, deadline):
        return None, False
    partial = load_payload(partial_path)
    return partial, partial is not None and gate(partial)


def wait_for_file(proc: subprocess.Popen[bytes], path: Path, deadline: Callable[[], float]) -> bool:
    """Whether the child wrote `path` (False: it exited first); TimeoutExpired past `deadline()`."""
    while not path.exists():
        if proc.poll() is not None:
            return path.exists()
        if time.monotonic() > deadline():
            raise subprocess.TimeoutExpired(proc.args, 0)
        time.sleep(GATE_POLL_S)
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


def answer_gate(scratch: Path, go: bool) -> None:
    tmp = scratch / "gate.tmp"
    tmp.write_text("go" if go else "stop")
    os.replace(tmp, scratch / "gate")
