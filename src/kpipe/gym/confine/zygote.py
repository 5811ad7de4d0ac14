"""The worker's fork server: one process that imports torch, triton and ``kpipe.gym.candidate.child``
once, warms Triton's compiler (``warm_triton_compiler``: host work only), never touches CUDA,
and forks one child per reference/candidate run.

A forked child starts in milliseconds instead of the seconds a fresh interpreter needs, and
runs the core's ``run_child`` unchanged in its own session, so a timeout kills its whole
process group exactly as on the fresh-interpreter path (``kpipe.gym.confine.isolate``). The zygote is
a subreaper: whatever a candidate leaves behind is reparented to it and killed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


from kpipe.gym.confine.environment import fork_server_environment
from kpipe.gym.confine.lease import ChildPauser, TimingLease
from kpipe.infra.process import PR_SET_DUMPABLE, become_subreaper, exit_without_teardown, kill_children, kill_group, prctl

if TYPE_CHECKING:  # kpipe.gym.confine.isolate imports torch, which the worker imports only after starting its zygote
    from kpipe.gym.confine.isolate import WaitingChild

# what every child would otherwise import itself; none touches CUDA. PRELOAD before the zygote
# says it is ready: what a reference child needs, and a worker's first child is its first
# evaluation's reference run
PRELOAD = ("torch", "triton", "triton.language", "kpipe.gym.candidate.child", "kpipe.gym.confine.isolate")
# what only candidate children need (kpipe.gym.candidate.child.prime_lazy_state imports it: about a second
# of a child's start; torch imports its profiler itself). A zygote whose children compile for a GPU
# imports it after it is ready, beside its first child (``deferred_preload``): it was 40 % of a
# zygote's imports, and those 7.7-8.4 s on a 4x H200 host were the pool's start
# (`965801b:docs/gpu-results/gym_scaling_2026-11-27f_4xH200.md`)
CANDIDATE_PRELOAD = ("torch._dynamo",)
# what Triton imports at a process's first kernel launch (its argument specialiser asks for gluon's
# types): 0.26 s of every child's first launch with Triton 3.8, a third of an interpreter
# evaluation's time; imported where this Triton has them (the set moves between releases)
LAUNCH_PRELOAD = ("triton.compiler.code_generator", "triton.language.extra.libdevice",
                  "triton.experimental.gluon.nvidia.hopper", "triton.experimental.gluon.amd.gfx1250")

ZYGOTE_START_TIMEOUT_S = 300.0
# the deferred preload begins at the zygote's first fork, or after this long without one
DEFERRED_PRELOAD_IDLE_S = 1.0

ZYGOTE_GRACE_S = 30.0  # the zygote's own backstop beyond the worker's timeout

MESSAGE_BYTES = 4096


def zygote_main(sock_fd: int) -> None:
    """Import the heavy modules once, then fork children on request and report their exits.

    Requests arrive on a SOCK_SEQPACKET socket: ``"spawn <timeout_s> <job path>"`` with the
    child's stdout and stderr pipe ends attached (SCM_RIGHTS), and for a child that starts
    before its job (``ZygoteLauncher``) a third, the pipe its job's path will come through; its
    timeout is ``inf`` until ``"arm <pid> <timeout_s>"`` says its job has started. Replies:
    ``"started <pid>"`` to a spawn, ``"exited <pid> <returncode>"`` when a child ends. If the
    worker goes away, every child's group is killed and the zygote exits.
    """
    prctl(PR_SET_DUMPABLE, 0)  # its children start non-dumpable too, until they enter their sandbox
    started = time.monotonic()
    import_modules(PRELOAD)
    start_phases = {"zygote: imports": time.monotonic() - started}  # instrumentation: the worker reports it
    deferred = deferred_preload()
    if os.environ.get("TRITON_INTERPRET") == "1":
        # children timed on the host's own clock (the interpreter on a CPU): nothing of the
        # zygote's runs beside them, and a host of few cores has none to spare for it
        started = time.monotonic()
        while deferred:
            deferred.pop(0)()
        start_phases["zygote: candidates' preload"] = time.monotonic() - started
    become_subreaper()  # a candidate that daemonises stays the zygote's to kill
    # any child's exit wakes the loop (a byte on `wake`): an orphan reparented here is reaped when
    # it ends, not at the next supervised child's exit
    wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # (read end, write end)
    signal.set_wakeup_fd(wake[1], warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    sock = socket.socket(fileno=sock_fd)
    sock.sendall(b"ready " + json.dumps(start_phases).encode())
    children: dict[int, Supervised] = {}
    # the rest of the preload runs beside the loop from the first fork on (that child, the first
    # evaluation's reference, needs none of it) or once the zygote is idle; a later child is
    # forked only once all of it is done (DeferredPreload)
    preload = DeferredPreload(deferred, wake[1])
    begin_deferred = time.monotonic() + DEFERRED_PRELOAD_IDLE_S
    try:
        while True:
            idle_s = max(begin_deferred - time.monotonic(), 0.0) if preload.unbegun() else None
            if not serve_one_event(sock, children, wake, idle_s, preload):
                break
            preload.raise_failure()
            if preload.unbegun() and time.monotonic() >= begin_deferred:
                preload.begin()
    finally:
        for pid, child in children.items():
            kill_group(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            os.close(child.pidfd)


class DeferredPreload:
    """The zygote's preload after it is ready (``deferred_preload``), run in a thread beside the
    zygote's loop, so that a child's exit is reported the moment it happens.

    Run between the loop's events instead, its steps (3-7 s in all on a GPU host) held back the
    report of a worker's first child's exit; that child's judge held its GPU's timing lease until
    the report, and the other worker's child on the GPU stayed stopped meanwhile: 2-5.5 s of
    every GPU's first evaluations in ``965801b:docs/gpu-results/gym_scaling_2026-11-27l_4xH200.md`` and
    ``…27m…``. A fork never runs beside a step: the first child (which needs none of it) waits for
    the step under way (``pause``), every later one for all of it (``complete``), so each child
    starts with one thread and whole modules. While a step runs, the loop neither reaps nor kills
    children it does not supervise (``running``): they may be the step's own compiler processes;
    the thread wakes the loop when it stops, and the loop does both then."""

    def __init__(self, steps: list[Callable[[], object]], wake_fd: int) -> None:
        self.steps = steps
        self.wake_fd = wake_fd
        self.forks = 0
        self.owes_cleanup = False  # a supervised child exited while a step ran: kill_children once none does
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def unbegun(self) -> bool:
        """Steps are left, none runs and none failed."""
        return bool(self.steps) and not self.running() and self._error is None

    def raise_failure(self) -> None:
        """A failed step's exception, raised in the loop's thread once the step has ended: the
        zygote then exits, as it does when an import of its start fails."""
        if self._error is not None and not self.running():
            raise self._error

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin(self) -> None:
        if self.unbegun():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kpipe-zygote-preload", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            while self.steps and not self._stop.is_set():
                self.steps[0]()
                self.steps.pop(0)
        except BaseException as exc:  # noqa: BLE001 - raised in the loop's thread (raise_failure, before_fork)
            self._error = exc
        finally:
            with contextlib.suppress(OSError):
                os.write(self.wake_fd, b"p")

    def pause(self) -> None:
        """Wait for the step under way; the rest waits for ``begin``."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def complete(self) -> None:
        """Every step done, here if not in the thread."""
        self.pause()
        while self.steps:
            self.steps.pop(0)()

    def before_fork(self) -> None:
        (self.pause if self.forks == 0 else self.complete)()
        self.forks += 1


