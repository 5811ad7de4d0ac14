"""Confinement of a candidate process: what a program written by a model rewarded for passing
KernelGym may see and touch.

A candidate is hostile code. A static screen is defeated by string tricks
(``getattr(__import__("built" + "ins"), "op" + "en")``) and a scrubbed environment by reading
an ancestor's ``/proc/<pid>/environ``, so the operating system confines it
(``enter_sandbox``, in a single-threaded process, before any candidate code runs):

- **user namespace**: the candidate's uid maps to the caller's, and every capability is then
  dropped (bounding set included, ``SECBIT_NOROOT`` locked, ``no_new_privs``): a candidate
  started by root has none of root's power, and cannot regain it through ``execve``;
- **PID namespace** with its own ``/proc``: the candidate is pid 1 of a namespace holding only
  itself and its own children, so it sees no other process's ``/proc`` entry, environment or
  memory, and cannot name one to signal (``getppid()`` is 0);
- **network namespace** (no interface but a downed loopback: no TCP service of the host, and no
  abstract UNIX socket, which lives in a network namespace) and **IPC namespace**;
- **mount namespace**: neither namespace nor Landlock governs ``connect()`` to a socket file, so
  an empty tmpfs covers the directories that hold pathname Unix sockets (``SOCKET_DIRS``), the
  scratch directory and whatever else the sandbox reads there (an interpreter under ``/tmp``)
  bind-mounted back, and every other pathname socket bound on the host when the candidate starts
  (``/proc/net/unix``: a socket in a checkout, a Docker socket under ``/var/lib``) is covered by
  ``/dev/null``;
- **Landlock** (the kernel's unprivileged access-control LSM, ABI >= 1): reads and execution
  only under the interpreter, its site-packages, the system's libraries and toolchains and the
  GPU's device nodes; writes only inside the evaluation's scratch directory. From ABI 4 it
  also refuses TCP bind/connect, from ABI 6 signals to processes outside the sandbox and
  abstract UNIX sockets, and always ``ptrace``-class access (``/proc/<pid>/mem``,
  ``environ``) to processes outside it.

Why these rather than bubblewrap or nsjail: the same kernel mechanisms, reached from Python
through five syscalls, with no binary to install (bubblewrap is not on PyPI) and no exec in the
warm-fork path, where a fork of the zygote must stay a fork (kpipe.gym.confine.zygote). Why not a
different uid: the interpreter of many installs lives under a 0700 home (``/root/.pyenv`` on our
machines), which another uid cannot read; Landlock bounds the file system instead, whatever the
uid owns. seccomp is not used: the namespaces and Landlock already deny what a syscall filter
would, and a filter strict enough to matter breaks the CUDA driver's ioctls.

Where the kernel lacks a mechanism, ``probe()`` says which, once, and KernelGym refuses to start
unless the user opted out by name (``KPIPE_GYM_UNCONFINED=1``); it never runs unconfined silently.

Only the standard library is imported here: the fresh-interpreter path confines itself in
``python -m kpipe.gym.confine.sandbox`` before torch starts its threads (a multi-threaded process
cannot enter a user namespace), then execs the child.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import resource
import shutil
import signal
import site
import stat
import struct
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import kpipe
from kpipe.gym.confine.limits import join_cgroups
from kpipe.infra.process import PR_SET_DUMPABLE, PR_SET_PDEATHSIG

OPT_OUT_VARIABLE = "KPIPE_GYM_UNCONFINED"

# linux/sched.h
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
# linux/mount.h
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 0x1000, 0x4000, 1 << 18
# linux/prctl.h, linux/securebits.h, linux/capability.h
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 24, 28, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED, SECBIT_NO_SETUID_FIXUP, SECBIT_NO_SETUID_FIXUP_LOCKED = 1, 2, 4, 8
SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE, SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED = 32, 64, 128
LOCKED_SECUREBITS = (SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP | SECBIT_NO_SETUID_FIXUP_LOCKED
                     | SECBIT_KEEP_CAPS_LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED)
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# linux/landlock.h: syscall numbers are the same on every architecture (asm-generic)
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR, FS_MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM = 1 << 9, 1 << 10, 1 << 11, 1 << 12
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
WRITE = (FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG | FS_MAKE_SYM | FS_MAKE_FIFO
         | FS_MAKE_SOCK | FS_REFER | FS_TRUNCATE)
DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV

# System locations a Python process with torch, Triton and a C compiler reads: libraries,
# compilers (Triton builds its launchers with gcc; ptxas ships in the triton wheel), headers.
SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/opt/conda", "/usr/local/cuda",
               "/proc", "/sys", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
               "/etc/localtime", "/etc/nsswitch.conf", "/etc/passwd", "/etc/group", "/etc/os-release")
# Device nodes: the null devices, randomness, and the NVIDIA driver's nodes (CUDA opens them all
# when it initialises; CUDA_VISIBLE_DEVICES, set by the worker, picks the GPU).
DEVICE_GLOBS = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/nvidia*",
                "/dev/nvidia-caps/*", "/dev/dri/*")
# Where processes keep their pathname Unix sockets (Ray's raylet and object store under /tmp/ray,
# vLLM's ZMQ ipc:// sockets in the temporary directory, D-Bus and systemd's under /run): Landlock
# does not govern connect() to a pathname socket, so each is covered by an empty tmpfs in the
# sandbox's mount namespace (``hide_socket_dirs``); a socket bound elsewhere before the candidate starts is covered one by one (``hide_unix_sockets``).
SOCKET_DIRS = ("/tmp", "/var/tmp", "/run", "/dev/shm")


class SandboxUnavailable(RuntimeError):
    """The kernel cannot confine candidates here (no Landlock, no user namespaces, ...)."""


@dataclass(frozen=True)
class Sandbox:
    """What one candidate process may touch: `scratch` read-write, `read` read-only (and
    executable), `devices` read-write with ioctls."""

    scratch: str
    read: tuple[str, ...]
    devices: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"scratch": self.scratch, "read": list(self.read), "devices": list(self.devices)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Sandbox:
        return cls(str(data["scratch"]), tuple(data["read"]), tuple(data["devices"]))  # type: ignore[arg-type]


def install_roots() -> list[str]:
    """The interpreter's own files: its prefixes, standard library and site-packages, and the
    directory the ``kpipe`` package is imported from (an editable install's ``src``). Not
    ``sys.path`` as a whole: its first entry is the working directory, often a checkout or a
    home directory."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *sysconfig.get_paths().values(),
             *site.getsitepackages(), site.getusersitepackages(),
             str(Path(kpipe.__file__).resolve().parents[1])}
    return sorted(p for p in paths if p)


