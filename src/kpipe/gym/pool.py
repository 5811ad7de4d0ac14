"""KernelGym at scale: a pool of evaluation workers, one per GPU, with warm forked children.

Three kinds of process, so that no process both runs candidate code and judges it, and no
process that forks has touched CUDA or started a thread pool:

- the **pool** (the caller: agent loop, batch CLI, HTTP service) queues jobs, answers
  duplicates from the result cache, and supervises one thread per worker;
- a **worker** per GPU (``CUDA_VISIBLE_DEVICES`` pinned, a fresh interpreter, so a caller that
  holds a CUDA context is harmless) runs the core's ``evaluate()``: the judgement;
- the worker's **zygote** imports torch, triton and ``kpipe.gym.child`` once, never computes,
  and forks one child per reference/candidate run. The child calls the core's ``run_child``
  unchanged in its own session, so a timeout kills its whole process group, exactly as the
  fresh-interpreter path (``kpipe.gym.isolate``) does — minus the seconds of start-up.

A worker that dies (or a judge that raises) is replaced and its job re-queued once; a second
loss is answered with a ``crashed`` result that says why. Nothing is silently lost.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kpipe.gym.environment import worker_environment
from kpipe.gym.protocol import Protocol
from kpipe.infra.process import become_subreaper, kill_children
from kpipe.gym.result import REFERENCE_ERROR, EvalResult, reference_error

if TYPE_CHECKING:
    from kpipe.gym.cache import ResultCache

# what every child would otherwise import itself (torch._dynamo and the profiler alone cost
# a child about a second: kpipe.gym.child.prime_lazy_state imports them); none touches CUDA
PRELOAD = ("torch", "torch._dynamo", "torch.profiler", "triton", "triton.language", "kpipe.gym.child", "kpipe.gym.isolate")
MAX_ATTEMPTS = 2  # a job whose worker died is re-queued once
WORKER_START_TIMEOUT_S = 300.0
# a judge that does not answer within this much beyond the two child timeouts is hung
WORKER_SLACK_S = 120.0
ZYGOTE_GRACE_S = 30.0  # the zygote's own backstop beyond the worker's timeout
MESSAGE_BYTES = 4096


# ============================================================================ zygote


def zygote_main(sock_fd: int) -> None:
    """Import the heavy modules once, then fork one child per request and report its exit.

    Requests arrive on a SOCK_SEQPACKET socket: ``"<timeout_s> <job path>"`` with the child's
    stdout and stderr pipe ends attached (SCM_RIGHTS). Replies: ``"started <pid>"`` then
    ``"exited <pid> <returncode>"``. If the worker goes away mid-run, the child's group is
    killed and the zygote exits.
    """
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    become_subreaper()  # a candidate that daemonises stays the zygote's to kill
    sock = socket.socket(fileno=sock_fd)
    sock.sendall(b"ready")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 2)
        except OSError:
            return
        if not message:
            return
        timeout_s, job_path = message.decode().split(" ", 1)
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            forked_child(job_path, fds, sock, zygote)
        for fd in fds:
            os.close(fd)
        sock.sendall(f"started {pid}".encode())
        returncode = supervise(pid, sock, float(timeout_s) + ZYGOTE_GRACE_S)
        if returncode is None:  # the worker is gone
            return
        try:
            sock.sendall(f"exited {pid} {returncode}".encode())
        except OSError:
            return


def supervise(pid: int, sock: socket.socket, backstop_s: float) -> int | None:
    """Wait for the child; kill its group past the backstop or when the worker disappears
    (None then: nobody is left to report to)."""
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + backstop_s
    try:
        while True:
            ready, _, _ = select.select([pidfd, sock], [], [], max(deadline - time.monotonic(), 0.0))
            if pidfd in ready:
                break
            if sock in ready and not sock.recv(MESSAGE_BYTES, socket.MSG_PEEK):
                kill_process_group(pid)
                os.waitpid(pid, 0)
                return None
            if time.monotonic() >= deadline:
                kill_process_group(pid)
        _, status = os.waitpid(pid, 0)
        kill_process_group(pid)  # whatever it left behind in its group
        kill_children()  # between runs the zygote has none of its own: these escaped the group (setsid, double fork)
        return os.waitstatus_to_exitcode(status)
    finally:
        os.close(pidfd)


def forked_child(job_path: str, fds: list[int], sock: socket.socket, zygote: int) -> None:
    """Become an isolated evaluation child: own session, scrubbed environment, bounded pipes
    for stdout/stderr, then the core's ``run_child`` exactly as its ``__main__`` runs it."""
    code = 1
    try:
        from kpipe.gym.child import run_child  # preloaded by the zygote
        from kpipe.infra.process import die_with_parent

        os.setsid()
        die_with_parent(zygote)
        sock.close()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        job = json.loads(Path(job_path).read_text())
        # built by the launching worker (kpipe.gym.environment.child_environment): taken whole,
        # never rebuilt here from an environment that is being replaced
        os.environ.clear()
        os.environ.update(job["environment"])
        os.chdir(job["workdir"])
        run_child(job)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent classifies a child without a result
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # skip interpreter teardown, as the core's __main__ does
            os._exit(code)


