"""One KernelGym service per Snakemake run and machine, shared by every job that evaluates.

A job that starts its own ``GymPool`` pays for the workers' start (and on a GPU a CUDA context
per worker) and times kernels next to the other jobs' pools. Instead the workflow
(``workflow/rules/common.smk``) tells its jobs, through ``$KPIPE_GYM_RUN``, where the run keeps
its service (``results/.gym``), which process owns the run (the ``snakemake`` process) and
which GPUs the machine gives the run. The first job that evaluates starts ``kpipe gym serve``
there, under a lock file, and every later job submits to it; :func:`open_run_service` is
what ``kpipe.agent.evaluator.open_evaluator`` calls.

Started lazily rather than in Snakemake's ``onstart``: a run with nothing to evaluate (a
rerun of the tables, ``--until`` a rule before distillation) starts no pool, and the settings
are exactly the job's own (a job knows its protocol, e.g. RL's eager-only baseline; the
Snakefile would have to re-derive it). The service is keyed by those settings (protocol,
``reuse_reference``, cache, workers, confinement): a job never gets results of other
settings, and stages whose settings differ get one service each.

The service ends with the run: the workflow's ``onsuccess``/``onerror`` call
:func:`stop_services`; on Ctrl-C, a killed ``snakemake`` or anything else, the service sees its
owner end (``kpipe gym serve --owner``: a pidfd) and exits by itself. A record left by a
dead run is never used: a job checks its owner, host, the process (pid and start time) and a
health request that must report the job's protocol.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kpipe.gym.serve.client import GymClient, GymServiceError
from kpipe.gym.protocol import Protocol
from kpipe.infra.jobs import since_job_started
from kpipe.infra.process import process_start

log = logging.getLogger(__name__)

RUN_ENV = "KPIPE_GYM_RUN"
START_TIMEOUT_S = 900.0  # pool start: every worker imports torch and triton (and on a GPU makes a CUDA context)
STOP_GRACE_S = 30.0  # a service asked to stop (or whose owner ended) gets this long to close its pool


class RunServiceError(RuntimeError):
    """The run's service could not be started (its log says why)."""


@dataclass(frozen=True)
class WorkflowRun:
    """What the workflow tells its jobs about the run's service (``$KPIPE_GYM_RUN``)."""

    directory: Path  # results/.gym, absolute
    owner: int  # the snakemake process
    gpus: tuple[str, ...]  # the machine's GPUs for this run (a job's lease narrows its own CUDA_VISIBLE_DEVICES)
    host: str

    def to_env(self) -> str:
        return json.dumps({"directory": str(self.directory), "owner": self.owner, "gpus": list(self.gpus),
                           "host": self.host})


def announce(directory: str | os.PathLike, gpus: list[str]) -> WorkflowRun:
    """Called by the Snakefile in the snakemake process: its jobs (child processes) use one
    service owned by this process."""
    run = WorkflowRun(Path(directory).resolve(), os.getpid(), tuple(gpus), socket.gethostname())
    os.environ[RUN_ENV] = run.to_env()
    return run


def withdraw() -> None:
    """No run service for this process's jobs (`gym.service: off`, a cluster executor)."""
    os.environ.pop(RUN_ENV, None)


def workflow_run(environ: Mapping[str, str] = os.environ) -> WorkflowRun | None:
    """The run this process is a job of, or None (a library call, a job of a run without a service)."""
    text = environ.get(RUN_ENV)
    if not text:
        return None
    data = json.loads(text)
    return WorkflowRun(Path(data["directory"]), int(data["owner"]), tuple(data["gpus"]), data["host"])


def service_settings(protocol: Protocol, reuse_reference: bool, cache: str | os.PathLike | None,
                     workers: int | None, unconfined: bool, per_gpu: int | None = None) -> dict[str, Any]:
    """Everything a service's results depend on besides the machine: a job uses a service only
    if these equal its own (the service writes its own into its record)."""
    return {"protocol": json.loads(protocol.to_json()), "reuse_reference": bool(reuse_reference),
            "cache": str(Path(cache).resolve()) if cache else None, "workers": workers, "per_gpu": per_gpu,
            "unconfined": bool(unconfined)}


