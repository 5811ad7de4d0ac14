"""One-process jobs without a fresh Python: a process of the Snakemake run imports torch,
transformers, accelerate, kpipe's trainers and evaluation stages once, and forks each
single-process training job (`sft`, every `rl_iter`) from there, and once it is done importing
each job that loads a local model to evaluate it (`eval`, `stts`, `rl_validate`:
``kpipe.infra.launch.job_function``).

Why: a fresh process pays ~10 s before an RL iteration's first step on an H200 (the imports 4.4 s,
transformers' Qwen3 modeling module and what it pulls in 5.4 s, measured with the `dag` check),
and the default DAG runs six such jobs one after another on its longest chain.

How, so that a forked job is the job Snakemake started in every way that matters:
- the job's process (the *client*, a thin `exec_launch`) takes the GPU lease, connects to the
  starter's Unix socket and sends its argv, environment and working directory with its stdin,
  stdout and stderr as file descriptors (SCM_RIGHTS); the forked *worker* takes those over, runs
  ``kpipe <argv>`` and its exit status comes back to the client, which exits with it;
- the worker starts a session of its own and ends it (SIGKILL to the group) when the client ends,
  so Snakemake killing a job (Ctrl-C, a failed run) kills its work; the starter ends with the
  run's snakemake process (a pidfd) or when ``onsuccess``/``onerror`` stop it;
- torch takes the job's thread count (Snakemake's ``OMP_NUM_THREADS``; OpenMP read the starter's
  environment when torch was imported);
- the starter never touches CUDA (``PYTORCH_NVML_BASED_CUDA_CHECK``), so each worker initialises
  CUDA itself after it has the client's ``CUDA_VISIBLE_DEVICES``, as the kpipe.gym zygote's
  children do.

Not covered: Snakemake's ``benchmark:`` files of these rules measure the client, not the worker.
A run whose starter cannot be reached starts jobs the usual way.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

WARM_START_ENV = "KPIPE_WARM_START"  # the socket of the run's starter, set by the Snakefile for its jobs
PRELOAD = ("torch", "accelerate", "transformers", "transformers.models.qwen3.modeling_qwen3", "kpipe.train.rl",
           "kpipe.train.sft", "kpipe.train.cli", "kpipe.evaluate.kernelbench", "kpipe.evaluate.stts")
CONNECT_TIMEOUT_S = 5.0  # the socket listens from the start; the starter answers once its imports are done
STD_FDS = 3


def socket_path(directory: str | os.PathLike) -> Path:
    return Path(directory).resolve() / "warm-start.sock"


def ready_path(socket: str | os.PathLike) -> Path:
    """Exists once the starter at `socket` has imported its preload and forks at once."""
    return Path(socket).with_suffix(".ready")


def start(directory: str | os.PathLike, owner: int, preload: Sequence[str] = PRELOAD) -> Path:
    """Start the run's starter (``python -m kpipe.infra.warm_start``) owned by `owner`, log in
    `directory`; returns its socket path, which it listens on before it imports `preload`."""
    import subprocess

    path = socket_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    ready_path(path).unlink(missing_ok=True)
    with open(path.with_suffix(".log"), "a") as log:
        subprocess.Popen([sys.executable, "-m", "kpipe.infra.warm_start", str(path), str(owner), *preload], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 30.0
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path


def stop(directory: str | os.PathLike) -> None:
    """Ask the run's starter to end (``onsuccess``/``onerror``); its workers end with their jobs."""
    path = socket_path(directory)
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(CONNECT_TIMEOUT_S)
        conn.connect(str(path))
        send_request(conn, {"stop": True}, [])
    path.unlink(missing_ok=True)
    ready_path(path).unlink(missing_ok=True)


def send_request(conn: socket.socket, request: Mapping[str, object], fds: Sequence[int]) -> None:
    """A length-prefixed JSON request; the file descriptors ride with the length (SCM_RIGHTS)."""
    payload = json.dumps(dict(request)).encode()
    socket.send_fds(conn, [struct.pack("!I", len(payload))], list(fds))
    conn.sendall(payload)


def receive_request(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 4, STD_FDS)
    if len(header) < 4:
        raise ConnectionError("no request")
    size = struct.unpack("!I", header)[0]
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("request cut short")
        data += chunk
    return json.loads(data), fds


def connect(environ: Mapping[str, str] = os.environ, ready_only: bool = False) -> socket.socket | None:
    """A connection to the run's starter, or None when there is none to ask (no run, a dead
    starter; with `ready_only`, one still importing its preload): the caller then starts the job
    the usual way."""
    path = environ.get(WARM_START_ENV)
    if not path or (ready_only and not ready_path(path).exists()):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    conn.settimeout(None)
    return conn


def run_job(conn: socket.socket, argv: Sequence[str], log_fd: int) -> int:
    """Run ``kpipe <argv>`` in a worker of the starter at `conn`, output to `log_fd`, with this
    process's environment and directory; its exit status (128 + N when signal N ended it)."""
    with conn, open(os.devnull) as stdin:
        send_request(conn, {"argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd()},
                     [stdin.fileno(), log_fd, log_fd])
        answer = b""
        while chunk := conn.recv(64):
            answer += chunk
    if not answer.strip():
        raise RuntimeError(f"the warm starter ({os.environ.get(WARM_START_ENV)}) ended before the job did")
    code = int(answer)
    return 128 - code if code < 0 else code


def _worker(conn: socket.socket, request: dict, fds: list[int], client: int) -> NoReturn:
    """In the forked child: become the job (its stdio, directory, environment), die with its
    client, run ``kpipe <argv>``, exit with its status."""
    code = 1
    try:
        conn.close()  # the client reads its exit status from the starter, after this process is gone
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and "torch" in sys.modules:  # OpenMP read the starter's environment at import
            sys.modules["torch"].set_num_threads(int(threads))
        pidfd = os.pidfd_open(client)

        def watch() -> None:  # the client gone (Snakemake killed the job): end the whole job
            select.select([pidfd], [], [])
            os.killpg(0, signal.SIGKILL)

        import threading

        threading.Thread(target=watch, daemon=True, name="client-watch").start()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # what `python -m kpipe.cli ARGV` runs (kpipe.infra.launch's command), in this process
        sys.argv = ["kpipe", *request["argv"]]
        runpy.run_module("kpipe.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 (the job's own traceback, in its log)
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: Path, owner: int, preload: Sequence[str] = PRELOAD) -> None:
    """Listen at `path`, import `preload`, then fork a worker per request until `owner` ends or a
    stop request comes. One thread: the listener, the owner and every worker are file
    descriptors to select on (a pidfd per process)."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() without a CUDA context
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    listener.bind(str(path))
    listener.listen(64)
    started = time.monotonic()
    for module in preload:
        importlib.import_module(module)
    print(f"warm starter: {len(preload)} modules imported in {time.monotonic() - started:.1f} s", flush=True)
    ready_path(path).touch()
    owner_fd = os.pidfd_open(owner)
    workers: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    while True:
        ready, _, _ = select.select([listener, owner_fd, *workers], [], [])
        if owner_fd in ready:
            return
        for fd in ready:
            if fd in workers:
                pid, conn = workers.pop(fd)
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                with contextlib.suppress(OSError), conn:
                    conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = receive_request(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if request.get("stop"):
            return
        client = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            for _, other in workers.values():
                other.close()
            _worker(conn, request, fds, client)
        for fd in fds:
            os.close(fd)
        workers[os.pidfd_open(pid)] = (pid, conn)
        print(f"warm starter: job {' '.join(request['argv'][:2])} forked as pid {pid}", flush=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
