"""The one way a rule's job runs: ``run_job(snakemake, function, *args, **kwargs)``.

Every script under ``workflow/scripts`` is that one call (scripts/rule_map.py checks it). The job
runs in its own process, logged to the rule's log file under its GPU slots; a job marked
:func:`forkable` or :func:`launched` may instead be forked from the run's warm starter
(:mod:`kpipe.infra.warm_start`), or become ``kpipe launch`` on its GPUs (:mod:`kpipe.infra.launch`).
Which backend runs it changes its start time, never its outputs. A job's module must not touch
CUDA when imported: the job's lease sets ``CUDA_VISIBLE_DEVICES`` after the script's imports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

from kpipe.infra import warm_start
from kpipe.infra.gpu import gpu_slot_lease
from kpipe.infra.launch import launch_command, launch_plan
from kpipe.infra.process import process_age

log = logging.getLogger("kpipe")
# Unix time a job's Snakemake script began, inherited by the processes the job becomes or starts:
# their first working log line says how long the job took to get there (imports, models, CUDA).
JOB_STARTED = "KPIPE_JOB_STARTED"


def mark_job_started() -> None:
    """Note when this job's process began, Python's start and Snakemake's script preamble included
    (once: a process the job starts keeps the job's time)."""
    age = process_age(os.getpid())
    os.environ.setdefault(JOB_STARTED, f"{time.time() - (age or 0.0):.3f}")


def since_job_started() -> str:
    """`` N s after the job began`` for a job's first working log line; empty outside a job."""
    started = os.environ.get(JOB_STARTED)
    return f" ({time.time() - float(started):.1f} s after the job began)" if started else ""


class _Tee:
    """Write to the rule's log file and to the terminal, so progress stays visible."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def isatty(self) -> bool:
        return False


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def job_slots(smk: Any) -> tuple[int, int]:
    """A Snakemake job's GPU slots (``resources.gpu_slots``) and the slots of one GPU (config ``gpu.slots_per_gpu``)."""
    return int(getattr(smk.resources, "gpu_slots", 0) or 0), int(smk.config["gpu"]["slots_per_gpu"])


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr, force=True)
    # httpx (the OpenAI client's transport) logs every request at INFO, between the progress bars' lines
    logging.getLogger("httpx").setLevel(logging.WARNING)


# how long a Ctrl-C'd job may take to unwind (its servers stopped, its scratch removed) before it is ended
INTERRUPT_GRACE_S = 5.0


@contextlib.contextmanager
def dies_on_interrupt() -> Iterator[None]:
    """Ctrl-C (SIGINT) ends this process within ``INTERRUPT_GRACE_S``: KeyboardInterrupt is raised
    as usual, so the job unwinds (the offline teacher's server stopped, scratch removed), and the
    signal itself ends the process if it is still there after the grace. Raised alone, the
    KeyboardInterrupt can land in a callback whose exceptions Python only prints (a module lock's
    during an import: "Exception ignored in ..."): an evaluation job of a Ctrl-C'd run then ran on
    to its end after Snakemake had given up on it, and its output, written 21 s later, was marked
    incomplete for the next run. A second Ctrl-C ends it at once. The previous handler comes back on
    exit; outside the main thread (where no handler can be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)  # the timer's signal, or a second Ctrl-C, ends the process
        timer = threading.Timer(INTERRUPT_GRACE_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def threads_held_to(threads: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Hold the job's Rayon thread pools (Hugging Face tokenizers: the tiny model's BPE trainer, batch
    encoding) to the `threads` Snakemake packed it by. Snakemake sets OMP_NUM_THREADS and the BLAS
    libraries' variables to them, not Rayon's, which otherwise takes every core of the machine beside
    the run's other jobs and KernelGym services (the BPE training: 1.5 s on two threads, 2.3 s on one,
    on a 2-core CPU). A value the user set stays."""
    environ.setdefault("RAYON_NUM_THREADS", str(max(1, int(threads))))


Job = TypeVar("Job", bound=Callable[..., Any])
# jobs whose function returns the `kpipe` command line each of their processes runs (`launched`)
LAUNCHED: set[str] = set()


def job_name(function: Callable[..., Any]) -> str:
    """``module:function``: how the warm starter's table names a job."""
    return f"{function.__module__}:{function.__qualname__}"


def forkable(function: Job) -> Job:
    """Mark a job the run's warm starter may fork: one that imports torch and transformers (it loads
    a local model: ~10 s in a fresh Python on an H200). Its arguments are JSON values, forked or not."""
    warm_start.register(job_name(function), _runner(function))
    return function


def launched(function: Job) -> Job:
    """Mark a job whose function returns the ``kpipe`` command line each of its processes runs: one
    per GPU of the rule's `gpu` resource (``kpipe launch``: FSDP from two, ``srun`` over a multi-node
    job's nodes). A job of one process here is :func:`forkable` like any other."""
    LAUNCHED.add(job_name(function))
    warm_start.register(job_name(function), _runner(function))
    return function


