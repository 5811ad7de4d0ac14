"""The warm starter: one process of a Snakemake run imports torch, transformers, accelerate, kpipe's
trainers and evaluation stages once and forks the run's heavy one-process jobs from there
(`sft`, each `rl_iter`, `eval`, `stts`, `rl_validate`): a backend of :func:`kpipe.infra.jobs.run_job`.

Why: a fresh process pays ~10 s before an RL iteration's first step on an H200 (the imports 4.4 s,
transformers' Qwen3 modeling module and what it pulls in 5.4 s, measured with the `dag` check),
and the default DAG runs six such jobs one after another on its longest chain. Config
``warm_start: false`` (or a job without ``$KPIPE_WARM_START``) starts each job in its own Python
instead: the same outputs, seconds later.

Who may ask it (issue 52: a candidate reached the starter of old and ran commands outside its sandbox):
- it listens on an *abstract* Unix socket (Linux) whose name holds 128 random bits: no file on disk,
  and unreachable from another network namespace (a KernelGym candidate's);
- a client must run as the run's owner (``SO_PEERCRED``) and send the run's secret token
  (``$KPIPE_WARM_START_TOKEN``, compared with ``hmac.compare_digest``), which reaches jobs only
  through Snakemake's environment (the starter reads it from a pipe; :func:`kpipe.infra.jobs.run_job`
  drops both names from the job's environment before its work starts, so nothing the job starts
  inherits them);
- a client names a job of the starter's fixed table, the functions its preloaded modules marked
  forkable (:func:`register`, through kpipe.infra.jobs' decorators), and JSON arguments: never
  a module, function or command line of its own. Anything else is refused, in the starter's log and
  in the client's answer.

How, so that a forked job is the job Snakemake started in every way that matters:
- the job's process (the *client*) holds the GPU lease, connects, and sends its job, arguments,
  environment and working directory with its stdin, stdout and stderr as file descriptors
  (SCM_RIGHTS); the forked *worker* takes those over, runs the job, and its exit status comes back
  to the client, which exits with it;
- the worker starts a session of its own and ends it (SIGKILL to the group) when the client ends,
  so Snakemake killing a job (Ctrl-C, a failed run) kills its work; the starter ends with the
  run's snakemake process (a pidfd) or when ``onsuccess``/``onerror`` stop it;
- torch takes the job's thread count (Snakemake's ``OMP_NUM_THREADS``; OpenMP read the starter's
  environment when torch was imported);
- the starter never touches CUDA (``PYTORCH_NVML_BASED_CUDA_CHECK``), so each worker initialises
  CUDA itself after it has the client's ``CUDA_VISIBLE_DEVICES``, as the kpipe.gym zygote's
  children do;
- the preload is imported beside the listener (a thread): a job that starts before it is done is
  told so at once and starts its own Python rather than wait.

Not covered: Snakemake's ``benchmark:`` files of these rules measure the client, not the worker.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import json
import os
import secrets
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

WARM_START_ENV = "KPIPE_WARM_START"  # the abstract socket name of the run's starter, set by the Snakefile for its jobs
TOKEN_ENV = "KPIPE_WARM_START_TOKEN"  # the run's secret a client proves itself with
PRELOAD = ("torch", "accelerate", "transformers", "transformers.models.qwen3.modeling_qwen3", "kpipe.train.rl",
           "kpipe.train.sft", "kpipe.train.cli", "kpipe.train.jobs", "kpipe.evaluate.kernelbench",
           "kpipe.evaluate.stts")
HANDSHAKE_TIMEOUT_S = 5.0  # a client that connects and says nothing holds the starter no longer than this
MAX_REQUEST_BYTES = 1 << 20
STD_FDS = 3
LOG_NAME = "warm-start.log"

# A forkable job: "module:function" -> what runs it in this process on its JSON (args, kwargs).
# Filled by the imports of the modules that define them; the starter freezes it after its preload.
Runner = Callable[[list, dict], None]
FORKABLE: dict[str, Runner] = {}


def register(name: str, run: Runner) -> None:
    """Make job `name` one a warm starter may fork (kpipe.infra.jobs' decorators call this)."""
    FORKABLE[name] = run


class Refused(RuntimeError):
    """The run's starter refused this client's credentials, or the socket is not the run's. An
    attack, or a job of another run: the job fails rather than start elsewhere."""


def start(directory: str | os.PathLike, owner: int, preload: Sequence[str] = PRELOAD) -> dict[str, str]:
    """Start the run's starter (``python -m kpipe.infra.warm_start``) owned by `owner`, its log in
    `directory`; returns the environment its clients need (the socket's name and the token).

    The socket is bound and listening here, before the starter runs, and handed to it: a job that
    connects at once is queued, never refused."""
    import subprocess

    name = f"kpipe-warm-start-{secrets.token_hex(16)}"
    token = secrets.token_hex(32)
    Path(directory).mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, \
            open(Path(directory) / LOG_NAME, "a") as log:
        listener.bind(f"\0{name}")
        listener.listen(64)
        starter = subprocess.Popen([sys.executable, "-m", "kpipe.infra.warm_start", str(listener.fileno()), str(owner),
                                    *preload], stdin=subprocess.PIPE, stdout=log, stderr=log,
                                   pass_fds=[listener.fileno()], start_new_session=True)
        starter.stdin.write(token.encode())  # a pipe: never a file, an argument or the starter's environment
        starter.stdin.close()
    return {WARM_START_ENV: name, TOKEN_ENV: token}


def stop(environ: Mapping[str, str] = os.environ) -> None:
    """Ask the run's starter to end (``onsuccess``/``onerror``); its workers end with their jobs."""
    if (conn := _connect(environ)) is None:
        return
    with conn, contextlib.suppress(OSError):
        send_request(conn, {"token": environ.get(TOKEN_ENV, ""), "stop": True}, [])
        _read_answer(conn)  # the starter has stopped listening


def _connect(environ: Mapping[str, str]) -> socket.socket | None:
    """A connection to the run's starter, or None without one (none named, or none listening: it
    ends with its run), when a job starts the usual way."""
    name = environ.get(WARM_START_ENV)
    if not name:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        conn.connect(f"\0{name}")
    except OSError:
        conn.close()
        return None
    return conn


def send_request(conn: socket.socket, request: Mapping[str, object], fds: Sequence[int]) -> None:
    """A length-prefixed JSON request; the file descriptors ride with the length (SCM_RIGHTS)."""
    payload = json.dumps(dict(request)).encode()
    socket.send_fds(conn, [struct.pack("!I", len(payload))], list(fds))
    conn.sendall(payload)


def receive_request(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 4, STD_FDS)
    try:
        if len(header) < 4:
            raise ConnectionError("no request")
        size = struct.unpack("!I", header)[0]
        if size > MAX_REQUEST_BYTES:
            raise ValueError(f"a request of {size} bytes (at most {MAX_REQUEST_BYTES})")
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise ConnectionError("request cut short")
            data += chunk
        request = json.loads(data)
        if not isinstance(request, dict):
            raise ValueError("a request is a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _answer(conn: socket.socket, **answer: object) -> None:
    """One line to a client; one that is gone is its own business, not the starter's end."""
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(answer).encode() + b"\n")


def _read_answer(conn: socket.socket) -> dict | None:
    """The starter's next one-line answer; None when it closed the connection first."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            return None
        line += chunk
    return json.loads(line)


def fork_job(name: str, args: list, kwargs: dict, log_fd: int, say: Callable[[str], None],
             environ: Mapping[str, str]) -> int | None:
    """Run job `name` on `args` and `kwargs` in a worker of the run's starter (`environ` names it
    and holds its token), output to `log_fd`, with this process's environment and directory; its
    exit status (128 + N when signal N ended it). None when the job should start here instead: no
    starter named, or one gone, still importing or that does not know the job (`say` tells the job's
    log which). Raises :class:`Refused` when the starter refuses the credentials, or when another
    user listens on the socket (the token is never sent there)."""
    if (conn := _connect(environ)) is None:
        if environ.get(WARM_START_ENV):
            say("the run's warm starter is gone; the job runs in this process")
        return None
    with conn, open(os.devnull) as stdin:
        if (owner := peer_uid_and_pid(conn)[0]) != os.getuid():  # the token goes to the run's own starter only
            raise Refused(f"the socket {environ.get(WARM_START_ENV)!r} belongs to uid {owner}, not to this run's")
        send_request(conn, {"token": environ.get(TOKEN_ENV, ""), "job": name, "args": args, "kwargs": kwargs,
                            "env": dict(os.environ), "cwd": os.getcwd()}, [stdin.fileno(), log_fd, log_fd])
        conn.settimeout(None)  # the answer comes once the starter has read the request, the exit status when the job ends
        answer = _read_answer(conn)
        if answer is None or answer.get("status") == "starting":
            say("the run's warm starter is " + ("gone" if answer is None else "still importing")
                + "; the job runs in this process")
            return None
        if answer.get("status") == "refused":
            if answer.get("unauthenticated"):
                raise Refused(f"the run's warm starter refused this job: {answer.get('reason')}")
            say(f"the run's warm starter refused job {name}: {answer.get('reason')}; the job runs in this process")
            return None
        done = _read_answer(conn)
    if done is None:
        raise RuntimeError(f"the warm starter ({environ.get(WARM_START_ENV)}) ended before the job did")
    code = int(done["exit"])
    return 128 - code if code < 0 else code


def _worker(request: dict, fds: list[int], client: int, run: Runner) -> NoReturn:
    """In the forked child: become the job (its stdio, directory, environment), die with its
    client, run it, exit with its status."""
    code = 1
    try:
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

        threading.Thread(target=watch, daemon=True, name="client-watch").start()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        run(request["args"], request["kwargs"])
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


def peer_uid_and_pid(conn: socket.socket) -> tuple[int, int]:
    """The connected client's uid and pid, as the kernel saw them at connect (``SO_PEERCRED``)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid, pid


