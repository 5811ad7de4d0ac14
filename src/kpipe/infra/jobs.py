"""The one way a rule's job runs: ``run_job(snakemake, function, *args, **kwargs)``.

Every script under ``workflow/scripts`` is that one call (scripts/rule_map.py checks it): the rule's
script calls the job's function, in the job's own process, logged to the rule's log file under its
GPU slots. A job marked :func:`launched` (the training rules) whose rule asks for several processes
becomes ``kpipe launch`` on its GPUs (:mod:`kpipe.infra.launch`) instead: its settings (its keyword
arguments, JSON values) go into one file beside its log, and every process runs
``python -m kpipe.infra.jobs FILE``, which calls the function with them. A job's module must not
touch CUDA when imported: the job's lease sets ``CUDA_VISIBLE_DEVICES`` after the script's imports.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

from kpipe.infra.gpu import gpu_names, gpu_slot_lease
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

    def fileno(self) -> int:
        """The log file's descriptor: libraries that redirect at the descriptor level (vLLM's
        ``suppress_stdout``) need one, and what native code writes belongs in the rule's log."""
        return self.streams[0].fileno()


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
# jobs that may run in one process per GPU of their rule (`launched`), by `job_name`
LAUNCHED: set[str] = set()
JOBS_MODULE = "kpipe.infra.jobs"  # what each process of a launched job runs: python -m kpipe.infra.jobs FILE


def job_name(function: Callable[..., Any]) -> str:
    """``module:function``: how a job's settings file names its function."""
    return f"{function.__module__}:{function.__qualname__}"


def launched(function: Job) -> Job:
    """Mark a job that runs in one process per GPU of its rule's `gpu` resource (``kpipe launch``: FSDP
    from two, ``srun`` over a multi-node job's nodes), each process calling it with the same keyword
    arguments (JSON values)."""
    LAUNCHED.add(job_name(function))
    return function


def write_job_file(path: str | os.PathLike, function: Callable[..., Any], settings: dict[str, Any]) -> Path:
    """A launched job's settings file: its function and keyword arguments, read by every process."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"job": job_name(function), "settings": settings}, indent=1, sort_keys=True))
    return path


def run_job_file(path: str | os.PathLike) -> None:
    """Call the job a settings file names with its settings (each process of a launched job does)."""
    document = json.loads(Path(path).read_text())
    module, _, name = document["job"].partition(":")
    function = getattr(importlib.import_module(module), name)
    if job_name(function) not in LAUNCHED:
        raise ValueError(f"{document['job']} is not a launched job (kpipe.infra.jobs.launched)")
    configure_logging()
    function(**document["settings"])


def run_job(smk: Any, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run ``function(*args, **kwargs)`` as the Snakemake job `smk` (a script's ``snakemake``).

    - A :func:`launched` job (keyword arguments only) whose rule asks for several processes here, or
      several nodes: its settings go into ``<log>.job.json`` and this process becomes ``kpipe launch
      --gpus N --module kpipe.infra.jobs -- <that file>``, its output in ``log[0]``; the launch leases the GPUs.
    - Else the function runs in this process, which holds its lease of ``resources.gpu_slots`` (of
      config ``gpu.slots_per_gpu`` per GPU), logs to ``log[0]`` and the terminal, ends on Ctrl-C
      (:func:`dies_on_interrupt`) and holds Rust's thread pools to the job's ``threads``
      (:func:`threads_held_to`).
    """
    mark_job_started()
    threads_held_to(smk.threads)
    if job_name(function) in LAUNCHED:
        if args:
            raise TypeError(f"{job_name(function)}: a launched job takes keyword arguments only")
        kwargs = json.loads(json.dumps(kwargs))  # JSON values: each process reads them from the file
        gpus = int(smk.resources.gpu)
        if not _one_process_here(gpus):
            if not smk.log:
                raise ValueError(f"rule {smk.rule}: a launched job needs a log (its settings file goes beside it)")
            settings = write_job_file(Path(smk.log[0]).with_suffix(".job.json"), function, kwargs)
            _become_launch(gpus, [str(settings)], smk.log[0], job_slots(smk))
    with _job_process(smk):
        function(*args, **kwargs)


def _one_process_here(gpus: int) -> bool:
    """Whether ``kpipe launch --gpus N`` of a job would run one plain Python process on this node."""
    try:
        plan = launch_plan(gpus, ["-"], os.environ, node_task=False, module=JOBS_MODULE)
    except (ValueError, FileNotFoundError):
        return False  # `kpipe launch` says what is wrong
    return plan[1:3] == ["-m", JOBS_MODULE]


def _become_launch(gpus: int, command: Sequence[str], log_path: str | os.PathLike | None,
                   slots: tuple[int, int]) -> NoReturn:
    """Replace this process by ``kpipe launch --gpus N --module kpipe.infra.jobs -- COMMAND``, stdout and
    stderr to `log_path`.

    A rule's ``script:`` runs in the job's own process (locally, in a SLURM job step, on a
    Kubernetes pod), so after the exec the job *is* the launch: the GPU lease, the srun fan-out
    over the job's nodes and accelerate's processes happen exactly as for a shell rule running
    ``kpipe launch ... > {log} 2>&1``, and Snakemake sees its exit status."""
    launch = launch_command(gpus, command, slots, module=JOBS_MODULE)
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
def _job_process(smk: Any) -> Iterator[None]:
    """The job's own process while it runs: logging to ``log[0]`` (and the terminal), the lease of
    its GPU slots, Ctrl-C ending it."""
    log_path = Path(smk.log[0]) if smk.log else None
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(dies_on_interrupt())
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = stack.enter_context(open(log_path, "w"))
            stack.enter_context(contextlib.redirect_stdout(_Tee(log_file, sys.__stdout__)))
            stack.enter_context(contextlib.redirect_stderr(_Tee(log_file, sys.__stderr__)))
        configure_logging()
        slots, per_gpu = job_slots(smk)
        leased = stack.enter_context(gpu_slot_lease(slots, per_gpu))
        log.info("rule %s: %d of %d GPU slot(s) per GPU leased on %s", smk.rule, slots, per_gpu, leased)
        if leased:
            log.info("rule %s: GPU(s) %s", smk.rule, ", ".join(gpu_names(leased)))
        try:
            yield
        except Exception:
            traceback.print_exc()
            raise


if __name__ == "__main__":  # each process of a launched job: python -m kpipe.infra.jobs SETTINGS_FILE
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kpipe.infra.jobs SETTINGS_FILE (written by kpipe.infra.jobs.run_job)")
    from kpipe.infra import jobs  # the module the jobs register with (this one runs as __main__)

    jobs.run_job_file(sys.argv[1])