def run_kpipe(argv: Sequence[str]) -> None:
    """Run ``kpipe ARGV`` in this process, as the one-process launch ``python -m kpipe.cli ARGV`` does;
    exits with its status (click's)."""
    sys.argv = ["kpipe", *argv]
    runpy.run_module("kpipe.cli", run_name="__main__", alter_sys=True)


def _runner(function: Callable[..., Any]) -> warm_start.Runner:
    """What runs a job in the process it ends up in (the job's own, or a forked worker)."""
    def run(args: list, kwargs: dict) -> None:
        configure_logging()
        if job_name(function) in LAUNCHED:
            run_kpipe(function(*args, **kwargs))
        else:
            function(*args, **kwargs)

    return run


def run_job(smk: Any, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run ``function(*args, **kwargs)`` as the Snakemake job `smk` (a script's ``snakemake``).

    - A :func:`launched` job whose rule asks for several processes here, or several nodes: this
      process becomes ``kpipe launch --gpus N -- <its command>``, its output in ``log[0]``; the
      launch leases the GPUs.
    - Else the job's own process holds its lease of ``resources.gpu_slots`` (of config
      ``gpu.slots_per_gpu`` per GPU), logs to ``log[0]`` and the terminal, ends on Ctrl-C
      (:func:`dies_on_interrupt`) and holds Rust's thread pools to the job's ``threads``
      (:func:`threads_held_to`). A :func:`forkable` or launched job is forked from the run's warm
      starter when there is one done with its imports (this process waits for its exit status);
      any other runs here. A starter that refuses the job's credentials fails it; one that is
      gone, still importing or without the job lets it run here.
    """
    mark_job_started()
    threads_held_to(smk.threads)  # before a hand-over: the forked worker takes this environment
    # the run's starter is this job's to ask, not a thing anything the job starts should see
    starter = {name: os.environ.pop(name) for name in (warm_start.WARM_START_ENV, warm_start.TOKEN_ENV)
               if name in os.environ}
    name = job_name(function)
    if name in warm_start.FORKABLE:
        args, kwargs = json.loads(json.dumps([list(args), kwargs]))  # JSON values: a job runs alike forked or not
    if name in LAUNCHED:
        command = function(*args, **kwargs)
        if not _one_process_here(int(smk.resources.gpu), command):
            _become_launch(int(smk.resources.gpu), command, smk.log[0] if smk.log else None, job_slots(smk))
    with _job_process(smk) as log_fd:
        if name in warm_start.FORKABLE and starter:
            code = warm_start.fork_job(name, list(args), kwargs, log_fd, log.warning, starter)
            if code is not None:
                sys.exit(code)
        _runner(function)(list(args), kwargs)


def _one_process_here(gpus: int, command: Sequence[str]) -> bool:
    """Whether ``kpipe launch --gpus N -- COMMAND`` would run one plain Python process on this node."""
    try:
        plan = launch_plan(gpus, command, os.environ, node_task=False)
    except (ValueError, FileNotFoundError):
        return False  # `kpipe launch` says what is wrong
    return plan[1:3] == ["-m", "kpipe.cli"]


def _become_launch(gpus: int, command: Sequence[str], log_path: str | os.PathLike | None,
                   slots: tuple[int, int]) -> NoReturn:
    """Replace this process by ``kpipe launch --gpus N -- COMMAND``, stdout and stderr to `log_path`.

    A rule's ``script:`` runs in the job's own process (locally, in a SLURM job step, on a
    Kubernetes pod), so after the exec the job *is* the launch: the GPU lease, the srun fan-out
    over the job's nodes and accelerate's processes happen exactly as for a shell rule running
    ``kpipe launch ... > {log} 2>&1``, and Snakemake sees its exit status."""
    launch = launch_command(gpus, command, slots)
    sys.stdout.flush()
    sys.stderr.flush()
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.execv(launch[0], launch)


@contextlib.contextmanager
def _job_process(smk: Any) -> Iterator[int]:
    """The job's own process while it runs: logging to ``log[0]`` (and the terminal), the lease of
    its GPU slots, Ctrl-C ending it; yields the file descriptor of its log (a forked job writes there)."""
    log_path = Path(smk.log[0]) if smk.log else None
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(dies_on_interrupt())
        log_fd = sys.__stdout__.fileno()
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = stack.enter_context(open(log_path, "w"))
            log_fd = log_file.fileno()
            stack.enter_context(contextlib.redirect_stdout(_Tee(log_file, sys.__stdout__)))
            stack.enter_context(contextlib.redirect_stderr(_Tee(log_file, sys.__stderr__)))
        configure_logging()
        slots, per_gpu = job_slots(smk)
        leased = stack.enter_context(gpu_slot_lease(slots, per_gpu))
        log.info("rule %s: %d of %d GPU slot(s) per GPU leased on %s", smk.rule, slots, per_gpu, leased)
        try:
            yield log_fd
        except Exception:
            traceback.print_exc()
            raise
