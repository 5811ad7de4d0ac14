"""KernelGym at scale: a pool of evaluation workers, two per GPU by default, with warm forked children.

Three kinds of process, so that no process both runs candidate code and judges it, and no
process that forks has touched CUDA or started a thread pool:

- the **pool** (the caller: agent loop, batch CLI, HTTP service) queues jobs, answers
  duplicates from the result cache, and supervises one thread per worker;
- ``per_gpu`` **workers** per GPU (default 2; ``kpipe.gym.serve.worker``: ``CUDA_VISIBLE_DEVICES``
  pinned, a fresh interpreter, so a caller that holds a CUDA context is harmless) runs the core's
  ``evaluate()``: the judgement. Children on one GPU take turns to time under its timing lease
  (``kpipe.gym.confine.lease``), every other child there stopped meanwhile, so several workers per GPU
  overlap only their untimed work;
- the worker's **zygote** (``kpipe.gym.confine.zygote``) imports torch, triton and ``kpipe.gym.candidate.child`` once, never computes,
  and forks one child per reference/candidate run. The child calls the core's ``run_child``
  unchanged in its own session, so a timeout kills its whole process group, exactly as the
  fresh-interpreter path (``kpipe.gym.confine.isolate``) does — minus the seconds of start-up. The child
  of a worker's next candidate is forked while the current one runs, and waits confined with its
  CUDA context made (``ZygoteLauncher``).

A worker that dies (or a judge that raises) is replaced and its job re-queued once; a second
loss is answered with a ``crashed`` result that says why. Nothing is silently lost.

GPU memory is scheduled too: a reference or a candidate that runs out of memory beside the other
evaluations of its GPU (on an 80 GB H100 at KernelBench's main sizes, one worker's reference did
while another held 42.6 GiB, and the whole batch was lost) is retried once alone there, the GPU's
other workers taking no job until it is done (``JobQueue``); only the second answer counts.

The pool answers as soon as its first worker is ready; the others join as they come up, so a
caller waits for one interpreter's start-up, not for the slowest of them.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kpipe.gym.judge.feedback import failure_feedback
from kpipe.gym.confine.lease import LEASE_MAX_WAIT_TIMEOUTS
from kpipe.gym.protocol import Protocol
from kpipe.gym.candidate.faults import is_out_of_memory
from kpipe.gym.judge.result import REFERENCE_ERROR, EvalResult, reference_error
from kpipe.gym.serve.worker import Job, WorkerHandle

if TYPE_CHECKING:
    from kpipe.gym.serve.cache import ResultCache

MAX_ATTEMPTS = 2  # a job whose worker died is re-queued once
# evaluations in flight per GPU by default: their children's untimed work (start, compile,
# correctness trials) overlaps, their timed regions take turns under the GPU's lease
# (kpipe.gym.confine.lease). On H200s, one pass of 80 evaluations with references reused: 28.7-34.9
# evaluations/min with two against 16.1-19.7 with one, every verdict the same, median speedups of
# candidates of 1 ms or more within 1.2 % of one worker's and within 1.012x over 8 runs
# (`965801b:docs/gpu-results/gym_scaling_2026-11-26b_H200.md`). A launch-bound candidate (0.15 ms, timed by
# how fast the host launches) spreads more with a neighbour: L2_14 1.3-1.6x against 1.0-1.3x alone,
# its median 3-8 % lower on a 16-core host
DEFAULT_WORKERS_PER_GPU = 2
# a judge that does not answer within this much beyond the two child timeouts is hung
WORKER_SLACK_S = 120.0
# OMP threads of a worker and its children by default: the host's cores shared out between the
# workers, but no more than this. On a 64-core 4x H200 host, one GPU with two workers did 29.4
# evaluations/min with 32 threads each (every core), 37.4 with 16 and 36.4 with 8, in one pass of
# 120 (correctness trials 1.79 -> 1.49 s, waits at the gate 0.48 -> 0.23 s, pool start 10.9 -> 7.5 s;
# `965801b:docs/gpu-results/gym_scaling_2026-11-27c_4xH200.md`): a child's CPU work (digests, comparisons) is
# small, and more threads cost more to wake than they save
MAX_CPU_THREADS = 16


@dataclass
class WorkerState:
    """What ``workers`` reports (the HTTP service's /workers endpoint)."""

    slot: int
    gpu: str | None
    pid: int | None = None
    device_kind: str = ""
    busy_with: str | None = None  # key of the job being evaluated
    busy_reference: str | None = None  # its reference source
    busy_alone: bool = False  # the job runs alone on its GPU (a reference that ran out of memory)
    references: set[str] = field(default_factory=set)  # references its judge has run and reuses
    done: int = 0
    restarts: int = 0
    last_loss: str = ""
    alive: bool = False
    start_s: float | None = None  # its last start: launch to ready, as the pool waited for it
    start_phases: dict[str, float] = field(default_factory=dict)  # where that went, as the worker saw it


def default_slots(workers: int | None, gpus: Sequence[str] | None = None, per_gpu: int | None = None) -> list[str | None]:
    """`per_gpu` slots (default ``DEFAULT_WORKERS_PER_GPU``) for each of the first `workers` GPUs of
    `gpus` (default: every visible GPU); without GPUs, `workers` interpreter slots (default: half
    the cores, at least one — each interpreter child also uses threads)."""
    from kpipe.infra.gpu import visible_gpus

    gpus = list(gpus) if gpus is not None else visible_gpus()
    if gpus:
        used = gpus[:workers] if workers else gpus
        return [gpu for gpu in used for _ in range(per_gpu or DEFAULT_WORKERS_PER_GPU)]
    return [None] * (workers or max(1, (os.cpu_count() or 2) // 2))


def default_cpu_threads(workers: int, cores: int | None = None) -> int:
    """Each of `workers` workers' share of the host's `cores` (default: all), capped at ``MAX_CPU_THREADS``."""
    return max(1, min(MAX_CPU_THREADS, (cores or os.cpu_count() or 1) // workers))


class GymPool:
    """Evaluates (reference, candidate) pairs under one fixed protocol on a pool of workers.

    ``evaluate_many(jobs)`` is the interface of ``kpipe.agent``'s evaluators; ``submit`` gives
    a future per job (the HTTP service uses it). Results come back in job order: EvalResult
    objects, or for a reference that itself fails, a ``reference_error`` mapping (as
    ``LocalEvaluator`` returns). Identical jobs are evaluated once (in flight and via `cache`).

    `reuse_reference` (default on): each worker runs a task's reference once (outputs, eager /
    ``torch.compile`` timings) and judges later candidates of that task against it for up to
    ``evaluation.REFERENCE_MAX_AGE_S``. The run is kept in the judging worker's memory, which no
    candidate runs in (candidates are forked from the zygote, which never holds one), and the
    worker holds the reference's outputs during every candidate run either way. It halves an
    evaluation's cost and gives all candidates of a task one baseline; off, the baseline is
    re-timed next to each candidate.

    `cpu_threads`: each worker's (and its children's) ``OMP_NUM_THREADS``; by default the host's
    cores shared out between the workers, so that their CPU work does not oversubscribe it, and at
    most ``MAX_CPU_THREADS``.
    """

    def __init__(
        self,
        protocol: Protocol | None = None,
        workers: int | None = None,
        cache: ResultCache | None = None,
        reuse_reference: bool = True,
        fork: bool = True,
        progress: bool = True,
        gpus: Sequence[str] | None = None,
        per_gpu: int | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        self.protocol = protocol or Protocol()
        self.cache = cache
        self.progress = progress
        self.reuse_reference = reuse_reference
        self.fork = fork
        slots = default_slots(workers, gpus, per_gpu)
        self.cpu_threads = cpu_threads or default_cpu_threads(len(slots))
        self._queue = JobQueue(affinity=reuse_reference)
        self._lock = threading.Lock()
        self._started = threading.Condition(self._lock)
        self._in_flight: dict[str, Future[Any]] = {}
        self._next_id = 0
        self._closed = False
        self._start_errors: list[BaseException] = []
        self.device_kind: str = ""
        self.states = [WorkerState(slot=i, gpu=gpu) for i, gpu in enumerate(slots)]
        self._threads = [threading.Thread(target=self._run_slot, args=(state,), daemon=True, name=f"kgym-slot-{state.slot}")
                         for state in self.states]
        for thread in self._threads:
            thread.start()
        with self._started:
            self._started.wait_for(lambda: self.device_kind or len(self._start_errors) == len(self.states))
        if not self.device_kind:
            self.close()
            raise self._start_errors[0]

    def _run_slot(self, state: WorkerState) -> None:
        """Start this slot's worker, then serve the queue; a worker that cannot start, or whose
        GPU is of another kind than the pool's, leaves its slot empty (the others serve)."""
        try:
            handle = self._start_worker(state)
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it if no worker starts
            state.last_loss = last_line(str(exc))
            with self._started:
                self._start_errors.append(exc)
                self._started.notify_all()
            return
        with self._started:
            kind = handle.info["device_kind"]
            if self.device_kind and kind != self.device_kind:
                state.last_loss = f"its GPU is a {kind}, the pool's a {self.device_kind}: run one pool per GPU kind"
                self._start_errors.append(RuntimeError(state.last_loss))
            self.device_kind = self.device_kind or kind
            self._started.notify_all()
        if state.last_loss:
            handle.stop()
            state.alive = False
            return
        self._serve_slot(state, handle)

    def _start_worker(self, state: WorkerState) -> WorkerHandle:
        handle = WorkerHandle(state.gpu, self.protocol, self.reuse_reference, self.fork, self.cpu_threads)
        state.pid = handle.info["pid"]
        state.device_kind = handle.info["device_kind"]
        state.start_s, state.start_phases = handle.start_s, handle.info.get("start_phases", {})
        state.alive = True
        return handle

    # ------------------------------------------------------------------ public API

    def key(self, reference: str, candidate: str) -> str:
        from kpipe.gym.judge.result import eval_key

        return eval_key(reference, candidate, self.protocol, self.device_kind)

    def submit(self, reference: str, candidate: str, priority: int = 0) -> Future[Any]:
        """A future of the result; answered at once from the cache or an identical job in flight.
        Queued jobs of a higher `priority` go first (``JobQueue``); an identical job still queued
        is raised to it."""
        if not isinstance(reference, str) or not isinstance(candidate, str):
            raise TypeError("reference and candidate must be program source text")
        key = self.key(reference, candidate)
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is closed")
            if key in self._in_flight:
                self._queue.promote(key, priority)
                return self._in_flight[key]
            cached = self.cache.get(key) if self.cache is not None else None
            future: Future[Any] = Future()
            if cached is not None:
                future.set_result(cached)
                return future
            self._in_flight[key] = future
            self._next_id += 1
            job = Job(self._next_id, reference, candidate, key, future, priority=priority)
        self._queue.put(job)
        return future

    def evaluate_many(self, jobs: Iterable[tuple[str, str]]) -> list[Any]:
        """Evaluate every (reference_src, candidate_src) pair; results in the same order."""
        futures = [self.submit(reference, candidate) for reference, candidate in jobs]
        bar = tqdm(total=len(futures), desc="evaluate", unit="eval", disable=not self.progress, leave=False)
        failures = 0
        pending = set(range(len(futures)))
        with bar:
            while pending:
                finished = [i for i in pending if futures[i].done()]
                for i in finished:
                    pending.discard(i)
                    failures += not is_pass(futures[i].result())
                if finished:
                    bar.update(len(finished))
                    bar.set_postfix(failures=failures, refresh=False)
                else:
                    time.sleep(0.05)
        return [future.result() for future in futures]

    def evaluate(self, reference: str, candidate: str, timeout_s: float | None = None) -> Any:
        return self.submit(reference, candidate).result(timeout=timeout_s)

    def pending(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's state; of its references, how many (JSON for the service's /workers)."""
        return [{**{k: v for k, v in vars(state).items() if k not in ("references", "busy_reference")},
                 "references": len(state.references)} for state in self.states]

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._queue.stop(len(self._threads))
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> GymPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ supervision

    def _reply_timeout(self) -> float:
        """Both children's timeouts, each extended by its longest wait for the timing lease."""
        return 2 * (1 + LEASE_MAX_WAIT_TIMEOUTS) * self.protocol.timeout_s + WORKER_SLACK_S

    def _serve_slot(self, state: WorkerState, handle: WorkerHandle | None) -> None:
        """Evaluate queued jobs on this slot's worker until the pool closes."""
        while True:
            job = self._queue.get(state, self.states)
            if job is None:
                break
            if handle is None:
                handle = self._restart(state)
                if handle is None:
                    self._lose(job, state, f"could not restart the worker: {state.last_loss}")
                    continue
            job.attempts += 1
            kind, payload = handle.evaluate(job, self._reply_timeout())
            self._queue.done(state)
            if self._ran_out_beside_others(job, state, kind, payload):
                self._retry_alone(job, state)
                continue
            if kind in ("lost", "worker_error"):
                if kind == "lost":  # replace it now, so /workers never shows a dead one idle
                    state.alive = False
                    handle = self._restart(state)
                self._lose(job, state, payload)
                continue
            state.done += 1
            if self.reuse_reference:
                state.references.add(job.reference)
            if kind == "ok":
                result: Any = EvalResult.from_row(payload)
                if self.cache is not None:
                    self.cache.put(result)
            else:
                result = reference_error(payload)
            self._finish(job, result)
        if handle is not None:
            handle.stop()
        state.alive = False

    def _restart(self, state: WorkerState) -> WorkerHandle | None:
        try:
            handle = self._start_worker(state)
        except Exception as exc:  # noqa: BLE001 - the next job is failed with this reason
            state.last_loss = f"restart failed: {exc}"
            return None
        state.restarts += 1
        state.references.clear()  # the new judge has run none
        return handle

    def _ran_out_beside_others(self, job: Job, state: WorkerState, kind: str, payload: Any) -> bool:
        """Whether the job's reference, or its candidate, ran out of memory on a GPU that other
        workers share, and has not yet run there alone."""
        out = (kind == REFERENCE_ERROR and is_out_of_memory(str(payload))) or (kind == "ok" and payload.get("status") == "oom")
        return out and not job.alone and any(other is not state and other.gpu == state.gpu for other in self.states)

    def _retry_alone(self, job: Job, state: WorkerState) -> None:
        """Queue again a job whose reference ran out of memory, to run alone on this GPU."""
        job.attempts -= 1  # not a loss of the worker
        job.alone, job.alone_on = True, state.gpu
        self._queue.put(job)

    def _lose(self, job: Job, state: WorkerState, why: str) -> None:
        """Re-queue a job whose worker was lost once; the second loss is its result."""
        state.last_loss = last_line(why)
        job.losses.append(why)
        if job.attempts < MAX_ATTEMPTS:
            self._queue.put(job)
            return
        self._finish(job, lost_result(job, self.protocol, self.device_kind))

    def _finish(self, job: Job, result: Any) -> None:
        with self._lock:
            self._in_flight.pop(job.key, None)
        job.future.set_result(result)


class JobQueue:
    """The pool's queue. A free worker takes only among the jobs of the highest priority waiting
    (a Snakemake run's service serves its critical path, distillation and the RL iterations,
    before the evaluations that only its report waits for). Among those, without `affinity`,
    first in first out. With it (the pool reuses references), a worker takes first the oldest
    job whose reference its judge has already run (and reuses), then one whose reference no
    worker has run or is running, then the oldest of the task with the most jobs waiting (its
    reference run, paid again, is shared by the most): so each task's reference is run about once per pool rather than once per worker that happens to
    draw one of its candidates (a one-pass batch of 80 candidates of 10 tasks on 4 workers would
    otherwise run up to 40), and a worker never idles while jobs wait. The choice is made when the
    worker is free, so it always sees what every other worker holds and runs."""

    def __init__(self, affinity: bool) -> None:
        self.affinity = affinity
        self._jobs: list[Job] = []
        self._stops = 0
        self._changed = threading.Condition()

    def put(self, job: Job) -> None:
        with self._changed:
            self._jobs.append(job)
            self._changed.notify_all()  # which worker may take it depends on what each GPU runs

    def promote(self, key: str, priority: int) -> None:
        """Raise the queued job of `key` (if any) to `priority`: an identical job asked for again
        at a higher priority must not wait at the lower one."""
        with self._changed:
            for job in self._jobs:
                if job.key == key:
                    job.priority = max(job.priority, priority)

    def stop(self, workers: int) -> None:
        """Each of `workers` gets None once the jobs queued before are taken."""
        with self._changed:
            self._stops += workers
            self._changed.notify_all()

    def get(self, state: WorkerState, states: Sequence[WorkerState]) -> Job | None:
        """The next job for the worker of `state` (``states``: every worker, this one included),
        marked busy on it; None when the pool stops. A job to run alone on a GPU (``Job.alone_on``)
        waits until no other worker there is busy, and while it waits or runs they take nothing."""
        with self._changed:
            self._changed.wait_for(lambda: (self._stops and not self._jobs) or self._takeable(state, states))
            if not self._jobs:
                self._stops -= 1
                return None
            job = self._jobs.pop(self._pick(state, states))
            state.busy_with, state.busy_reference, state.busy_alone = job.key, job.reference, job.alone
            return job

    def done(self, state: WorkerState) -> None:
        """The worker of `state` finished its job: a job waiting to run alone may go now."""
        with self._changed:
            state.busy_with = state.busy_reference = None
            state.busy_alone = False
            self._changed.notify_all()

    def _takeable(self, state: WorkerState, states: Sequence[WorkerState]) -> list[int]:
        """The indices of the queued jobs the worker of `state` may take now."""
        others = [other for other in states if other is not state and other.gpu == state.gpu]
        if any(other.busy_alone for other in others):
            return []  # a job runs alone on this GPU
        serving = {other.gpu for other in states if other.alive}
        alone_here = [i for i, job in enumerate(self._jobs) if job.alone and (job.alone_on == state.gpu or job.alone_on not in serving)]
        if alone_here:  # held off until it has run: taken once no other worker here is busy
            return alone_here if not any(other.busy_with is not None for other in others) else []
        return [i for i, job in enumerate(self._jobs) if not job.alone or job.alone_on not in serving]

    def _pick(self, state: WorkerState, states: Sequence[WorkerState]) -> int:
        takeable = self._takeable(state, states)
        top = max(self._jobs[i].priority for i in takeable)
        eligible = [i for i in takeable if self._jobs[i].priority == top]
        if not self.affinity:
            return eligible[0]
        for i in eligible:
            if self._jobs[i].reference in state.references:
                return i
        claimed = {reference for other in states for reference in other.references}
        claimed |= {other.busy_reference for other in states if other.busy_reference is not None}
        unclaimed = next((i for i in eligible if self._jobs[i].reference not in claimed), None)
        if unclaimed is not None:
            return unclaimed
        # help with the task that has the most candidates waiting: its reference run, paid again
        # here, is shared by the most of them
        waiting = Counter(self._jobs[i].reference for i in eligible)
        busiest = max(waiting, key=lambda reference: waiting[reference])
        return next(i for i in eligible if self._jobs[i].reference == busiest)


def last_line(text: str) -> str:
    """The line that says what happened (a traceback's last)."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def is_pass(result: Any) -> bool:
    return (result.status if isinstance(result, EvalResult) else result.get("status")) == "pass"


def lost_result(job: Job, protocol: Protocol, device_kind: str) -> EvalResult:
    """A ``crashed`` result for a job that lost its worker twice; never cached (the next
    run tries again)."""
    from kpipe.data.source_text import source_hash

    diagnostic = f"the evaluation worker was lost {len(job.losses)} times on this candidate: " + " | ".join(map(last_line, job.losses))
    return EvalResult(
        key=job.key, reference_hash=source_hash(job.reference), candidate_hash=source_hash(job.candidate),
        status="crashed", diagnostic=diagnostic[:3000], feedback=failure_feedback("crashed", diagnostic),
        device=device_kind, protocol_version=protocol.version, protocol=protocol.to_json(),
    )