@dataclass
class Supervised:
    """A child of the zygote: the descriptor its exit shows on, and when to kill it."""

    pidfd: int
    deadline: float  # time.monotonic(); inf while a child waits for its job


def serve_one_event(sock: socket.socket, children: dict[int, Supervised], wake: tuple[int, int], idle_s: float | None,
                    preload: DeferredPreload) -> bool:
    """Wait for a request, a child's exit, a deadline or a byte on the `wake` pipe (SIGCHLD, the
    preload's end), at most `idle_s` (None: no limit), and handle it; False once the worker is gone.
    A child past its deadline has its group killed (again each second until it exits); an orphan
    that ended here is reaped, and one still running is killed after a supervised child's exit
    (neither while the preload runs: ``DeferredPreload``). A fork waits for the preload as
    ``DeferredPreload.before_fork`` says, and the preload goes on after it."""
    now = time.monotonic()
    soonest = min((child.deadline for child in children.values()), default=math.inf)
    wait_s = min(max(soonest - now, 0.0), math.inf if idle_s is None else idle_s)
    ready, _, _ = select.select([sock, wake[0], *(child.pidfd for child in children.values())], [], [],
                                None if wait_s == math.inf else wait_s)
    if wake[0] in ready:
        with contextlib.suppress(BlockingIOError):
            while os.read(wake[0], 512):
                pass
    if sock in ready:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 3)
        except OSError:
            return False
        if not message:
            return False
        kind, first, rest = message.decode().split(" ", 2)
        if kind == "arm":
            if int(first) in children:
                children[int(first)].deadline = time.monotonic() + float(rest) + ZYGOTE_GRACE_S
        else:
            preload.before_fork()
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                forked_child(rest, fds, [sock.fileno(), *wake, *(child.pidfd for child in children.values())], zygote)
            for fd in fds:
                os.close(fd)
            children[pid] = Supervised(os.pidfd_open(pid), time.monotonic() + float(first) + ZYGOTE_GRACE_S)
            preload.begin()
            if not send(sock, f"started {pid}"):
                return False
    for pid, child in list(children.items()):
        if child.pidfd in ready:
            _, status = os.waitpid(pid, 0)
            kill_group(pid)  # whatever it left behind in its group
            os.close(child.pidfd)
            del children[pid]
            # the zygote's only own children are those it supervises: the rest escaped their
            # group (setsid, double fork) and were reparented here
            if preload.running():
                preload.owes_cleanup = True
            else:
                kill_children(keep=children.keys())
            if not send(sock, f"exited {pid} {os.waitstatus_to_exitcode(status)}"):
                return False
        elif time.monotonic() >= child.deadline:
            kill_group(pid)
            child.deadline = time.monotonic() + 1.0
    if not preload.running():
        if preload.owes_cleanup:
            kill_children(keep=children.keys())
            preload.owes_cleanup = False
        reap_orphans(children)
    return True


