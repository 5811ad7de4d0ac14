"""One evaluation worker per GPU: the process that judges.

The pool starts it as a fresh interpreter with ``CUDA_VISIBLE_DEVICES`` pinned to its GPU (so
a caller holding a CUDA context is harmless); it runs the core's ``evaluate()`` for each job it
is sent, with every candidate and reference run in a child forked from its zygote
(``kpipe.gym.confine.zygote``) or, without fork, in a fresh interpreter. ``WorkerHandle`` is the pool's
end of the connection.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any


from kpipe.gym.confine.environment import worker_environment
from kpipe.gym.protocol import Protocol
from kpipe.gym.judge.result import REFERENCE_ERROR
from kpipe.gym.confine.sandbox import require_confinement
from kpipe.infra.process import PR_SET_DUMPABLE, exit_without_teardown, kill_group, prctl, process_age
from kpipe.gym.confine.zygote import Zygote, ZygoteLauncher

WORKER_START_TIMEOUT_S = 300.0


@dataclass
class Job:
    job_id: int
    reference: str
    candidate: str
    key: str
    future: Future[Any]
    priority: int = 0  # the queue serves the highest first (kpipe.gym.serve.pool.JobQueue)
    attempts: int = 0
    losses: list[str] = field(default_factory=list)
    # set when its reference ran out of memory beside other evaluations: the GPU (slot's `gpu`) it
    # is retried on alone, the other workers there held off (kpipe.gym.serve.pool.JobQueue)
    alone_on: str | None = None
    alone: bool = False


def worker_main(conn_fd: int, protocol_json: str, reuse_reference: bool, fork: bool) -> None:
    """Serve evaluations over `conn_fd` until the pool closes it. Messages in:
    ``(job_id, reference_src, candidate_src)``; out: ``("ready", info)`` once, then
    ``(job_id, kind, payload)`` with kind ``ok`` (a result row), ``reference_error`` or
    ``worker_error`` (the judge itself raised: the pool treats it like a dead worker)."""
    prctl(PR_SET_DUMPABLE, 0)  # no process of the same user reads this judge's memory or /proc entries
    marks = [("interpreter start", time.monotonic() - (process_age(os.getpid()) or 0.0))]
    # the zygote imports torch and triton in its own interpreter while this one does the same
    zygote: Zygote | None = Zygote(dict(os.environ)) if fork else None
    marks.append(("interpreter, worker module, zygote launched", time.monotonic()))
    import triton  # noqa: F401 - every result names its version: imported here, while the zygote starts, not in the first evaluation
    from kpipe.gym.judge import evaluation
    from kpipe.gym.confine.isolate import fresh_interpreter

    marks.append(("judge's imports", time.monotonic()))
    gc.freeze()  # the imports are never garbage: no collection walks them while the judge clocks a child

    conn = Connection(conn_fd)
    protocol = Protocol.from_json(protocol_json)

    def current_zygote() -> Zygote:
        nonlocal zygote
        if zygote is None or not zygote.alive():
            zygote = Zygote(dict(os.environ))
        return zygote

    info = {"pid": os.getpid(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES") or None, "fork": fork}
    try:
        info["confined"] = require_confinement()  # refuses to serve where candidates cannot be confined
        marks.append(("confinement probe", time.monotonic()))
        device = evaluation.resolve_device(protocol)
        info["device_kind"] = evaluation.device_kind(device)
        marks.append(("device", time.monotonic()))
        if fork:
            current_zygote().wait_ready()
            marks.append(("zygote ready", time.monotonic()))
        # where its start-up went (instrumentation: the pool shows it in /workers), the zygote's
        # own parts beside (they overlap the judge's)
        info["start_phases"] = {name: round(end - begin, 3) for (_, begin), (name, end) in zip(marks, marks[1:])}
        if zygote is not None:
            info["start_phases"].update({name: round(seconds, 3) for name, seconds in zygote.start_phases.items()})
    except Exception as exc:  # noqa: BLE001 - reported to the pool, which refuses to start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", info))
    launch = ZygoteLauncher(current_zygote, device, protocol.to_dict()) if fork else fresh_interpreter
    while True:
        try:
            job_id, reference, candidate = conn.recv()
        except (EOFError, OSError):
            break
        try:
            result = evaluation.evaluate(reference, candidate, protocol, reuse_reference=reuse_reference, launch=launch)
            reply = (job_id, "ok", result.to_row())
        except (evaluation.ReferenceFailure, ValueError, TypeError) as exc:
            reply = (job_id, REFERENCE_ERROR, str(exc)[:2000])
        except Exception:  # noqa: BLE001 - a bug in the judge: the pool re-queues the job once
            reply = (job_id, "worker_error", traceback.format_exc()[-2000:])
        conn.send(reply)
    if isinstance(launch, ZygoteLauncher):
        launch.close()
    if zygote is not None:
        zygote.close()


class WorkerHandle:
    """One worker process seen from the pool."""

    def __init__(self, gpu: str | None, protocol: Protocol, reuse_reference: bool, fork: bool, cpu_threads: int | None) -> None:
        started = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [sys.executable, "-m", "kpipe.gym.serve.worker", str(theirs.fileno()), protocol.to_json(),
                   "reuse" if reuse_reference else "fresh-reference", "fork" if fork else "spawn"]
        self.process = subprocess.Popen(
            command, pass_fds=(theirs.fileno(),), env=worker_environment(os.environ, gpu, cpu_threads),
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        if not self.conn.poll(WORKER_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"evaluation worker for GPU {gpu} did not start within {WORKER_START_TIMEOUT_S:g} s")
        try:
            kind, info = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"evaluation worker for GPU {gpu} died while starting (exit code {self.process.wait()})") from None
        if kind != "ready":
            self.stop()
            raise RuntimeError(f"evaluation worker for GPU {gpu} could not start: {info}")
        self.info: dict[str, Any] = info
        self.start_s = time.monotonic() - started

    def evaluate(self, job: Job, reply_timeout_s: float) -> tuple[str, Any]:
        """(kind, payload); kind ``lost`` when the worker died or hung (it is then stopped)."""
        try:
            self.conn.send((job.job_id, job.reference, job.candidate))
            if not self.conn.poll(reply_timeout_s):
                self.stop()
                return "lost", f"the worker did not answer within {reply_timeout_s:g} s and was killed"
            job_id, kind, payload = self.conn.recv()
        except (EOFError, OSError):
            code = self.process.poll()
            self.stop()
            return "lost", f"the worker process died (exit code {code})"
        if job_id != job.job_id:
            self.stop()
            return "lost", "the worker answered for another job"
        return kind, payload

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.conn.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(self.process.pid)
            self.process.wait()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the pool, which closes us
    worker_main(int(sys.argv[1]), sys.argv[2], sys.argv[3] == "reuse", sys.argv[4] == "fork")
    exit_without_teardown()
