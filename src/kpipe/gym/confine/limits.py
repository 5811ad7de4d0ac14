"""Resource limits of a candidate's processes (issue 52, class 5): host memory, file size, tasks
(processes and threads) and no core dumps, set before any of its code runs and inherited by
whatever it starts. The judge decides which limit was hit from what the candidate cannot write.

How each is enforced, and why:

- **disk**: the judge's quota on what the candidate's scratch directory holds (allocated blocks, each
  entry at least a block; ``kpipe.gym.confine.scratch_tree.disk_usage``), checked by its watchdog every
  ``DISK_WATCH_INTERVAL_S`` (the tree is killed past it) and once more after the child has exited, so
  nothing it left counts less: ``RLIMIT_FSIZE`` bounds one file's size, not how many files there are,
  nor blocks ``fallocate`` reserves without growing a file (``FALLOC_FL_KEEP_SIZE``). A soft bound
  while it runs (a fast writer overshoots by what it writes in one interval), exact at the end; the
  scratch is removed after either (``kpipe.gym.confine.scratch_tree.remove_tree``), however deep it nests.
- **file size**: ``RLIMIT_FSIZE``, set in the child (``apply_rlimits``); a write past it kills the
  writer with SIGXFSZ (the judge sees the exit signal) or, where the candidate ignores that signal,
  fails with EFBIG and leaves a file at the cap in its scratch (the judge looks: ``ChildLimits.hit``).
- **memory and tasks**: a cgroup per candidate child where the judge can make one
  (``cgroup_support``: a cgroup v2 directory delegated to it, ``KPIPE_GYM_CGROUP``, else writable
  cgroup v1 memory and pids hierarchies). The child joins it before
  its sandbox (``join_cgroups``); the kernel then kills past ``memory.max`` (its OOM killer) and
  refuses a fork past ``pids.max``, and counts both in files only the judge can write
  (``memory.events``/``memory.oom_control``, ``pids.events``; Landlock denies the candidate any
  write under ``/sys``). Where none can be made, the judge's **watchdog** (``Watchdog``) reads the
  child's process tree from ``/proc`` every ``WATCH_INTERVAL_S`` and kills the tree past either
  cap: a soft bound (a fast allocation overshoots by what it allocates in one interval; a page
  two of its processes share counts twice).
- Not ``RLIMIT_AS``: the CUDA driver reserves far more address space than it uses. Not
  ``RLIMIT_NPROC``: it counts every process of a user, and the kernel exempts root's (the sandbox
  maps the candidate to its caller's uid: root on our machines), so it bounded nothing there.

Only the standard library is imported here: a forked or fresh child joins its cgroups before it
enters its sandbox, before torch starts threads (``kpipe.gym.confine.sandbox``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kpipe.gym.confine.scratch_tree import MAX_WALK_DEPTH, ENTRY_BYTES, disk_usage

# set to 1 to enforce memory and tasks by the watchdog even where a cgroup could be made
NO_CGROUP_VARIABLE = "KPIPE_GYM_NO_CGROUP"
# a cgroup v2 directory delegated to KernelGym (memory and pids in its cgroup.subtree_control, writable by the
# judge): where the judge makes its children's cgroups. Its own cgroup cannot be one while it has processes
# in it (cgroup v2 has no internal processes), so only an administrator can make one for it
DELEGATED_CGROUP_VARIABLE = "KPIPE_GYM_CGROUP"
WATCH_INTERVAL_S = 0.05
DISK_WATCH_INTERVAL_S = 0.5  # a walk of the scratch directory: an honest one holds tens of entries
MiB = 1 << 20
CGROUP_REMOVE_WAIT_S = 2.0
_names = itertools.count()


@dataclass(frozen=True)
class Limits:
    """A candidate's caps (``kpipe.gym.protocol.Protocol``'s ``memory_limit_mb``,
    ``file_size_limit_mb``, ``task_limit``, ``disk_limit_mb``); None: unlimited."""

    memory_mb: int | None
    file_size_mb: int | None
    tasks: int | None
    disk_mb: int | None = None

    def any(self) -> bool:
        return any(value is not None for value in (self.memory_mb, self.file_size_mb, self.tasks, self.disk_mb))


def apply_rlimits(limits: dict[str, Any] | None) -> None:
    """In the child, before any candidate code: no core dumps, and the job's file-size cap."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits and limits.get("file_size_mb"):
        size = int(limits["file_size_mb"]) * MiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def join_cgroups(limits: dict[str, Any] | None) -> None:
    """Move this process into the job's cgroups (before it enters its sandbox: outside the user
    namespace, it may). Everything it starts from here on is counted in them."""
    for directory in (limits or {}).get("cgroups", []):
        Path(directory, "cgroup.procs").write_text("0")