def settings_digest(settings: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """Atomically, readable by its owner only (it holds the token)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, sort_keys=True)
    os.replace(temporary, path)


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def serving_record(url: str, owner: int | None, token: str | None, settings: Mapping[str, Any]) -> dict[str, Any]:
    """What ``kpipe gym serve --record`` writes once it answers."""
    return {"url": url, "pid": os.getpid(), "started": process_start(os.getpid()), "owner": owner,
            "host": socket.gethostname(), "token": token, "settings": dict(settings)}


def why_unusable(record: Mapping[str, Any] | None, settings: Mapping[str, Any], run: WorkflowRun) -> str | None:
    """None when `record` names a live service of this run with exactly `settings`; else why not."""
    if record is None:
        return "no record"
    if record.get("owner") != run.owner or record.get("host") != run.host:
        return f"left by another run (owner {record.get('owner')} on {record.get('host')})"
    if record.get("settings") != dict(settings):
        return "recorded with other settings"
    if process_start(int(record.get("pid") or 0)) != record.get("started"):
        return f"its process {record.get('pid')} is gone"
    try:
        with GymClient(record["url"], token=record.get("token") or "", retries=0, timeout_s=10.0, progress=False) as probe:
            health = probe.health()
    except (GymServiceError, ValueError) as error:
        return f"no health answer ({error})"
    if health.get("protocol") != settings["protocol"] or health.get("reuse_reference") != settings["reuse_reference"]:
        return "it reports other settings"
    return None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` across processes (the jobs of a run)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def service_paths(run: WorkflowRun, settings: Mapping[str, Any]) -> tuple[Path, Path]:
    """The record and the log of the service with `settings`."""
    stem = f"service-{settings_digest(settings)}"
    return run.directory / f"{stem}.json", run.directory / f"{stem}.log"


def ensure_service(run: WorkflowRun, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The record of the run's service with `settings`, started here if there is none yet."""
    run.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    record_path, log_path = service_paths(run, settings)
    with locked(run.directory / "service.lock"):
        record = read_record(record_path)
        why = why_unusable(record, settings, run)
        if why is None:
            return record  # type: ignore[return-value]
        if record is not None:
            log.warning("KernelGym service record %s not used: %s", record_path, why)
            record_path.unlink(missing_ok=True)
        record = start_service(run, settings, record_path, log_path)
        if (why := why_unusable(record, settings, run)) is not None:
            raise RunServiceError(f"the KernelGym service started for this run is not usable: {why} ({log_path})")
        return record


def serve_command(run: WorkflowRun, settings: Mapping[str, Any], record_path: Path) -> list[str]:
    """``kpipe gym serve`` with `settings`, owned by the run's snakemake process."""
    protocol_path = run.directory / f"protocol-{settings_digest(settings)}.json"
    protocol_path.write_text(json.dumps(settings["protocol"]))
    command = [sys.executable, "-m", "kpipe.cli", "gym", *(["--unconfined"] if settings["unconfined"] else []),
               "serve", "--port", "0", "--record", str(record_path), "--owner", str(run.owner),
               "--protocol", str(protocol_path)]
    command += ["--cache", settings["cache"]] if settings["cache"] else ["--no-cache"]
    command += ["--workers", str(settings["workers"])] if settings["workers"] else []
    command += ["--per-gpu", str(settings["per_gpu"])] if settings.get("per_gpu") else []
    return command + (["--reuse-reference"] if settings["reuse_reference"] else [])


def start_service(run: WorkflowRun, settings: Mapping[str, Any], record_path: Path, log_path: Path) -> dict[str, Any]:
    """Start the service (its own session: neither a job's end nor its process group's signals
    reach it) on every GPU of the run, and wait until its record says it answers."""
    token = secrets.token_urlsafe(24)
    env = {**os.environ, "KPIPE_GYM_TOKEN": token, "CUDA_VISIBLE_DEVICES": ",".join(run.gpus)}
    with open(log_path, "a") as log_file:
        process = subprocess.Popen(serve_command(run, settings, record_path), env=env, stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    log.info("KernelGym service of this run starting (pid %d, log %s)", process.pid, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (record := read_record(record_path)) is None or record.get("pid") != process.pid:
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RunServiceError(f"the run's KernelGym service did not start (exit {process.poll()}); {log_path}:\n{tail}")
        time.sleep(0.1)
    return record


def open_run_service(run: WorkflowRun, settings: Mapping[str, Any], progress: bool = True,
                     priority: int = 0) -> GymClient:
    """A client of the run's service with exactly `settings` (started if needed), whose jobs are
    queued at `priority` (not a setting: jobs of every priority share the one service)."""
    record = ensure_service(run, settings)
    log.info("evaluating on the run's KernelGym service %s (pid %s)%s", record["url"], record["pid"], since_job_started())
    return GymClient(record["url"], token=record.get("token") or "", poll_s=0.1, progress=progress, priority=priority)


def stop_services(directory: str | os.PathLike, owner: int | None = None) -> list[int]:
    """Stop every service this process's run started (``onsuccess``/``onerror``): SIGTERM, and
    SIGKILL after STOP_GRACE_S. Returns their pids."""
    owner = os.getpid() if owner is None else owner
    stopped = []
    for record_path in sorted(Path(directory).glob("service-*.json")):
        record = read_record(record_path)
        if record is None or record.get("owner") != owner or record.get("host") != socket.gethostname():
            continue
        pid = int(record["pid"])
        if process_start(pid) == record.get("started"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while process_start(pid) == record["started"] and time.monotonic() < deadline:
                time.sleep(0.1)
            if process_start(pid) == record["started"]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        record_path.unlink(missing_ok=True)
        stopped.append(pid)
    return stopped


def exit_with_owner(owner: int, stop: Any) -> None:
    """Call `stop` when process `owner` ends (a pidfd: no polling, no pid reuse), and end this
    process if it is still here STOP_GRACE_S later. Run on a daemon thread of the service."""
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        pidfd = None
    if pidfd is not None:
        select.select([pidfd], [], [])
        os.close(pidfd)
    stop()
    deadline = threading.Timer(STOP_GRACE_S, os._exit, args=(1,))
    deadline.daemon = True
    deadline.start()
