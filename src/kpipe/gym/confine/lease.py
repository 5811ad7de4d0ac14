"""The timing lease: while one evaluation child times on a device, no other child there runs.

Several evaluations share a GPU (``kpipe.gym.serve.pool`` runs several workers per GPU): their start-up,
imports, Triton compiles, input generation and correctness trials overlap one another. A timed
region overlaps none of them: the judge (never the candidate) takes the device's lease for its
child from the gate until the child has exited (its context's teardown is GPU work too;
``kpipe.gym.confine.isolate.run_isolated``),
and every other judge on the device stops its own child (SIGSTOP to its process group) while the
lease's timing part (below) is held by someone else, and resumes it after (``ChildPauser``; the paused seconds are added
to that child's deadline). Overlapping only the timed regions was measured and is not enough: the
other children's correctness trials on the GPU spread one candidate's speedups over 8 evaluations
by up to 1.28x on an H200, where one child at a time kept them within 1.006x
(`965801b:docs/gpu-results/gym_scaling_2026-11-26_4xH200.md`).

The lease has two parts, each a byte of the lock file: the **device** (no other timed region may
start) and **timing** (every other child is stopped). The judge takes both at the gate; once its child
has answered its last timing window, the last thing it times, the judge gives up the timing part alone
(``HeldLease.end_timing``): the other children run again during the child's integrity check, result
and exit, while the device stays held until the child has exited, so no timed region runs beside its
teardown. On an H200 with two workers a GPU, the other child was stopped for those 0.15-0.17 s of
every evaluation.

The lease is an open-file-description lock on a file named after the GPU's UUID, so every pool,
service and job on the machine shares it, whatever its own process tree; a holder that dies
releases it. A candidate cannot reach the lock files (its sandbox reads no ``/tmp`` but its own
scratch) nor skip the gate without being judged ``hacked``. One that leaves its process group
escapes the pause: its GPU work then slows the others' timings (which their paired reference
trials see), never speeds up its own.

On a CPU there is one lease for the host: CPU timings of two children would share its cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LEASE_DIR_VARIABLE = "KPIPE_GYM_LEASE_DIR"
DEFAULT_LEASE_DIR = "/tmp/kpipe-gym-timing-leases"
# how long a judge waits for its device's timing lease, in child timeouts: every holder
# releases it within one (its child's deadline), so this many children would have to be
# queued ahead on one device (kpipe.gym.serve.pool runs at most a few workers per GPU)
LEASE_MAX_WAIT_TIMEOUTS = 8
POLL_S = 0.001
# after taking the lease, before the child may time: the other judges (polling every POLL_S)
# stop their children, and the GPU finishes what those had queued. 0.05, 0.1 and 0.25 s were
# measured and changed no spread (`965801b:docs/gpu-results/gym_neighbours_2026-11-26_H200.md`)
SETTLE_S = 0.01
# struct flock on Linux (x86_64, aarch64): l_type, l_whence, l_start, l_len, l_pid
FLOCK = struct.Struct("hhxxxxqqixxxx")
# the lock file's bytes: the device part (taken first, kept until the child's exit) and the
# timing part (other children stopped while someone holds it)
DEVICE_BYTE, TIMING_BYTE = 0, 1


def lock_request(kind: int, byte: int) -> bytes:
    return FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)


@dataclass
class HeldLease:
    """A judge's hold of its device's lease: the seconds it waited for it (the caller adds them to
    its child's deadline), and the open lock file."""

    waited_s: float
    fd: int

    def end_timing(self) -> None:
        """Let the device's other children run again, keeping the device until the hold ends: the
        child's timed work is over, its exit (GPU work) is not."""
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, lock_request(fcntl.F_UNLCK, TIMING_BYTE))


class LeaseTimeout(RuntimeError):
    """The device stayed leased longer than any holder may: the judge gives the job back."""


