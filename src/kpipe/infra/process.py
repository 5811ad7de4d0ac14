"""Process hygiene shared by everything that starts a helper process (evaluation children,
``vllm serve``): a helper must not outlive the process that supervises it.

A helper started with ``subprocess.Popen`` gets its death signal from a tiny exec wrapper
(``tied_to_this_process``) rather than a ``preexec_fn``: the latter runs Python between fork and
exec, which can deadlock when the parent has other threads (tokenizers, tqdm, capture threads).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import time
from collections.abc import Collection
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> bool:
    """Linux's prctl(option, value); False where there is none (the caller's own clean-up is
    then the only guard)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `signum` to this process when `parent` (the process that started
    it and enforces its timeout) dies, also by SIGKILL: an orphan would otherwise keep its GPU
    memory. The request survives exec."""
    if prctl(PR_SET_PDEATHSIG, int(signum)) and os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def become_subreaper() -> None:
    """Inherit every orphaned descendant of this process's children, so a child that
    daemonises (double fork, setsid) stays ours to end: ``kill_children`` ends it."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by `pid` (a child started in its own session), if any is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_children(keep: Collection[int] = ()) -> None:
    """Kill every child of this process but those in `keep`, and reap the ones that are gone
    (without waiting: a child killed now is reaped by a later call, and the status of a child
    in `keep` is left to whoever waits for it)."""
    me = str(os.getpid())
    killed = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                parent = stat.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if parent == me:
            killed.append(int(entry.name))
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid in killed:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def process_start(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), None when it is gone or a zombie: with
    the pid it names one process, never a later one that reuses the pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def process_age(pid: int) -> float | None:
    """Seconds since `pid` started (None when it is gone): the clock of boot time against its start."""
    ticks = process_start(pid)
    return None if ticks is None else time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def tied_to_this_process(command: list[str], signum: int = signal.SIGKILL) -> list[str]:
    """`command` run through ``python -m kpipe.infra.process``, which sets `signum` as its death
    signal for when this process dies and then execs it (same pid, same process group)."""
    return [sys.executable, "-m", "kpipe.infra.process", str(os.getpid()), signal.Signals(signum).name, *command]


def main(argv: list[str]) -> None:
    """``python -m kpipe.infra.process PARENT SIGNAL COMMAND...``"""
    parent, signum, command = int(argv[0]), signal.Signals[argv[1]], argv[2:]
    die_with_parent(parent, signum)
    os.execvp(command[0], command)


def exit_without_teardown(code: int = 0) -> NoReturn:
    """End this process once its exit handlers have run (``atexit``: a worker's removal of its
    trusted compile cache among them), skipping the interpreter's teardown of its modules: with
    torch and triton loaded that took a KernelGym worker and its zygote about a second each, and a
    job waits for both when it closes its pool (2.9 s of a one-worker pool's close on a CPU)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