def reap_orphans(children: dict[int, Supervised]) -> None:
    """Reap the ended children of the zygote that it does not supervise: orphans reparented to it
    (a killed sandbox's init). Stops at a supervised child's exit, which its pidfd reports and
    whose status is its worker's; the orphans behind it are reaped after it."""
    while True:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if ended is None or ended.si_pid in children:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(ended.si_pid, 0)


def send(sock: socket.socket, message: str) -> bool:
    try:
        sock.sendall(message.encode())
    except OSError:
        return False
    return True


def import_modules(names: Iterable[str], if_present: bool = False) -> None:
    """Import `names`; with `if_present`, those this installation has."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            if not if_present:
                raise


def preload(launch_time: bool = True) -> None:
    """Import what every child would otherwise import itself, at once: ``PRELOAD``,
    ``CANDIDATE_PRELOAD``, and with `launch_time` the ``LAUNCH_PRELOAD`` modules this Triton has."""
    import_modules(PRELOAD + CANDIDATE_PRELOAD)
    import_modules(LAUNCH_PRELOAD if launch_time else (), if_present=True)


def deferred_preload() -> list[Callable[[], object]]:
    """The zygote's preload after it is ready, a step each, the short ones first (a request waits
    for the step under way): the ``LAUNCH_PRELOAD`` modules this Triton has, the compiler's warm-up
    (where children compile), then ``CANDIDATE_PRELOAD``."""
    steps: list[Callable[[], object]] = [functools.partial(import_modules, LAUNCH_PRELOAD, if_present=True)]
    if os.environ.get("TRITON_INTERPRET") != "1":  # interpreter children never compile
        steps.append(warm_triton_compiler)
    steps += [functools.partial(import_modules, [name]) for name in CANDIDATE_PRELOAD]
    return steps


def warm_triton_compiler() -> bool:
    """Compile one small kernel for a GPU target, on the host only, so every forked child starts
    with Triton's compiler set up (backend modules, MLIR and LLVM initialisation, ptxas's version):
    a process's first compile took about a second where the next took 0.04 s, and every candidate
    child compiles its kernels anew into its private cache (kpipe.gym.confine.compile_caches). The
    artifacts go to a throwaway directory no child reads. The driver is never called (the target
    is given), which the end of this function checks: a zygote that initialised the driver would
    fork children with a CUDA state they cannot use. Returns whether the kernel compiled."""

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kpipe.gym.confine.compile_caches import cache_variables

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

    warmed = False
    with tempfile.TemporaryDirectory(prefix="kpipe-zygote-warm-") as scratch:
        throwaway = cache_variables(Path(scratch))
        saved = {name: os.environ.get(name) for name in throwaway}
        os.environ.update(throwaway)
        try:
            source = ASTSource(add_one, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 128})
            triton.compile(source, target=GPUTarget("cuda", 90, 32))
            warmed = True
        except Exception as exc:  # noqa: BLE001 - only a speed-up: children compile as before without it
            print(f"kpipe zygote: Triton compiler warm-up skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    if cuda_driver_initialised():
        raise RuntimeError("the fork server initialised the CUDA driver while warming Triton's compiler")
    return warmed


def cuda_driver_initialised() -> bool:
    """Whether this process has called ``cuInit``, asked without initialising anything: before
    it, every other driver call answers CUDA_ERROR_NOT_INITIALIZED (3). (Importing torch and
    triton maps libcuda without initialising it.)"""
    if "libcuda" not in Path("/proc/self/maps").read_text():
        return False
    import ctypes

    context = ctypes.c_void_p()
    return ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(context)) != 3


def forked_child(job_path: str, fds: list[int], inherited: list[int], zygote: int) -> None:
    """Become an isolated evaluation child: own session, scrubbed environment, bounded pipes
    for stdout/stderr, the job's sandbox (a fork is single-threaded, as entering one needs), then
    the core's ``run_child`` exactly as its ``__main__`` runs it. `inherited`: the zygote's own
    descriptors (its socket, the other children's pidfds), closed first.

    With a third descriptor in `fds`, the child starts before its job: `job_path` is then a
    job's preparation (environment, sandbox, scratch, device and protocol), and once it is
    confined with its device initialised (``kpipe.gym.candidate.child.prepare_device``) it waits for its
    job's path on that pipe (end of file without one: it is not needed, and exits)."""
    code = 1
    try:
        from kpipe.gym.candidate.child import run_child  # preloaded by the zygote
        from kpipe.gym.confine.limits import join_cgroups
        from kpipe.gym.confine.sandbox import Sandbox, enter_sandbox
        from kpipe.infra.process import die_with_parent

        os.setsid()
        die_with_parent(zygote)
        for fd in inherited:
            os.close(fd)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds[:2]):
            os.close(fd)
        job = json.loads(Path(job_path).read_text())
        # built by the launching worker (kpipe.gym.confine.environment.child_environment): taken whole,
        # never rebuilt here from an environment that is being replaced
        os.environ.clear()
        os.environ.update(job["environment"])
        tempfile.tempdir = None  # cached by the zygote's compiler warm-up; the child's TMPDIR is its own scratch
        join_cgroups(job.get("limits"))  # a candidate's (kpipe.gym.confine.limits), from outside its sandbox
        if job.get("sandbox"):  # a candidate: confined before any of its code runs (kpipe.gym.confine.isolate)
            enter_sandbox(Sandbox.from_dict(job["sandbox"]))
        else:
            prctl(PR_SET_DUMPABLE, 1)  # a reference child: as a fresh interpreter would be
        os.chdir(job["workdir"])
        if len(fds) == 3:
            job = wait_for_job(job, fds[2])
            if job is None:
                code = 0
                return
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


