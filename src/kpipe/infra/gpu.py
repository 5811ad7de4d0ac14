"""GPU leases: a job that needs k GPUs locks k of them and sets CUDA_VISIBLE_DEVICES.

Snakemake's `gpu` resource only counts; it never says *which* GPUs a job may use. A lease
picks free GPUs with file locks shared by every job on the host, and must be taken before
torch is imported (CUDA reads CUDA_VISIBLE_DEVICES once, at initialisation). On a cluster
that already set CUDA_VISIBLE_DEVICES for the job, the lease honours that set and only checks
that it is large enough. This module must not import torch.

A job may also lease a share of one GPU: `slots` of the GPU's `slots_per_gpu` (the nano policy,
a one-task evaluation), so Snakemake can run several such jobs on one GPU at once (its
`gpu_slots` resource counts them). A share holds one slot lock and a shared lock on the GPU; a
whole-GPU lease holds the GPU's lock exclusively, so it waits until no share is held.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import click

LOCK_DIR = Path(os.environ.get("KPIPE_GPU_LOCK_DIR", "/tmp/kpipe-gpu-locks"))


class GPULeaseError(RuntimeError):
    """More GPUs were asked for than the machine (or the cluster allocation) has."""


def visible_gpus() -> list[str]:
    """GPU ids this process may use: the cluster's CUDA_VISIBLE_DEVICES, else nvidia-smi's list."""
    preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if preset is not None:
        return [g for g in preset.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpu_names(ids: list[str]) -> list[str]:
    """The cards behind GPU ids (nvidia-smi's names; "unknown" where it cannot say), so that a run's logs
    name the hardware its timings come from."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return ["unknown"] * len(ids)
    names = dict(line.split(", ", 1) for line in out.splitlines() if ", " in line)
    return [names.get(gpu.strip(), "unknown") for gpu in ids]


@contextmanager
def gpu_lease(count: int, lock_dir: Path = LOCK_DIR, wait: bool = True) -> Iterator[list[str]]:
    """Hold `count` GPUs for the duration of the block; CUDA_VISIBLE_DEVICES names them.

    count == 0 hides every GPU (CUDA_VISIBLE_DEVICES="") so a CPU job cannot grab one by
    accident. Raises GPULeaseError at once when the machine has fewer than `count` GPUs.
    """
    if count == 0:
        with _visible([]) as none:
            yield none
        return
    candidates = visible_gpus()
    if count > len(candidates):
        raise GPULeaseError(f"job asks for {count} GPU(s) but only {len(candidates)} are visible ({','.join(candidates) or 'none'})")
    lock_dir.mkdir(parents=True, exist_ok=True)
    held: list[tuple[str, int]] = []
    try:
        while len(held) < count:
            for gpu in candidates:
                if len(held) == count or any(g == gpu for g, _ in held):
                    continue
                fd = _try_lock(lock_dir / f"gpu{gpu}.lock", fcntl.LOCK_EX)
                if fd is not None:
                    held.append((gpu, fd))
            if len(held) < count:
                if not wait:
                    raise GPULeaseError(f"only {len(held)} of {count} GPU(s) free")
                time.sleep(1.0)
        with _visible([g for g, _ in held]) as gpus:
            yield gpus
    finally:
        _release(fd for _, fd in held)


@contextmanager
def gpu_slot_lease(slots: int, slots_per_gpu: int, lock_dir: Path = LOCK_DIR, wait: bool = True) -> Iterator[list[str]]:
    """Hold `slots` GPU slots: whole GPUs when `slots` is a multiple of `slots_per_gpu`, else a
    share of one GPU (fewer slots than it has); CUDA_VISIBLE_DEVICES names the GPU(s)."""
    if slots % slots_per_gpu == 0:
        with gpu_lease(slots // slots_per_gpu, lock_dir, wait) as gpus:
            yield gpus
        return
    if slots > slots_per_gpu:
        raise GPULeaseError(f"{slots} GPU slots are neither a share of one GPU nor whole GPUs of {slots_per_gpu} slots")
    candidates = visible_gpus()
    if not candidates:
        raise GPULeaseError("job asks for a share of a GPU but none is visible")
    lock_dir.mkdir(parents=True, exist_ok=True)
    while (held := _share(candidates, slots, slots_per_gpu, lock_dir)) is None:
        if not wait:
            raise GPULeaseError(f"no GPU has {slots} free slot(s)")
        time.sleep(1.0)
    gpu, fds = held
    try:
        with _visible([gpu]) as gpus:
            yield gpus
    finally:
        _release(fds)


def job_lease(gpus: int, slots: tuple[int, int] | None = None) -> AbstractContextManager[list[str]]:
    """What a job holds while it runs: `slots` (its GPU slots, slots per GPU) when it declared
    them, else `gpus` whole GPUs (``kpipe launch`` and a job in its own process alike)."""
    return gpu_lease(gpus) if slots is None else gpu_slot_lease(*slots)


def _share(candidates: list[str], slots: int, slots_per_gpu: int, lock_dir: Path) -> tuple[str, list[int]] | None:
    """The first GPU (so shares fill one GPU before the next, leaving others whole) with `slots`
    free slots, and the locks taken on it; None when no GPU has them now."""
    for gpu in candidates:
        whole = _try_lock(lock_dir / f"gpu{gpu}.lock", fcntl.LOCK_SH)
        if whole is None:
            continue
        fds = [whole]
        for slot in range(slots_per_gpu):
            if len(fds) == slots + 1:
                break
            fd = _try_lock(lock_dir / f"gpu{gpu}.slot{slot}.lock", fcntl.LOCK_EX)
            if fd is not None:
                fds.append(fd)
        if len(fds) == slots + 1:
            return gpu, fds
        _release(fds)
    return None


def _try_lock(path: Path, mode: int) -> int | None:
    """An fd holding `mode` on `path`, or None when another lease holds it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _release(fds: Iterable[int]) -> None:
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def _visible(gpus: list[str]) -> Iterator[list[str]]:
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        yield gpus
    finally:
        _restore(previous)


def _restore(previous: str | None) -> None:
    if previous is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = previous


@click.group("gpu")
def gpu_command() -> None:
    """GPU leases for jobs run outside Snakemake's Python scripts."""


@gpu_command.command("list")
def list_command() -> None:
    """Print the GPUs this process may use."""
    click.echo(",".join(visible_gpus()) or "(none)")


@gpu_command.command("run", context_settings={"ignore_unknown_options": True})
@click.option("-n", "--gpus", "count", type=int, required=True, help="GPUs to lease")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_command(count: int, command: tuple[str, ...]) -> None:
    """Run COMMAND holding a lease on N GPUs (CUDA_VISIBLE_DEVICES set for it)."""
    try:
        with gpu_lease(count):
            sys.exit(subprocess.call(list(command)))
    except GPULeaseError as error:
        raise click.ClickException(str(error)) from None
