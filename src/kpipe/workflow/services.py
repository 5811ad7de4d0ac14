"""The services of one workflow run, started and stopped in one place: the Snakefile's ``onstart``
calls :func:`start`, ``onsuccess`` and ``onerror`` call :func:`stop`.

Today that is the run's KernelGym service (:mod:`kpipe.gym.serve.run_service`): one per run and machine,
started by the first job that evaluates, found by the jobs (child processes of Snakemake) through
the environment this module sets, stopped with the run (or by itself when Snakemake's process ends).
A run whose jobs execute elsewhere (a cluster executor), or one with ``gym.service: off`` or the
``local`` backend, gets none: each of its jobs evaluates in a pool of its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kpipe.gym.serve.run_service import announce, stop_services, withdraw


class ServiceError(RuntimeError):
    """The run cannot start as configured (one line, for the user)."""


@dataclass(frozen=True)
class RunServices:
    """The run's services: `directory` holds their records (results/.gym); `gpus` are the GPUs the
    run's KernelGym service may time on (none: CPU workers); `shared_gym` whether there is one."""

    directory: Path
    gpus: tuple[str, ...]
    shared_gym: bool

    @classmethod
    def of_run(cls, config: Mapping[str, Any], directory: str | os.PathLike, gpus: Sequence[str],
               runs_here: bool) -> RunServices:
        """The services `config` asks for: the shared KernelGym service when ``gym.service`` is auto, the
        backend is the pool and the jobs run on this machine (`runs_here`), timing on the run's `gpus`."""
        gym = config["gym"]
        return cls(Path(directory), tuple(gpus), gym["service"] == "auto" and gym["backend"] == "pool" and runs_here)

    def start(self) -> None:
        """Make the services findable by the run's jobs (Snakemake's ``onstart``, before any job)."""
        if self.shared_gym:
            announce(self.directory, list(self.gpus))
        else:
            withdraw()

    def stop(self) -> list[int]:
        """Stop every service this run started (``onsuccess``/``onerror``); returns their pids."""
        withdraw()
        return stop_services(self.directory)


def check_devices(config: Mapping[str, Any], visible_gpus: Sequence[str], runs_here: bool) -> None:
    """A run (not a dry run) of ``device: cuda`` on this machine needs a GPU; a cluster's login node may
    show none: there the executor places jobs on GPU nodes."""
    if config["device"] == "cuda" and runs_here and not visible_gpus:
        raise ServiceError("config error: device: cuda (config/gpu.yaml and config/paper.yaml set it), but this "
                           "machine shows no GPU (nvidia-smi -L, CUDA_VISIBLE_DEVICES); on a CPU, run without them")