def mapped_library_dirs() -> list[str]:
    """Directories of the shared libraries this process has loaded (a CUDA driver under
    ``/usr/local/nvidia``, a conda prefix): whatever they live beside, a child loads too."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    fields = (line.split(maxsplit=5) for line in maps.splitlines())
    dirs = {os.path.dirname(f[5]) for f in fields if len(f) == 6 and f[5].startswith("/")}
    return sorted(d for d in dirs if d and not d.startswith(("/tmp", "/dev", "/proc", "/memfd")))


def toolchain_dirs(environ: dict[str, str]) -> list[str]:
    """Where CUDA, the linker, Triton's tools and the C compiler were pointed: ``CUDA_HOME``/
    ``CUDA_PATH``, ``LD_LIBRARY_PATH``, the ``TRITON_*_PATH`` tool overrides, and the install
    prefix of the C compiler Triton builds its launchers with (``$CC``, else cc/gcc/clang on
    ``PATH``: ``/opt/gcc`` for ``/opt/gcc/bin/gcc``, its headers and ``cc1`` included)."""
    dirs = [environ.get("CUDA_HOME", ""), environ.get("CUDA_PATH", "")]
    dirs += environ.get("LD_LIBRARY_PATH", "").split(":")
    dirs += [os.path.dirname(v) for k, v in environ.items() if k.startswith("TRITON_") and k.endswith("_PATH")]
    for compiler in (environ.get("CC", ""), "cc", "gcc", "clang"):
        found = shutil.which(compiler, path=environ.get("PATH")) if compiler else None
        if found:
            binary = Path(found).resolve()
            dirs.append(str(binary.parent.parent if binary.parent.name == "bin" else binary.parent))
    return [d for d in dirs if d and os.path.isabs(d)]


def sandbox_for(scratch: Path, environ: dict[str, str]) -> Sandbox:
    """The sandbox of a candidate whose scratch directory is `scratch` and whose environment
    (the child's, from kpipe.gym.confine.environment) is `environ`."""
    read = {*SYSTEM_READ, *install_roots(), *mapped_library_dirs(), *toolchain_dirs(environ)}
    devices = {path for pattern in DEVICE_GLOBS for path in glob.glob(pattern)}
    return Sandbox(str(scratch), tuple(sorted(p for p in read if os.path.exists(p))), tuple(sorted(devices)))


# ----------------------------------------------------------------------------- syscalls

_libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise SandboxUnavailable(f"{what} failed: {os.strerror(errno)} (errno {errno})")
    return result


def prctl(option: int, arg: int = 0) -> None:
    check(_libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)), f"prctl({option})")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or it is disabled)."""
    result = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(result, 0)


def handled_access(abi: int) -> tuple[int, int, int]:
    """(file system, network, scope) rights this ABI knows: every one is handled, so whatever
    no rule grants is denied."""
    fs = (1 << 13) - 1
    fs |= FS_REFER if abi >= 2 else 0
    fs |= FS_TRUNCATE if abi >= 3 else 0
    fs |= FS_IOCTL_DEV if abi >= 5 else 0
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scope = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    return fs, net, scope


PROC_SELF = "/proc/self"
_pinned: list[int] = []


def restrict_file_system(sandbox: Sandbox, abi: int) -> None:
    """Landlock this process (and everything it starts) to `sandbox`."""
    fs, net, scope = handled_access(abi)
    attr = struct.pack("QQQ", fs, net, scope)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    ruleset = check(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.c_char_p(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
                    "landlock_create_ruleset")
    try:
        rules = [(path, READ) for path in sandbox.read] + [(path, DEVICE) for path in sandbox.devices]
        rules.append((sandbox.scratch, READ | WRITE))
        # its own /proc entry (the rule binds to this process's directory, not to the link): the
        # CUDA driver's threads name themselves there (fopen("/proc/self/task/<tid>/comm", "w"):
        # write and truncate), and CUDA fails to initialise (cudaErrorOperatingSystem) when they cannot
        rules.append((PROC_SELF, FS_READ_FILE | FS_READ_DIR | FS_WRITE_FILE | FS_TRUNCATE))
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since the sandbox was planned: nothing to grant
            try:
                if not os.path.isdir(path):  # a file takes only file rights
                    access &= FS_EXECUTE | FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV
                rule = struct.pack("=Qi", access & fs, fd)
                check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                                    ctypes.c_char_p(rule), ctypes.c_uint32(0)), f"landlock_add_rule({path})")
            finally:
                if path == PROC_SELF:
                    # A rule lives on the inode, and the kernel may free an unused /proc/<pid> inode
                    # under memory pressure (a later lookup makes a new one the rule does not know):
                    # this descriptor keeps it alive
                    _pinned.append(fd)
                else:
                    os.close(fd)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def write_id_maps(uid: int, gid: int) -> None:
    """Map the namespace's root to the caller's own uid and gid (the one mapping an
    unprivileged process may write)."""
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")


def drop_capabilities() -> None:
    """No capability in any set, none to regain: ambient cleared, bounding set emptied, root's
    execve privileges locked off (SECBIT_NOROOT), then the effective/permitted/inheritable sets
    zeroed."""
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last_cap + 1):
        prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_SET_SECUREBITS, LOCKED_SECUREBITS)
    header = struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two __user_cap_data_struct of zeros
    number = SYS_CAPSET.get(os.uname().machine)
    if number is None:
        raise SandboxUnavailable(f"no capset syscall number known for {os.uname().machine}")
    check(_libc.syscall(number, ctypes.c_char_p(header), ctypes.c_char_p(data)), "capset")


def mount_own_proc() -> None:
    """Replace /proc by the PID namespace's own (it lists only this sandbox's processes)."""
    check(_libc.mount(b"none", b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None), "making mounts private")
    check(_libc.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC), None), "mounting /proc")


def hide_socket_dirs(sandbox: Sandbox) -> None:
    """Cover each of SOCKET_DIRS with an empty tmpfs, so no pathname socket of the run or the
    host under it can be named from the sandbox, whenever it is bound; what the sandbox reaches
    under one (its scratch directory, and the interpreter, a checkout or a driver the sandbox reads
    when they live there: ``kept_under``) is bind-mounted back at its own path. Before, a directory
    holding anything the sandbox reads stayed uncovered, and a socket bound there after the
    candidate started (``hide_unix_sockets`` covers those bound before) was reachable from it
    when the environment lived under ``/tmp`` (issue 62, row 14)."""
    reached = [os.path.realpath(p) for p in (sandbox.scratch, *sandbox.read, *sandbox.devices)]
    for directory in SOCKET_DIRS:
        if os.path.islink(directory) or not os.path.isdir(directory) or directory in reached:
            continue  # /var/run is a link to /run: covered there; a directory read whole stays
        kept = kept_under(directory, reached)
        # reachable after their parent is covered
        handles = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in kept}
        try:
            check(_libc.mount(b"tmpfs", directory.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC),
                              b"mode=0755,size=64k"), f"covering {directory}")
            for path, handle in handles.items():
                if os.path.isdir(f"/proc/self/fd/{handle}"):
                    os.makedirs(path, exist_ok=True)
                else:  # a file (a device node, a library): its mount point is an empty file
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
                check(_libc.mount(f"/proc/self/fd/{handle}".encode(), os.fsencode(path), None, ctypes.c_ulong(MS_BIND | MS_REC), None),
                      f"bind-mounting {path} back")
        finally:
            for handle in handles.values():
                os.close(handle)


def kept_under(directory: str, reached: list[str]) -> list[str]:
    """The paths of `reached` under `directory` that exist, none inside another (a bind mount of the
    outer one brings the inner one back with it), shortest first."""
    inside = f"{directory}/"
    kept: list[str] = []
    for path in sorted({p for p in reached if p.startswith(inside) and os.path.exists(p)}, key=len):
        if not any(path == outer or path.startswith(f"{outer}/") for outer in kept):
            kept.append(path)
    return kept


def bound_unix_sockets(table: str = "/proc/net/unix") -> list[str]:
    """The absolute paths of the pathname UNIX sockets bound in this network namespace (read before
    leaving it: the new one lists only its own). Abstract sockets (``@name``) and relative paths
    are left out: the first stay behind with the namespace, the second name no file we can find."""
    try:
        lines = Path(table).read_text(errors="replace").splitlines()[1:]
    except OSError:
        return []
    paths = {fields[7] for line in lines if len(fields := line.split(None, 7)) == 8 and fields[7].startswith("/")}
    return sorted(paths)


def hide_unix_sockets(paths: list[str]) -> None:
    """Cover every socket file of `paths` with /dev/null in this mount namespace, so a connect()
    to it is refused. A path that is gone, or that this process cannot reach (nor then the
    candidate), needs no cover; a socket that stays reachable is an error."""
    for path in paths:
        try:
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                continue
        except OSError:
            continue
        check(_libc.mount(b"/dev/null", os.fsencode(path), None, ctypes.c_ulong(MS_BIND), None), f"covering the socket {path}")


def enter_sandbox(sandbox: Sandbox) -> None:
    """Confine the calling process: on return it is pid 2 of a fresh PID namespace, in its own
    user, mount, network and IPC namespaces, Landlocked to `sandbox`, with no capabilities.

    Must be called single-threaded (after a fork, or before torch starts threads). Forks twice.
    The caller's process stays outside as the waiter; pid 1 inside mounts the namespace's /proc,
    reaps, and reports the candidate's end through a pipe (the candidate is not pid 1 itself:
    the kernel ignores a namespace's init's own fatal signals, so ``os.killpg(0, SIGKILL)`` or
    ``abort()`` would not end it). The waiter then exits as the candidate did (a signal death
    is re-raised): whoever started it sees one process, and killing its process group kills all
    three. Raises SandboxUnavailable if the namespaces cannot be made; a later failure ends the
    process with SETUP_FAILED and the reason on stderr, before anything of the candidate runs.
    """
    abi = landlock_abi()
    if abi < 1:
        raise SandboxUnavailable("the kernel has no Landlock (Linux >= 5.13 with landlock in the lsm= list)")
    uid, gid = os.geteuid(), os.getegid()
    sockets = bound_unix_sockets()
    check(_libc.unshare(ctypes.c_int(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC)),
          "unshare(user, mount, pid, net, ipc namespaces)")
    write_id_maps(uid, gid)
    report_r, report_w = os.pipe()  # set-up failures and the candidate's end, for the waiter
    init = os.fork()
    if init:
        os.close(report_w)
        wait_as_outside(init, report_r)
    os.close(report_r)
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the waiter outside dies (a timeout's SIGKILL): so does the namespace
        mount_own_proc()
        hide_socket_dirs(sandbox)
        hide_unix_sockets(sockets)  # the sockets outside SOCKET_DIRS
    except BaseException as exc:
        os.write(report_w, f"failed {type(exc).__name__}: {exc}\n".encode()[:4000])
        os._exit(SETUP_FAILED)
    candidate = os.fork()
    if candidate:
        reap_until(candidate, report_w)
    try:
        restrict_file_system(sandbox, abi)
        drop_capabilities()
        prctl(PR_SET_DUMPABLE, 1)  # its own /proc entries stay its own (a forked zygote child inherits 0)
    except BaseException as exc:
        os.write(report_w, f"failed {type(exc).__name__}: {exc}\n".encode()[:4000])
        os._exit(SETUP_FAILED)
    os.close(report_w)  # from here on, only trusted code (pid 1) reports


SETUP_FAILED = 121  # the sandbox's set-up failed: nothing of the candidate ran


def reap_until(candidate: int, report: int) -> None:
    """Pid 1 of the sandbox: reap every process the namespace orphans until the candidate ends,
    report its wait status, and exit (which ends whatever is left inside). Never returns."""
    try:
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == candidate:
                os.write(report, f"status {status}\n".encode())
                break
    finally:
        os._exit(0)


def wait_as_outside(init: int, report: int) -> None:
    """The waiter outside the sandbox: exit as the candidate did. Never returns."""
    try:
        lines = b""
        while chunk := os.read(report, 4096):
            lines += chunk
        os.waitpid(init, 0)
        status = None
        for line in lines.decode(errors="replace").splitlines():
            if line.startswith("failed "):
                os.write(2, f"kpipe sandbox: {line[len('failed '):]}\n".encode())
            elif line.startswith("status "):
                status = int(line.split()[1])
        if status is None:  # the namespace died first (killed from outside)
            os._exit(SETUP_FAILED if b"failed " in lines else 128 + signal.SIGKILL)
        if os.WIFSIGNALED(status):  # die of the same signal, without a core file
            signum = os.WTERMSIG(status)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two take no handler
                signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        os._exit(os.waitstatus_to_exitcode(status))
    finally:
        os._exit(1)


_probed: str | None = None


def probe() -> str | None:
    """Why candidates cannot be confined here, or None if they can: a throwaway interpreter
    enters a sandbox and must then fail to read a file planted beside its scratch directory.
    Asked once per process (about 0.1 s)."""
    global _probed
    if _probed is None:
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kgym-probe-") as root:
            canary = Path(root, "canary")
            canary.write_text("outside the sandbox")
            (Path(root) / "scratch").mkdir()
            run = subprocess.run([sys.executable, "-m", "kpipe.gym.confine.sandbox", "--probe", root], capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL, timeout=120)
        _probed = "" if run.returncode == 0 else (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
    return _probed or None


def probe_main(root: str) -> None:
    """The probe's sandboxed side (``python -m kpipe.gym.confine.sandbox --probe ROOT``)."""
    try:
        enter_sandbox(sandbox_for(Path(root, "scratch"), dict(os.environ)))
    except SandboxUnavailable as exc:
        print(exc, file=sys.stderr)
        os._exit(SETUP_FAILED)
    try:
        Path(root, "canary").read_text()
    except OSError:
        os._exit(0)
    print("a sandboxed process could still read a file outside its sandbox", file=sys.stderr)
    os._exit(1)


