"""GPU leases: a job that needs k GPUs locks k of them and sets CUDA_VISIBLE_DEVICES.

Snakemake's `gpu` resource only counts; it never says *which* GPUs a job may use. A lease
picks free GPUs with file locks shared by every job on the host, and must be taken before
torch is imported (CUDA reads CUDA_VISIBLE_DEVICES once, at initialisation). On a cluster
that already set CUDA_VISIBLE_DEVICES for the job, the lease honours that set and only checks
that it is large enough. This module must not import torch.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def gpu_count() -> int:
    return len(visible_gpus())


@contextmanager
def gpu_lease(count: int, lock_dir: Path = LOCK_DIR, wait: bool = True) -> Iterator[list[str]]:
    """Hold `count` GPUs for the duration of the block; CUDA_VISIBLE_DEVICES names them.

    count == 0 hides every GPU (CUDA_VISIBLE_DEVICES="") so a CPU job cannot grab one by
    accident. Raises GPULeaseError at once when the machine has fewer than `count` GPUs.
    """
    if count == 0:
        previous = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            yield []
        finally:
            _restore(previous)
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
                fd = os.open(lock_dir / f"gpu{gpu}.lock", os.O_CREAT | os.O_RDWR, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held.append((gpu, fd))
                except BlockingIOError:
                    os.close(fd)
            if len(held) < count:
                if not wait:
                    raise GPULeaseError(f"only {len(held)} of {count} GPU(s) free")
                time.sleep(1.0)
        previous = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(g for g, _ in held)
        try:
            yield [g for g, _ in held]
        finally:
            _restore(previous)
    finally:
        for _, fd in held:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


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
