"""What every Snakemake script does first: log to the rule's log file and lease its GPU slots.

Scripts under ``workflow/scripts`` stay thin: ``with snakemake_job(snakemake) as job:`` and
then one call into the library. The lease is taken before anything imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any, TextIO

from kpipe.infra.gpu import gpu_slot_lease
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


def log_line(message: str) -> str:
    """`message` as the ``kpipe`` logger writes it at INFO (``LOG_FORMAT``)."""
    return logging.Formatter(LOG_FORMAT).format(logging.LogRecord("kpipe", logging.INFO, __file__, 0, message, None, None))


def lease_message(rule: str, slots: int, per_gpu: int, leased: list[str]) -> str:
    """A job's first log line: the GPU slots it holds (a forked job's client writes it too)."""
    return f"rule {rule}: {slots} of {per_gpu} GPU slot(s) per GPU leased on {leased}"


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


@contextlib.contextmanager
def snakemake_job(smk: Any) -> Iterator[Any]:
    """Run a Snakemake script body with logging to ``log[0]``, a lease of ``resources.gpu_slots``
    (of ``config["gpu"]["slots_per_gpu"]`` per GPU), Ctrl-C ending it (``dies_on_interrupt``) and
    Rust's thread pools held to the job's ``threads`` (``threads_held_to``)."""
    mark_job_started()
    threads_held_to(smk.threads)
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
        log.info("%s", lease_message(smk.rule, slots, per_gpu, leased))
        try:
            yield smk
        except Exception:
            traceback.print_exc()
            raise