def token_refusal(request: dict, token: str) -> str | None:
    """Why a request is not one of the run's own jobs (None: it is): no or a wrong token."""
    offered = request.get("token")
    if not isinstance(offered, str) or not hmac.compare_digest(offered.encode(), token.encode()):
        return "no valid token (the run's $" + TOKEN_ENV + ")"
    return None


def serve(listener: socket.socket, owner: int, token: str, preload: Sequence[str] = PRELOAD) -> None:
    """Import `preload` (a thread) while answering on `listener`, then fork a worker per job of its
    table until `owner` ends or an authenticated stop request comes. One thread serves: the
    listener, the owner, the importer and every worker are file descriptors to select on."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() without a CUDA context
    ready_read, ready_write = os.pipe()
    failed: list[str] = []

    def import_preload() -> None:
        started = time.monotonic()
        try:
            for module in preload:
                importlib.import_module(module)
            print(f"warm starter: {len(preload)} modules imported in {time.monotonic() - started:.1f} s", flush=True)
        except BaseException:  # noqa: BLE001 (a starter that cannot import is none: jobs start the usual way)
            failed.append(traceback.format_exc())
        finally:
            os.write(ready_write, b"x")

    importer = threading.Thread(target=import_preload, name="preload", daemon=True)
    importer.start()
    table: dict[str, Runner] | None = None  # the jobs it forks, fixed once the preload is imported
    owner_fd = os.pidfd_open(owner)
    workers: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    while True:
        watched = [listener, owner_fd, *workers] + ([ready_read] if table is None else [])
        ready, _, _ = select.select(watched, [], [])
        if owner_fd in ready:
            return
        if ready_read in ready:
            importer.join()  # no thread runs beside a fork
            if failed:
                print(f"warm starter: the preload failed; ending\n{failed[0]}", flush=True)
                return
            table = dict(FORKABLE)
            print(f"warm starter: ready to fork {', '.join(sorted(table)) or 'no job'}", flush=True)
        for fd in ready:
            if fd in workers:
                pid, conn = workers.pop(fd)
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                with conn:
                    _answer(conn, exit=os.waitstatus_to_exitcode(status))
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        if _handle(conn, token, table, listener, workers) == "stop":
            return


def _handle(conn: socket.socket, token: str, table: Mapping[str, Runner] | None, listener: socket.socket,
            workers: dict[int, tuple[int, socket.socket]]) -> str | None:
    """Answer one connection: refuse it, tell it the starter is still importing, stop, or fork its job."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        peer_uid, client = peer_uid_and_pid(conn)
        if peer_uid != os.getuid():  # refused before a byte of its request is read
            why = f"uid {peer_uid} is not the run's owner (uid {os.getuid()})"
            print(f"warm starter: refused pid {client}: {why}", flush=True)
            _answer(conn, status="refused", unauthenticated=True, reason=why)
            conn.close()
            return None
        request, fds = receive_request(conn)
    except (OSError, ValueError, RecursionError) as error:
        print(f"warm starter: refused a client: unreadable request ({error!r})", flush=True)
        conn.close()
        return None
    job = request.get("job")
    try:
        if (why := token_refusal(request, token)) is not None:
            print(f"warm starter: refused pid {client}: {why}", flush=True)
            _answer(conn, status="refused", unauthenticated=True, reason=why)
        elif request.get("stop"):
            _answer(conn, status="stopping")
            return "stop"
        elif table is None:
            _answer(conn, status="starting")
        elif not isinstance(job, str) or job not in table:
            why = f"unknown job {job!r} (it forks {', '.join(sorted(table))})"
            print(f"warm starter: refused pid {client}: {why}", flush=True)
            _answer(conn, status="refused", unauthenticated=False, reason=why)
        else:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for _, other in workers.values():
                    other.close()
                conn.close()  # the client reads its exit status from the starter, after this process is gone
                _worker(request, fds, client, table[job])
            workers[os.pidfd_open(pid)] = (pid, conn)
            _answer(conn, status="forked", pid=pid)
            print(f"warm starter: job {job} forked as pid {pid}", flush=True)
            return None
    finally:
        for fd in fds:
            os.close(fd)
    conn.close()
    return None


if __name__ == "__main__":
    from kpipe.infra import warm_start  # the module jobs register with (FORKABLE), not this __main__ copy

    warm_start.serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]), sys.stdin.read(), sys.argv[3:])