# ----------------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class CgroupSupport:
    """Where the judge makes its children's cgroups: one directory per controller (the same one
    under cgroup v2)."""

    version: int  # 1 or 2
    memory: str | None
    pids: str | None


def mount_points() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, file system type, super options) of each mount (/proc/self/mountinfo)."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if "-" not in fields:
                continue
            dash = fields.index("-")
            found.append((fields[3], fields[4], fields[dash + 1], set(fields[dash + 3].split(",")) if len(fields) > dash + 3 else set()))
    return found


def own_cgroups() -> dict[str, str]:
    """This process's cgroup path by controller ("" for cgroup v2's unified hierarchy)."""
    paths = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def cgroup_directory(mount_root: str, mount_point: str, path: str) -> str | None:
    """Where cgroup `path` lies under a mount of its hierarchy rooted at `mount_root`."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    relative = path[len(mount_root):] if mount_root != "/" else path
    directory = os.path.join(mount_point, relative.lstrip("/"))
    return directory if os.path.isdir(directory) else None


def can_make_children(directory: str, files: tuple[str, ...]) -> bool:
    """Whether a child cgroup can be made in `directory` and has `files` (its controllers' limits)."""
    probe = os.path.join(directory, f"kpipe-probe-{os.getpid()}-{next(_names)}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        return all(os.path.exists(os.path.join(probe, name)) for name in files)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def delegates(directory: str) -> bool:
    """Whether cgroup v2 `directory` gives its children memory and pids limits this process can make."""
    try:
        delegated = set(Path(directory, "cgroup.subtree_control").read_text().split())
    except OSError:
        return False
    return {"memory", "pids"} <= delegated and can_make_children(directory, ("memory.max", "pids.max"))


def detect_cgroups() -> CgroupSupport | None:
    """The cgroup v2 directory named by ``KPIPE_GYM_CGROUP`` (ValueError when it cannot serve), else
    this process's cgroup v2 where it delegates memory and pids to its children (only the root can,
    having processes), else the cgroup v1 memory and pids hierarchies it can write; None where none."""
    named = os.environ.get(DELEGATED_CGROUP_VARIABLE, "")
    if named:
        if not delegates(named):
            raise ValueError(f"{DELEGATED_CGROUP_VARIABLE}={named} is no cgroup v2 directory with memory and pids in its "
                             f"cgroup.subtree_control in which this process can make cgroups (docs/kernelgym.md, 'Limits')")
        return CgroupSupport(2, named, named)
    mounts, own = mount_points(), own_cgroups()
    for root, point, kind, _ in mounts:
        if kind == "cgroup2" and "" in own:
            directory = cgroup_directory(root, point, own[""])
            if directory is not None and delegates(directory):
                return CgroupSupport(2, directory, directory)
    found: dict[str, str] = {}
    for controller, limit_file in (("memory", "memory.limit_in_bytes"), ("pids", "pids.max")):
        for root, point, kind, options in mounts:
            if kind == "cgroup" and controller in options and controller in own:
                directory = cgroup_directory(root, point, own[controller])
                if directory is not None and can_make_children(directory, (limit_file,)):
                    found[controller] = directory
                    break
    return CgroupSupport(1, found.get("memory"), found.get("pids")) if found else None


_support: list[CgroupSupport | None] = []


def cgroup_support() -> CgroupSupport | None:
    """``detect_cgroups``, asked once per process; None under ``KPIPE_GYM_NO_CGROUP=1``."""
    if os.environ.get(NO_CGROUP_VARIABLE, "") not in ("", "0"):
        return None
    if not _support:
        _support.append(detect_cgroups())
        if _support[0] is not None:
            remove_orphaned_cgroups(_support[0])
    return _support[0]


CHILD_CGROUP_PREFIX = "kpipe-candidate-"


def remove_orphaned_cgroups(support: CgroupSupport) -> None:
    """Remove the empty cgroups a judge that is gone left behind (killed before it could: a pool
    worker's end by SIGKILL); a judge's cgroups are named after its pid."""
    for parent in {support.memory, support.pids} - {None}:
        with contextlib.suppress(OSError):
            for entry in os.scandir(parent):
                owner = entry.name[len(CHILD_CGROUP_PREFIX):].split("-", 1)[0]
                if entry.name.startswith(CHILD_CGROUP_PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                    with contextlib.suppress(OSError):  # still busy, or another judge's
                        os.rmdir(entry.path)


def counter(path: str, name: str) -> int:
    """The value of line `name` of a flat-keyed cgroup file (``memory.events``, ``pids.events``)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return 0


def counter_file(path: str) -> int | None:
    """The number a single-valued cgroup file holds (``memory.peak``, ``pids.peak``); None without one."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# ----------------------------------------------------------------------------- the judge's side


class ChildLimits:
    """One candidate child's limits as the judge holds them: its cgroups (made here, with the caps
    written in), or its watchdog where there are none; ``hit`` says afterwards which limit the child
    ran into, from the kernel's counters, its exit signal, its scratch and the watchdog's own record."""

    def __init__(self, limits: Limits, support: CgroupSupport | None, scratch: Path | None = None) -> None:
        self.limits = limits
        self.cgroups: dict[str, str] = {}  # controller -> the child's cgroup directory
        self.version = support.version if support is not None else 0
        self.watchdog: Watchdog | None = None
        # the child's scratch directory, opened before any candidate code runs: the disk quota's
        # walks start from this descriptor, never from a path the candidate could replace
        self.disk: DiskQuota | None = None
        try:
            if scratch is not None and limits.disk_mb is not None:
                self.disk = DiskQuota(os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC), limits.disk_mb)
            if support is not None:
                self._make(support)
        except BaseException:
            self.remove()
            raise

    def _make(self, support: CgroupSupport) -> None:
        name = f"{CHILD_CGROUP_PREFIX}{os.getpid()}-{next(_names)}"
        wanted = {"memory": self.limits.memory_mb, "pids": self.limits.tasks}
        for controller, parent in (("memory", support.memory), ("pids", support.pids)):
            if parent is None or wanted[controller] is None:
                continue
            directory = os.path.join(parent, name)
            if directory not in self.cgroups.values():
                os.mkdir(directory)
            self.cgroups[controller] = directory
        memory, tasks = self.cgroups.get("memory"), self.cgroups.get("pids")
        if memory is not None and self.limits.memory_mb is not None:
            size = str(self.limits.memory_mb * MiB)
            if self.version == 2:
                Path(memory, "memory.max").write_text(size)
                # no swap to hide in; an OOM kill ends the whole tree (absent without swap accounting)
                for setting, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    with contextlib.suppress(OSError):
                        Path(memory, setting).write_text(value)
            else:
                Path(memory, "memory.limit_in_bytes").write_text(size)
                with contextlib.suppress(OSError):  # memsw exists only with swap accounting
                    Path(memory, "memory.memsw.limit_in_bytes").write_text(size)
        if tasks is not None and self.limits.tasks is not None:
            Path(tasks, "pids.max").write_text(str(self.limits.tasks))

    def job_keys(self) -> dict[str, Any]:
        """What the child needs: its caps and the cgroups it joins (``join_cgroups``)."""
        return {"limits": {"memory_mb": self.limits.memory_mb, "file_size_mb": self.limits.file_size_mb,
                           "tasks": self.limits.tasks, "cgroups": sorted(set(self.cgroups.values()))}}

    def enforced_by(self, resource_name: str) -> str:
        """How memory ("memory") or tasks ("pids") are bounded for this child."""
        return f"cgroup v{self.version}" if resource_name in self.cgroups else "the judge's watchdog"

    def watch(self, pid: int, kill: Callable[[], None]) -> None:
        """Start the watchdog on the process tree of `pid` for the caps no cgroup enforces."""
        memory = self.limits.memory_mb if "memory" not in self.cgroups else None
        tasks = self.limits.tasks if "pids" not in self.cgroups else None
        if (memory is not None or tasks is not None or self.disk is not None) and self.watchdog is None:
            self.watchdog = Watchdog(pid, memory, tasks, kill, self.disk)
            self.watchdog.start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def peaks(self) -> dict[str, float]:
        """The most memory (MiB) and tasks the child's tree held, as its cgroups or the watchdog saw
        them (instrumentation: what the caps must leave room for)."""
        found: dict[str, float] = {}
        memory, tasks = self.cgroups.get("memory"), self.cgroups.get("pids")
        if memory is not None:
            peak = counter_file(os.path.join(memory, "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))
            if peak is not None:
                found["memory_mb"] = peak / MiB
        if tasks is not None and (peak := counter_file(os.path.join(tasks, "pids.peak"))) is not None:
            found["tasks"] = peak
        if self.watchdog is not None:
            if self.watchdog.memory_mb is not None:
                found["memory_mb"] = self.watchdog.peak_memory / MiB
            if self.watchdog.tasks is not None:
                found["tasks"] = self.watchdog.peak_tasks
        return found

    def hit(self, returncode: int | None, oversized_file: Callable[[int], str | None]) -> str:
        """Which limit the child ran into ("" for none), from what it cannot forge: the kernel's
        counters in its cgroups, the watchdog's record, its exit signal, and `oversized_file(bytes)`
        (a regular file of its scratch at least that large: the judge's walk of it)."""
        reasons = []
        memory, tasks = self.cgroups.get("memory"), self.cgroups.get("pids")
        if memory is not None:
            killed = (counter(os.path.join(memory, "memory.events"), "oom_kill") if self.version == 2
                      else counter(os.path.join(memory, "memory.oom_control"), "oom_kill"))
            if killed:
                reasons.append(f"memory: its processes passed the host memory cap of {self.limits.memory_mb} MiB "
                               f"(killed by the kernel, {self.enforced_by('memory')})")
        if tasks is not None and counter(os.path.join(tasks, "pids.events"), "max"):
            reasons.append(f"processes: it tried to run more than {self.limits.tasks} processes and threads "
                           f"(a fork refused, {self.enforced_by('pids')})")
        if self.watchdog is not None and self.watchdog.record:
            reasons.append(self.watchdog.record)
        elif self.disk is not None and (past := self.disk.exceeded()):  # what the child left, walked once it is gone
            reasons.append(past)
        if self.limits.file_size_mb is not None:
            cap = self.limits.file_size_mb * MiB
            at_cap = oversized_file(cap)
            if returncode == -signal.SIGXFSZ or at_cap is not None:
                where = f": {at_cap} reached it" if at_cap is not None else " (killed by SIGXFSZ)"
                reasons.append(f"file size: it wrote past the file size cap of {self.limits.file_size_mb} MiB{where}")
        return "; ".join(reasons)

    def remove(self) -> None:
        """Stop the watchdog and remove the cgroups, once whatever is left in them is killed."""
        self.stop()
        if self.disk is not None:
            self.disk.close()
        for directory in sorted(set(self.cgroups.values())):
            remove_cgroup(directory, self.version)
        self.cgroups.clear()


def remove_cgroup(directory: str, version: int) -> None:
    """Kill what is left in `directory` (a sandbox's init dies with its candidate, but the kernel
    ends the namespace's processes asynchronously) and remove it; left in place if it stays busy."""
    deadline = time.monotonic() + CGROUP_REMOVE_WAIT_S
    while True:
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
        if version == 2:
            with contextlib.suppress(OSError):
                Path(directory, "cgroup.kill").write_text("1")
        else:
            with contextlib.suppress(OSError):
                for pid in Path(directory, "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.01)


# ----------------------------------------------------------------------------- the watchdog


def process_tree(root: int, stop_after: int | None = None) -> list[int]:
    """`root` and its descendants, found through each task's ``children`` file (stops early once
    more than `stop_after` tasks were counted)."""
    found, queue = [], [root]
    tasks = 0
    while queue:
        pid = queue.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        found.append(pid)
        tasks += len(threads)
        if stop_after is not None and tasks > stop_after:
            break
        for tid in threads:
            with contextlib.suppress(OSError):
                queue.extend(int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return found


def tree_usage(root: int, stop_after: int | None = None) -> tuple[int, int]:
    """(tasks, resident anonymous and shared memory in bytes) of the process tree of `root`."""
    tasks, memory = 0, 0
    for pid in process_tree(root, stop_after):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key == "Threads":
                    tasks += int(value)
                elif key in ("RssAnon", "RssShmem"):
                    memory += int(value.split()[0]) * 1024
    return tasks, memory


class DiskQuota:
    """The disk quota of one candidate's scratch directory (open as `scratch_fd`, which this owns)."""

    def __init__(self, scratch_fd: int, quota_mb: int) -> None:
        self.scratch_fd, self.quota_mb = scratch_fd, quota_mb

    def exceeded(self) -> str:
        """Why the scratch directory is past the quota now ("" when it is not): more bytes or
        entries than it allows, or directories nested past what the judge walks."""
        quota = self.quota_mb * MiB
        usage = disk_usage(self.scratch_fd, max_entries=quota // ENTRY_BYTES + 1)
        if usage.bytes > quota:
            return (f"disk: its scratch directory held {usage.bytes // MiB} MiB in {usage.entries} entries, past the disk "
                    f"quota of {self.quota_mb} MiB")
        if usage.too_deep:
            return f"disk: its scratch directory nests directories more than {MAX_WALK_DEPTH} deep"
        return ""

    def close(self) -> None:
        if self.scratch_fd >= 0:
            os.close(self.scratch_fd)
            self.scratch_fd = -1


class Watchdog(threading.Thread):
    """The judge's bound on a child's tree where no cgroup is, and on its scratch directory's disk
    usage (`disk`): past a cap it kills the tree and records why (``record``), which the child's
    process cannot reach."""

    def __init__(self, root: int, memory_mb: int | None, tasks: int | None, kill: Callable[[], None],
                 disk: DiskQuota | None = None) -> None:
        super().__init__(daemon=True, name=f"kgym-limits-{root}")
        self.root, self.memory_mb, self.tasks, self.kill, self.disk = root, memory_mb, tasks, kill, disk
        self.record = ""
        self.peak_tasks, self.peak_memory = 0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        disk_due = time.monotonic()
        tree = self.memory_mb is not None or self.tasks is not None
        # with only the disk to watch (a cgroup bounds the rest), the judge wakes only for its walks
        while not self._stop_event.wait(WATCH_INTERVAL_S if tree else DISK_WATCH_INTERVAL_S):
            if tree:
                tasks, memory = tree_usage(self.root, self.tasks)
                self.peak_tasks, self.peak_memory = max(self.peak_tasks, tasks), max(self.peak_memory, memory)
                if self.tasks is not None and tasks > self.tasks:
                    self.record = f"processes: it ran more than {self.tasks} processes and threads (killed by the judge's watchdog)"
                elif self.memory_mb is not None and memory > self.memory_mb * MiB:
                    self.record = (f"memory: its processes passed the host memory cap of {self.memory_mb} MiB "
                                   f"({memory // MiB} MiB resident; killed by the judge's watchdog)")
            if not self.record and self.disk is not None and time.monotonic() >= disk_due:
                disk_due = time.monotonic() + DISK_WATCH_INTERVAL_S
                if past := self.disk.exceeded():
                    self.record = f"{past} (killed by the judge's watchdog)"
            if self.record:
                self.kill()
                return

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join()