def opted_out(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return environ.get(OPT_OUT_VARIABLE, "") not in ("", "0")


def require_confinement() -> bool:
    """Whether candidates are confined: True where the kernel can; False only where the user
    opted out by name. Raises SandboxUnavailable (saying why, and how to opt out) otherwise."""
    if opted_out():
        return False
    reason = probe()
    if reason is not None:
        raise SandboxUnavailable(
            f"KernelGym cannot confine candidate programs on this machine: {reason}. It needs Landlock and "
            f"unprivileged user, mount, PID and network namespaces (docs/kernelgym.md, 'Confinement'). "
            f"To run candidates unconfined anyway, set {OPT_OUT_VARIABLE}=1."
        )
    return True


def main(argv: list[str]) -> None:
    """``python -m kpipe.gym.confine.sandbox JOBFILE``: confine this fresh interpreter as the job's
    ``sandbox`` says (a job without one runs unconfined), then run ``kpipe.gym.candidate.child`` on it in
    this process: torch is imported only inside."""
    if argv[0] == "--probe":
        probe_main(argv[1])
    job = json.loads(Path(argv[0]).read_text())
    join_cgroups(job.get("limits"))  # a candidate's cgroups (kpipe.gym.confine.limits): joined from outside the sandbox
    if "sandbox" in job:
        try:
            enter_sandbox(Sandbox.from_dict(job["sandbox"]))
        except SandboxUnavailable as exc:
            print(f"kpipe sandbox: {exc}", file=sys.stderr)
            os._exit(SETUP_FAILED)
    import runpy

    sys.argv = [sys.argv[0], argv[0]]
    runpy.run_module("kpipe.gym.candidate.child", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
