"""The worker's fork server: one process that imports torch, triton and ``kpipe.gym.child``
once, warms Triton's compiler (``warm_triton_compiler``: host work only), never touches CUDA,
and forks one child per reference/candidate run.

A forked child starts in milliseconds instead of the seconds a fresh interpreter needs, and
runs the core's ``run_child`` unchanged in its own session, so a timeout kills its whole
process group exactly as on the fresh-interpreter path (``kpipe.gym.isolate``). The zygote is
a subreaper: whatever a candidate leaves behind is reparented to it and killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


from kpipe.infra.process import PR_SET_DUMPABLE, become_subreaper, kill_children, prctl

# what every child would otherwise import itself (torch._dynamo and the profiler alone cost
# a child about a second: kpipe.gym.child.prime_lazy_state imports them); none touches CUDA
PRELOAD = ("torch", "torch._dynamo", "torch.profiler", "triton", "triton.language", "kpipe.gym.child", "kpipe.gym.isolate")
# what Triton imports at a process's first kernel launch (its argument specialiser asks for gluon's
# types): 0.26 s of every child's first launch with Triton 3.8, a third of an interpreter
# evaluation's time; imported where this Triton has them (the set moves between releases)
LAUNCH_PRELOAD = ("triton.compiler.code_generator", "triton.language.extra.libdevice",
                  "triton.experimental.gluon.nvidia.hopper", "triton.experimental.gluon.amd.gfx1250")

ZYGOTE_START_TIMEOUT_S = 300.0

ZYGOTE_GRACE_S = 30.0  # the zygote's own backstop beyond the worker's timeout

MESSAGE_BYTES = 4096


def zygote_main(sock_fd: int) -> None:
    """Import the heavy modules once, then fork one child per request and report its exit.

    Requests arrive on a SOCK_SEQPACKET socket: ``"<timeout_s> <job path>"`` with the child's
    stdout and stderr pipe ends attached (SCM_RIGHTS). Replies: ``"started <pid>"`` then
    ``"exited <pid> <returncode>"``. If the worker goes away mid-run, the child's group is
    killed and the zygote exits.
    """
    prctl(PR_SET_DUMPABLE, 0)  # its children start non-dumpable too, until they enter their sandbox
    preload()
    if os.environ.get("TRITON_INTERPRET") != "1":  # interpreter children never compile
        warm_triton_compiler()
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


def preload(launch_time: bool = True) -> None:
    """Import what every child would otherwise import itself: ``PRELOAD``, and with `launch_time`
    the ``LAUNCH_PRELOAD`` modules this Triton has."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for name in LAUNCH_PRELOAD if launch_time else ():
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)


def warm_triton_compiler() -> bool:
    """Compile one small kernel for a GPU target, on the host only, so every forked child starts
    with Triton's compiler set up (backend modules, MLIR and LLVM initialisation, ptxas's version):
    a process's first compile took about a second where the next took 0.04 s, and every candidate
    child compiles its kernels anew into its private cache (kpipe.gym.compile_caches). The
    artifacts go to a throwaway directory no child reads. The driver is never called (the target
    is given), which the end of this function checks: a zygote that initialised the driver would
    fork children with a CUDA state they cannot use. Returns whether the kernel compiled."""

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kpipe.gym.compile_caches import cache_variables

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
    for stdout/stderr, the job's sandbox (a fork is single-threaded, as entering one needs), then
    the core's ``run_child`` exactly as its ``__main__`` runs it."""
    code = 1
    try:
        from kpipe.gym.child import run_child  # preloaded by the zygote
        from kpipe.gym.sandbox import Sandbox, enter_sandbox
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
        tempfile.tempdir = None  # cached by the zygote's compiler warm-up; the child's TMPDIR is its own scratch
        if job.get("sandbox"):  # a candidate: confined before any of its code runs (kpipe.gym.isolate)
            enter_sandbox(Sandbox.from_dict(job["sandbox"]))
        else:
            prctl(PR_SET_DUMPABLE, 1)  # a reference child: as a fresh interpreter would be
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
    """The worker's handle on its fork server.

    Starting one returns at once; the first ``spawn`` (or ``wait_ready``) waits for its
    imports, so a worker can start its zygote first and import torch itself meanwhile."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kpipe.gym.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a candidate killing "its" process group cannot reach us
        )
        theirs.close()
        self.sock = ours
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        self.sock.settimeout(ZYGOTE_START_TIMEOUT_S)
        try:
            message = self.sock.recv(MESSAGE_BYTES)
        except OSError as exc:
            raise ZygoteDied(f"the fork server failed to start ({exc})") from None
        if message != b"ready":
            raise ZygoteDied(f"the fork server failed to start (exit code {self.process.poll()})")
        self.sock.settimeout(None)
        self.ready = True

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, job_path: Path, stdout_w: int, stderr_w: int, timeout_s: float) -> ForkedProcess:
        self.wait_ready()
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


if __name__ == "__main__":
    zygote_main(int(sys.argv[1]))
