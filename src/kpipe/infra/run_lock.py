"""Snakemake's lock after a killed run: the same command clears it when the run that took it is gone.

Snakemake 9.27 (file persistence) locks a working directory with `.snakemake/locks/<n>.input.lock`
and `<n>.output.lock`, lists of file names with no owner; it takes them after the Snakefile is
parsed and the DAG built, and removes the folder when the run ends, unless the run was killed
(SIGKILL: the OOM killer, a SLURM time limit, a preemption, a reboot). Then every later run stops
with `LockException` until `snakemake --unlock`.

So each parse of the Snakefile by a main Snakemake process records its owner here
(`.snakemake/kpipe-owners/<host>.<pid>.json`, removed when the process exits normally), and before
Snakemake looks at the lock, `clear_stale_lock` removes it when it is provably stale: no record of
a living process, no record of another host, and no process in this directory whose command line
names Snakemake (a killed run's orphaned jobs). Otherwise it leaves the lock and, where Snakemake
would refuse, says in one line why and which command clears it.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

LOCK_DIR = Path(".snakemake") / "locks"
OWNER_DIR = Path(".snakemake") / "kpipe-owners"
UNLOCK_COMMAND = "snakemake --unlock"


@dataclass(frozen=True)
class Owner:
    """A main Snakemake process that parsed the Snakefile in this directory."""

    host: str
    pid: int
    boot_id: str  # the host's boot (a reboot ends every process; pids are reused)
    started: str  # the process's start time in clock ticks since boot ("" where /proc is absent)
    slurm_job: str  # SLURM_JOB_ID, "" outside SLURM: a requeued job's earlier run has ended
    slurm_restart: int  # SLURM_RESTART_COUNT

    @property
    def file_name(self) -> str:
        return f"{self.host}.{self.pid}.json"


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _boot_id() -> str:
    return _read_text("/proc/sys/kernel/random/boot_id").strip()


def _process_start(pid: int) -> str:
    """Field 22 of /proc/<pid>/stat (after the command name, which may hold spaces); "" if absent."""
    stat = _read_text(f"/proc/{pid}/stat")
    return stat.rpartition(")")[2].split()[19] if stat else ""


def this_process() -> Owner:
    return Owner(host=socket.gethostname(), pid=os.getpid(), boot_id=_boot_id(), started=_process_start(os.getpid()),
                 slurm_job=os.environ.get("SLURM_JOB_ID", ""),
                 slurm_restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))


def is_dead(owner: Owner, me: Owner) -> bool | None:
    """True when `owner` has certainly ended, False when it runs, None when this host cannot tell."""
    if owner.slurm_job and owner.slurm_job == me.slurm_job and owner.slurm_restart < me.slurm_restart:
        return True  # an earlier run of this (requeued) SLURM job, on whichever node
    if owner.host != me.host:
        return None
    if owner.boot_id and me.boot_id and owner.boot_id != me.boot_id:
        return True
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return bool(owner.started) and _process_start(owner.pid) != owner.started  # the pid was reused


def _ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        stat = _read_text(f"/proc/{pid}/stat")
        if not stat:
            break
        pid = int(stat.rpartition(")")[2].split()[1])
    return found


def snakemake_processes_here(workdir: Path) -> list[int]:
    """Other processes of this host whose working directory is `workdir` and whose command line
    names Snakemake (a run, or a job of one: its script lies under .snakemake/scripts); this
    process and its ancestors (a shell that started it) excepted. Empty without /proc."""
    mine = _ancestors(os.getpid())
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid in mine:
            continue
        try:
            if Path(os.readlink(entry / "cwd")) == workdir and b"snakemake" in (entry / "cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue  # ended meanwhile, or another user's
    return sorted(found)


def lock_files(workdir: Path) -> list[Path]:
    """Snakemake's lock files in `workdir` (the names its file persistence writes)."""
    lock_dir = workdir / LOCK_DIR
    return sorted(path for pattern in ("[0-9]*.input.lock", "[0-9]*.output.lock") for path in lock_dir.glob(pattern))


def _read_owner(path: Path) -> Owner | None:
    try:
        return Owner(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def clear_stale_lock(workdir: Path | None = None) -> str:
    """Remove Snakemake's lock in `workdir` (default: here) when it is stale; record this process
    as an owner (removed at its normal exit). Returns the line it printed ("" when none)."""
    workdir = (workdir or Path.cwd()).resolve()
    me = this_process()
    owners_dir = workdir / OWNER_DIR
    alive, unknown, dead = [], [], []
    for path in sorted(owners_dir.glob("*.json")) if owners_dir.is_dir() else []:
        if path.name == me.file_name:
            continue
        owner = _read_owner(path)
        state = True if owner is None else is_dead(owner, me)
        (dead if state else alive if state is False else unknown).append((path, owner))
    message = ""
    locks = lock_files(workdir)
    if locks and not alive:
        running = snakemake_processes_here(workdir)
        if unknown:
            hosts = ", ".join(sorted({f"{owner.host} (pid {owner.pid})" for _, owner in unknown}))
            message = (f"kpipe: Snakemake's lock in {LOCK_DIR} may belong to a run on {hosts}; if none runs "
                       f"there, run `{UNLOCK_COMMAND}`, then the same command again")
        elif running:
            message = (f"kpipe: Snakemake's lock in {LOCK_DIR} is held: processes {', '.join(map(str, running))} "
                       "(a run or its jobs) still run in this directory; wait for them to end or stop them, "
                       "then run the same command again")
        elif not dead:
            message = (f"kpipe: Snakemake's lock in {LOCK_DIR} was left by a run kpipe did not record; if no "
                       f"Snakemake runs in this directory, run `{UNLOCK_COMMAND}`, then the same command again")
        else:
            for lock in locks:
                lock.unlink(missing_ok=True)
            pids = ", ".join(str(owner.pid) for _, owner in dead if owner)
            message = (f"kpipe: removed Snakemake's stale lock in {LOCK_DIR}: the run that took it "
                       f"(pid {pids or '?'}) no longer runs")
    if not lock_files(workdir):  # a dead owner's record matters only while its lock is there
        for path, _ in dead:
            path.unlink(missing_ok=True)
    if message:
        print(message, file=sys.stderr)
    _record(owners_dir, me)
    return message


def _record(owners_dir: Path, me: Owner) -> None:
    owners_dir.mkdir(parents=True, exist_ok=True)
    path = owners_dir / me.file_name
    path.write_text(json.dumps(me.__dict__))
    atexit.register(path.unlink, missing_ok=True)