def wait_for_job(preparation: dict[str, Any], go: int) -> dict[str, Any] | None:
    """Initialise the device for `preparation`, then read the job's path from `go`: the job,
    checked to be the one prepared for, or None at end of file."""
    from kpipe.gym.candidate.child import prepare_device

    prepare_device(preparation["device"], preparation["protocol"])
    path = b""
    while chunk := os.read(go, 4096):
        path += chunk
    os.close(go)
    if not path:
        return None
    job = json.loads(Path(path.decode()).read_text())
    for key in ("environment", "sandbox", "limits", "workdir", "device", "protocol"):
        if job.get(key) != preparation.get(key):
            raise RuntimeError(f"the job's {key} is not the one this child was prepared with")
    return job


class ZygoteDied(RuntimeError):
    """The fork server went away (a candidate can kill its parent): restart it."""


class Zygote:
    """The worker's handle on its fork server.

    Starting one returns at once; the first ``spawn`` (or ``wait_ready``) waits for its
    imports, so a worker can start its zygote first and import torch itself meanwhile. Its
    replies are read by one thread (the worker's): the exit of one child may arrive while
    another is awaited, and is kept for it."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kpipe.gym.confine.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=fork_server_environment(env),  # its block is every forked child's /proc/self/environ
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a candidate killing "its" process group cannot reach us
        )
        theirs.close()
        self.sock = ours
        self.ready = False
        self.start_phases: dict[str, float] = {}  # its start-up's parts, once ready
        self.gone = False  # the zygote closed its end (it died, and its children with it)
        self._started: list[int] = []
        self._exits: dict[int, int] = {}

    def wait_ready(self) -> None:
        if self.ready:
            return
        self.sock.settimeout(ZYGOTE_START_TIMEOUT_S)
        try:
            message = self.sock.recv(MESSAGE_BYTES)
        except OSError as exc:
            raise ZygoteDied(f"the fork server failed to start ({exc})") from None
        word, _, phases = message.partition(b" ")
        if word != b"ready":
            raise ZygoteDied(f"the fork server failed to start (exit code {self.process.poll()})")
        self.sock.settimeout(None)
        self.ready = True
        self.start_phases = json.loads(phases or b"{}")

    def alive(self) -> bool:
        return self.process.poll() is None and not self.gone

    def spawn(self, job_path: Path, stdout_w: int, stderr_w: int, timeout_s: float, job_r: int | None = None) -> ForkedProcess:
        """Fork a child on `job_path`; with `job_r`, one that waits for its job's path on that
        pipe, its timeout started by ``arm``."""
        self.wait_ready()
        fds = [stdout_w, stderr_w] if job_r is None else [stdout_w, stderr_w, job_r]
        try:
            socket.send_fds(self.sock, [f"spawn {timeout_s} {job_path}".encode()], fds)
        except OSError as exc:
            raise ZygoteDied(f"the fork server is gone ({exc})") from None
        while not self._started:
            self._receive(None)
            if self.gone:
                raise ZygoteDied("the fork server is gone")
        return ForkedProcess(self._started.pop(0), self)

    def arm(self, pid: int, timeout_s: float) -> None:
        """The child `pid`, which waited for its job, has it now: its timeout starts."""
        try:
            self.sock.sendall(f"arm {pid} {timeout_s}".encode())
        except OSError:
            self.gone = True

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of child `pid`, waiting at most `timeout` seconds (None: still running).
        A child whose zygote died is killed and reported as killed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self._exits and not self.gone:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not self._receive(remaining) and remaining == 0.0:
                return None
        if pid in self._exits:
            return self._exits.pop(pid)
        kill_group(pid)  # orphaned by its zygote: kill what is left
        return -signal.SIGKILL

    def _receive(self, timeout: float | None) -> bool:
        """Read one reply if one comes within `timeout`; whether one came."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return False
        try:
            reply = self.sock.recv(MESSAGE_BYTES).decode()
        except OSError:
            reply = ""
        if not reply:
            self.gone = True
        elif reply.startswith("started "):
            self._started.append(int(reply.split()[1]))
        elif reply.startswith("exited "):
            _, pid, code = reply.split()
            self._exits[int(pid)] = int(code)
        return True

    def close(self) -> None:
        self.sock.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkedProcess:
    """The subset of ``subprocess.Popen`` that ``kpipe.gym.confine.isolate`` uses, for a child of the
    zygote (only the zygote can wait for it; it reports the exit status)."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.args = f"forked child {pid}"
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode


class ZygoteLauncher:
    """A ``kpipe.gym.confine.isolate.Launcher`` that forks each child from the worker's warm zygote
    (torch and triton already imported, CUDA untouched) instead of starting an interpreter;
    the child takes its environment from the job file (``run_isolated`` writes it there).

    It also keeps one candidate child started ahead (``start_next``, once the current candidate
    has its job; ``waiting_candidate`` takes it): confined in its scratch, its CUDA context made,
    waiting for its job. Making a context takes a child 0.5 s on an H200, 0.9 s when eight make
    theirs at once on one host (`965801b:docs/gpu-results/gym_scaling_2026-11-26d_4xH200.md`); started
    while the previous candidate runs, it costs the next one nothing. While it waits it is
    stopped with the others whenever a child times on its GPU (its pauser), so its start never
    runs beside a timed region."""

    def __init__(self, zygote_factory: Callable[[], Zygote], device: str, protocol: dict[str, Any]) -> None:
        self.zygote_factory = zygote_factory
        self.device = device
        self.protocol = protocol
        self._next: WaitingChild | None = None

    def __call__(self, job_file: Path, env: dict[str, str], timeout_s: float) -> tuple[Any, list[Any]]:
        proc, streams, _ = self._fork(job_file, timeout_s, waits=False)
        return proc, streams

    def _fork(self, job_file: Path, timeout_s: float, waits: bool) -> tuple[ForkedProcess, list[Any], int | None]:
        pipes = [os.pipe(), os.pipe()]
        job_r, job_w = os.pipe() if waits else (None, None)
        try:
            proc = self.zygote_factory().spawn(job_file, pipes[0][1], pipes[1][1], timeout_s, job_r)
        except BaseException:
            for fd in (*(read_end for read_end, _ in pipes), job_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (*(write_end for _, write_end in pipes), job_r):
                if fd is not None:
                    os.close(fd)
        return proc, [open(read_end, "rb") for read_end, _ in pipes], job_w

    def waiting_candidate(self, lease: TimingLease | None) -> WaitingChild:
        """The candidate child started ahead for this call, or one started now if there is none
        (the first call, a failed start) or it died waiting (its zygote killed)."""
        child, self._next = self._next, None
        if child is not None and child.proc.poll() is None:
            return child
        if child is not None:
            child.discard()
        return self._start_waiting(lease)

    def start_next(self, lease: TimingLease | None) -> None:
        """Start the next call's child; called once this call's child has its job, so its fork,
        scratch and context are made while that one runs, never on its path. A failure to start
        costs the current child nothing: the next call starts its own."""
        if self._next is None:
            with contextlib.suppress(ZygoteDied):
                self._next = self._start_waiting(lease)

    def _start_waiting(self, lease: TimingLease | None) -> WaitingChild:
        from kpipe.gym.confine.isolate import WaitingChild, make_scratch
        from kpipe.gym.exchange import PREPARATION_FILE
        from kpipe.gym.protocol import Protocol

        scratch = make_scratch("candidate", self.device, Protocol.from_dict(self.protocol).limits())
        try:
            preparation = {"environment": scratch.env, "workdir": str(scratch.path), "device": self.device,
                           "protocol": self.protocol, **scratch.confinement}
            preparation_file = scratch.path / PREPARATION_FILE
            preparation_file.write_text(json.dumps(preparation))
            proc, streams, job_w = self._fork(preparation_file, math.inf, waits=True)
        except BaseException:
            scratch.remove()
            raise
        zygote = proc._zygote
        pauser = ChildPauser(proc.pid, lease) if lease is not None else None
        if pauser is not None:
            pauser.start()

        def hand_over(job_file: Path, timeout_s: float) -> None:
            zygote.arm(proc.pid, timeout_s)
            with contextlib.suppress(BrokenPipeError):  # it died waiting: its exit says so
                os.write(job_w, str(job_file).encode())
            child.release()  # the end of file after the path

        child = WaitingChild(scratch, proc, streams, pauser, hand_over, job_w)
        return child

    def close(self) -> None:
        """End the child started for the next call (killed, its scratch removed)."""
        if self._next is not None:
            self._next.discard()
            self._next = None


if __name__ == "__main__":
    zygote_main(int(sys.argv[1]))
    exit_without_teardown()