class TimingLease:
    """Exclusive use of one device for timing, held by a judge for one child at a time."""

    def __init__(self, key: str, max_wait_s: float, lock_dir: Path | None = None) -> None:
        self.key = key
        self.max_wait_s = max_wait_s
        self.lock_dir = lock_dir or Path(os.environ.get(LEASE_DIR_VARIABLE, DEFAULT_LEASE_DIR))

    def open_file(self) -> int:
        """The lock file, shared by every user of the machine (a GPU is: the directory is
        world-writable and sticky, like /tmp, and the files readable and writable by all)."""
        if not self.lock_dir.is_dir():
            self.lock_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(PermissionError):
                self.lock_dir.chmod(0o1777)
        path = self.lock_dir / f"{self.key}.lock"
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o666)
        except PermissionError:
            raise PermissionError(f"cannot open the timing lease {path}: make it writable for every user of "
                                  f"the GPU, or set {LEASE_DIR_VARIABLE}") from None
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o666)
        return fd

    @contextlib.contextmanager
    def hold(self) -> Iterator[HeldLease]:
        """Wait for the device (at most ``max_wait_s``), hold both parts of its lease for the block
        (the device, then timing) and give the other judges ``SETTLE_S`` to stop their children."""
        fd = self.open_file()
        started = time.monotonic()
        try:
            for byte in (DEVICE_BYTE, TIMING_BYTE):  # one order for every holder: none waits on another's second part
                while True:
                    try:
                        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock_request(fcntl.F_WRLCK, byte))
                        break
                    except (BlockingIOError, PermissionError):
                        if time.monotonic() - started > self.max_wait_s:
                            raise LeaseTimeout(f"the timing lease of {self.key} was not free within {self.max_wait_s:g} s") from None
                        time.sleep(POLL_S)
            time.sleep(SETTLE_S)
            yield HeldLease(time.monotonic() - started, fd)
        finally:
            os.close(fd)  # releases both parts

    def held_elsewhere(self, fd: int, byte: int = TIMING_BYTE) -> bool:
        """Whether an open of the lease other than `fd`'s holds its timing part (or `byte`'s part),
        asked without taking it."""
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, lock_request(fcntl.F_WRLCK, byte))
        return FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


class ChildPauser(threading.Thread):
    """Stops a child's process group whenever another child holds its device's lease, and
    resumes it when the lease is free or its own judge takes it (``take_over``)."""

    def __init__(self, pgid: int, lease: TimingLease) -> None:
        super().__init__(daemon=True, name=f"kgym-pauser-{pgid}")
        self.pgid = pgid
        self.lease = lease
        self._fd = lease.open_file()
        self._state = threading.Lock()
        self._done = threading.Event()
        self._own = False
        self._paused_since: float | None = None
        self._paused_s = 0.0

    def paused_s(self) -> float:
        """Seconds this child has spent stopped so far (its deadline moves by as much)."""
        with self._state:
            current = time.monotonic() - self._paused_since if self._paused_since is not None else 0.0
            return self._paused_s + current

    def run(self) -> None:
        while not self._done.wait(POLL_S):
            with self._state:
                if self._own:
                    return
                if self.lease.held_elsewhere(self._fd):
                    if self._paused_since is None:
                        self._signal(signal.SIGSTOP)
                        self._paused_since = time.monotonic()
                elif self._paused_since is not None:
                    self._resume()

    def restart_count(self) -> None:
        """Count paused seconds from now (a child started ahead of its job: ``paused_s`` is then
        its job's)."""
        with self._state:
            self._paused_s = 0.0
            if self._paused_since is not None:
                self._paused_since = time.monotonic()

    def take_over(self) -> None:
        """Its own judge holds the lease now: run the child, and stop watching."""
        with self._state:
            self._own = True
            self._resume()

    def finish(self) -> None:
        self._done.set()
        self.join()
        with self._state:
            self._resume()
        os.close(self._fd)

    def _resume(self) -> None:
        if self._paused_since is not None:
            self._signal(signal.SIGCONT)
            self._paused_s += time.monotonic() - self._paused_since
            self._paused_since = None

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def lease_key(gpu: str | None) -> str:
    """The name of a device's lease: ``cpu``, or the GPU's UUID (a pool's GPU ids are indices
    or UUIDs; two spellings of one GPU must share a lease)."""
    if gpu is None:
        return "cpu"
    if gpu.startswith(("GPU-", "MIG-")):
        return gpu
    return gpu_identity(gpu)[1] or f"gpu{gpu}"  # the index itself where nvidia-smi is absent


@functools.lru_cache(maxsize=16)
def gpu_identity(index: str) -> tuple[str, str]:
    """nvidia-smi's (name, UUID) of the GPU with this index or UUID, asked once per process (a
    query takes up to a second where NVML starts cold); empty strings without nvidia-smi."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid", "--format=csv,noheader", "-i", index],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            name, _, uuid = out.stdout.strip().splitlines()[0].rpartition(",")
            return name.strip(), uuid.strip()
    return "", ""


def device_lease(device: str, max_wait_s: float) -> TimingLease:
    """The lease of the device this process evaluates on: the first visible GPU, or the host."""
    if device != "cuda":
        return TimingLease("cpu", max_wait_s)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    return TimingLease(lease_key(visible), max_wait_s)