def kill_process_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ZygoteDied(RuntimeError):
    """The fork server went away (a candidate can kill its parent): restart it."""


class Zygote:
    """The worker's handle on its fork server."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kpipe.gym.pool", "zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a candidate killing "its" process group cannot reach us
        )
        theirs.close()
        self.sock = ours
        self.sock.settimeout(WORKER_START_TIMEOUT_S)
        if self.sock.recv(MESSAGE_BYTES) != b"ready":
            raise ZygoteDied(f"the fork server failed to start (exit code {self.process.poll()})")
        self.sock.settimeout(None)

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, job_path: Path, stdout_w: int, stderr_w: int, timeout_s: float) -> ForkedProcess:
        try:
            socket.send_fds(self.sock, [f"{timeout_s} {job_path}".encode()], [stdout_w, stderr_w])
            reply = self.sock.recv(MESSAGE_BYTES).decode()
        except OSError as exc:
            raise ZygoteDied(f"the fork server is gone ({exc})") from None
        if not reply.startswith("started "):
            raise ZygoteDied("the fork server is gone")
        return ForkedProcess(int(reply.split()[1]), self.sock)

    def close(self) -> None:
        self.sock.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkedProcess:
    """The subset of ``subprocess.Popen`` that ``kpipe.gym.isolate`` uses, for a child of the
    zygote (only the zygote can wait for it; it reports the exit status)."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.args = f"forked child {pid}"
        self.returncode: int | None = None
        self._sock = sock

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._receive(remaining)
        return self.returncode

    def _receive(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return
        try:
            reply = self._sock.recv(MESSAGE_BYTES).decode()
        except OSError:
            reply = ""
        if not reply:  # the zygote died with our child: it is orphaned, kill what is left
            kill_process_group(self.pid)
            self.returncode = -signal.SIGKILL
            return
        _, pid, code = reply.split()
        if int(pid) == self.pid:
            self.returncode = int(code)


def zygote_launcher(zygote_factory: Callable[[], Zygote]) -> Callable[[Path, dict[str, str], float], tuple[Any, list[Any]]]:
    """A ``kpipe.gym.isolate.Launcher`` that forks each child from the worker's warm zygote
    (torch and triton already imported, CUDA untouched) instead of starting an interpreter.
    The child takes its environment from the job file (``run_isolated`` writes `env` there)."""

    def launch(job_file: Path, env: dict[str, str], timeout_s: float) -> tuple[Any, list[Any]]:
        pipes = [os.pipe(), os.pipe()]
        try:
            proc = zygote_factory().spawn(job_file, pipes[0][1], pipes[1][1], timeout_s)
        except BaseException:
            for read_end, _ in pipes:
                os.close(read_end)
            raise
        finally:
            for _, write_end in pipes:
                os.close(write_end)
        return proc, [open(read_end, "rb") for read_end, _ in pipes]

    return launch


# ============================================================================ worker


def worker_main(conn_fd: int, protocol_json: str, reuse_reference: bool, fork: bool) -> None:
    """Serve evaluations over `conn_fd` until the pool closes it. Messages in:
    ``(job_id, reference_src, candidate_src)``; out: ``("ready", info)`` once, then
    ``(job_id, kind, payload)`` with kind ``ok`` (a result row), ``reference_error`` or
    ``worker_error`` (the judge itself raised: the pool treats it like a dead worker)."""
    from kpipe.gym import evaluation
    from kpipe.gym.isolate import fresh_interpreter

    conn = Connection(conn_fd)
    protocol = Protocol.from_json(protocol_json)
    zygote: Zygote | None = None

    def current_zygote() -> Zygote:
        nonlocal zygote
        if zygote is None or not zygote.alive():
            zygote = Zygote(dict(os.environ))
        return zygote

    info = {"pid": os.getpid(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES") or None, "fork": fork}
    try:
        info["device_kind"] = evaluation.device_kind(evaluation.resolve_device(protocol))
        if fork:
            current_zygote()
    except Exception as exc:  # noqa: BLE001 - reported to the pool, which refuses to start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", info))
    launch = zygote_launcher(current_zygote) if fork else fresh_interpreter
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
    if zygote is not None:
        zygote.close()


# ============================================================================ pool


@dataclass
class Job:
    job_id: int
    reference: str
    candidate: str
    key: str
    future: Future[Any]
    attempts: int = 0
    losses: list[str] = field(default_factory=list)


@dataclass
class WorkerState:
    """What ``workers`` reports (the HTTP service's /workers endpoint)."""

    slot: int
    gpu: str | None
    pid: int | None = None
    device_kind: str = ""
    busy_with: str | None = None  # key of the job being evaluated
    done: int = 0
    restarts: int = 0
    last_loss: str = ""
    alive: bool = False


class WorkerHandle:
    """One worker process seen from the pool."""

    def __init__(self, gpu: str | None, protocol: Protocol, reuse_reference: bool, fork: bool, cpu_threads: int | None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [sys.executable, "-m", "kpipe.gym.pool", "worker", str(theirs.fileno()), protocol.to_json(),
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
            kill_process_group(self.process.pid)
            self.process.wait()


def default_slots(workers: int | None, gpus: Sequence[str] | None = None) -> list[str | None]:
    """One slot per GPU of `gpus` (default: every visible GPU); without GPUs, `workers`
    interpreter slots (default: half the cores, at least one — each interpreter child also uses
    threads)."""
    from kpipe.infra.gpu import visible_gpus

    gpus = list(gpus) if gpus is not None else visible_gpus()
    if gpus:
        return list(gpus[:workers] if workers else gpus)
    return [None] * (workers or max(1, (os.cpu_count() or 2) // 2))


class GymPool:
    """Evaluates (reference, candidate) pairs under one fixed protocol on a pool of workers.

    ``evaluate_many(jobs)`` is the interface of ``kpipe.agent``'s evaluators; ``submit`` gives
    a future per job (the HTTP service uses it). Results come back in job order: EvalResult
    objects, or for a reference that itself fails, a ``reference_error`` mapping (as
    ``LocalEvaluator`` returns). Identical jobs are evaluated once (in flight and via `cache`).
    """

    def __init__(
        self,
        protocol: Protocol | None = None,
        workers: int | None = None,
        cache: ResultCache | None = None,
        reuse_reference: bool = False,
        fork: bool = True,
        progress: bool = True,
        gpus: Sequence[str] | None = None,
    ) -> None:
        self.protocol = protocol or Protocol()
        self.cache = cache
        self.progress = progress
        self.reuse_reference = reuse_reference
        self.fork = fork
        slots = default_slots(workers, gpus)
        self._cpu_threads = None if slots[0] is not None else max(1, (os.cpu_count() or 1) // len(slots))
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight: dict[str, Future[Any]] = {}
        self._next_id = 0
        self._closed = False
        self.states = [WorkerState(slot=i, gpu=gpu) for i, gpu in enumerate(slots)]
        handles = self._start_all(slots)
        kinds = {h.info["device_kind"] for h in handles}
        if len(kinds) != 1:
            for handle in handles:
                handle.stop()
            raise RuntimeError(f"the GPUs differ ({', '.join(sorted(kinds))}): run one pool per GPU kind")
        self.device_kind: str = kinds.pop()
        self._threads = [
            threading.Thread(target=self._serve_slot, args=(state, handle), daemon=True, name=f"kgym-slot-{state.slot}")
            for state, handle in zip(self.states, handles)
        ]
        for thread in self._threads:
            thread.start()

    def _start_all(self, slots: list[str | None]) -> list[WorkerHandle]:
        results: list[WorkerHandle | BaseException | None] = [None] * len(slots)

        def start(i: int) -> None:
            try:
                results[i] = self._start_worker(self.states[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                results[i] = exc

        threads = [threading.Thread(target=start, args=(i,)) for i in range(len(slots))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for handle in results:
                if isinstance(handle, WorkerHandle):
                    handle.stop()
            raise errors[0]
        return results  # type: ignore[return-value]

    def _start_worker(self, state: WorkerState) -> WorkerHandle:
        handle = WorkerHandle(state.gpu, self.protocol, self.reuse_reference, self.fork, self._cpu_threads)
        state.pid = handle.info["pid"]
        state.device_kind = handle.info["device_kind"]
        state.alive = True
        return handle

    # ------------------------------------------------------------------ public API

    def key(self, reference: str, candidate: str) -> str:
        from kpipe.gym.evaluation import eval_key

        return eval_key(reference, candidate, self.protocol, self.device_kind)

    def submit(self, reference: str, candidate: str) -> Future[Any]:
        """A future of the result; answered at once from the cache or an identical job in flight."""
        if not isinstance(reference, str) or not isinstance(candidate, str):
            raise TypeError("reference and candidate must be program source text")
        key = self.key(reference, candidate)
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is closed")
            if key in self._in_flight:
                return self._in_flight[key]
            cached = self.cache.get(key) if self.cache is not None else None
            future: Future[Any] = Future()
            if cached is not None:
                future.set_result(cached)
                return future
            self._in_flight[key] = future
            self._next_id += 1
            job = Job(self._next_id, reference, candidate, key, future)
        self._queue.put(job)
        return future

    def evaluate_many(self, jobs: Iterable[tuple[str, str]]) -> list[Any]:
        """Evaluate every (reference_src, candidate_src) pair; results in the same order."""
        futures = [self.submit(reference, candidate) for reference, candidate in jobs]
        bar = tqdm(total=len(futures), desc="evaluate", unit="eval", disable=not self.progress, leave=False)
        failures = 0
        pending = set(range(len(futures)))
        with bar:
            while pending:
                finished = [i for i in pending if futures[i].done()]
                for i in finished:
                    pending.discard(i)
                    failures += not is_pass(futures[i].result())
                if finished:
                    bar.update(len(finished))
                    bar.set_postfix(failures=failures, refresh=False)
                else:
                    time.sleep(0.05)
        return [future.result() for future in futures]

    def evaluate(self, reference: str, candidate: str, timeout_s: float | None = None) -> Any:
        return self.submit(reference, candidate).result(timeout=timeout_s)

    def pending(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def workers(self) -> list[dict[str, Any]]:
        return [dict(vars(state)) for state in self.states]

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> GymPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ supervision

    def _reply_timeout(self) -> float:
        return 2 * self.protocol.timeout_s + WORKER_SLACK_S

    def _serve_slot(self, state: WorkerState, handle: WorkerHandle | None) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            if handle is None:
                handle = self._restart(state)
                if handle is None:
                    self._lose(job, state, f"could not restart the worker: {state.last_loss}")
                    continue
            state.busy_with = job.key
            job.attempts += 1
            kind, payload = handle.evaluate(job, self._reply_timeout())
            state.busy_with = None
            if kind in ("lost", "worker_error"):
                if kind == "lost":  # replace it now, so /workers never shows a dead one idle
                    state.alive = False
                    handle = self._restart(state)
                self._lose(job, state, payload)
                continue
            state.done += 1
            if kind == "ok":
                result: Any = EvalResult.from_row(payload)
                if self.cache is not None:
                    self.cache.put(result)
            else:
                result = reference_error(payload)
            self._finish(job, result)
        if handle is not None:
            handle.stop()
        state.alive = False

    def _restart(self, state: WorkerState) -> WorkerHandle | None:
        try:
            handle = self._start_worker(state)
        except Exception as exc:  # noqa: BLE001 - the next job is failed with this reason
            state.last_loss = f"restart failed: {exc}"
            return None
        state.restarts += 1
        return handle

    def _lose(self, job: Job, state: WorkerState, why: str) -> None:
        """Re-queue a job whose worker was lost once; the second loss is its result."""
        state.last_loss = last_line(why)
        job.losses.append(why)
        if job.attempts < MAX_ATTEMPTS:
            self._queue.put(job)
            return
        self._finish(job, lost_result(job, self.protocol, self.device_kind))

    def _finish(self, job: Job, result: Any) -> None:
        with self._lock:
            self._in_flight.pop(job.key, None)
        job.future.set_result(result)


def last_line(text: str) -> str:
    """The line that says what happened (a traceback's last)."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def is_pass(result: Any) -> bool:
    return (result.status if isinstance(result, EvalResult) else result.get("status")) == "pass"


def lost_result(job: Job, protocol: Protocol, device_kind: str) -> EvalResult:
    """A ``crashed`` result for a job that lost its worker twice; never cached (the next
    run tries again)."""
    from kpipe.data.source_text import source_hash

    diagnostic = f"the evaluation worker was lost {len(job.losses)} times on this candidate: " + " | ".join(map(last_line, job.losses))
    return EvalResult(
        key=job.key, reference_hash=source_hash(job.reference), candidate_hash=source_hash(job.candidate),
        status="crashed", diagnostic=diagnostic[:3000], feedback=f"Status: crashed\n{diagnostic[:1000]}",
        device=device_kind, protocol_version=protocol.version, protocol=protocol.to_json(),
    )


def main(argv: list[str]) -> None:
    """Process entry points: ``zygote FD`` and ``worker FD PROTOCOL_JSON REUSE FORK``."""
    if argv[0] == "zygote":
        zygote_main(int(argv[1]))
    elif argv[0] == "worker":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the pool, which closes us
        worker_main(int(argv[1]), argv[2], argv[3] == "reuse", argv[4] == "fork")
    else:
        raise SystemExit(f"unknown role {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
