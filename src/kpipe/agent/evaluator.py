"""What the loop needs of KernelGym, and the simplest way to get it.

The loop talks to any object with `evaluate_many(jobs) -> results` (jobs are
(reference_src, candidate_src) pairs, results carry the `evals` columns: status, correct,
hacked, speedup_eager, speedup_compile, pr, feedback, key, ...). `LocalEvaluator` calls
`kpipe.gym.evaluate` one job at a time; the GPU pool and the HTTP service implement the
same method. `EvaluationStream` feeds any of them jobs one at a time from a background thread,
so evaluation overlaps generation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from kpipe.gym.judge.result import reference_error
from kpipe.infra.provenance import judge_version


class Evaluator(Protocol):
    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[Any]: ...


def result_field(result: Any, name: str, default: Any = None) -> Any:
    """A field of an evaluation result, whether it is a dataclass/object or a mapping."""
    if isinstance(result, Mapping):
        return result.get(name, default)
    return getattr(result, name, default)


class LocalEvaluator:
    """Sequential evaluation via `kpipe.gym.evaluate` (the pool of workers replaces it at scale).

    A query whose reference itself is malformed or fails to run becomes a `reference_error`
    result instead of ending the whole batch: scraped training queries are sometimes broken.
    `reuse_reference` reuses one reference run across candidates (cheaper on a CPU; the
    baseline is then not timed next to each candidate).
    """

    def __init__(self, protocol: Any = None, progress: bool = True, reuse_reference: bool = False) -> None:
        from kpipe.gym import ReferenceFailure, evaluate

        self._evaluate = evaluate
        self._reference_failure = ReferenceFailure
        self.protocol = protocol
        self.progress = progress
        self.reuse_reference = reuse_reference

    def evaluate_one(self, reference: str, candidate: str) -> Any:
        try:
            return self._evaluate(reference, candidate, self.protocol, reuse_reference=self.reuse_reference)
        except (self._reference_failure, ValueError) as error:
            return reference_error(str(error))

    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[Any]:
        return [
            self.evaluate_one(reference, candidate)
            for reference, candidate in tqdm(jobs, desc="evaluate", disable=not self.progress, leave=False)
        ]


class EvaluationStream:
    """Evaluates jobs as they are `put`, on a background thread, while the caller keeps working (the
    engine decodes the turn's other answers). Whatever has arrived since the last call goes into one
    `evaluate_many` call, one call at a time (the wrapped evaluator need not be thread-safe), and each
    result is filed under its job's index: the results depend on the jobs, not on their arrival order.
    `busy_s` is the wall time spent inside `evaluate_many`.

    A call waits for a burst of answers to end (no new job for `gather_idle_s`, at most
    `gather_max_s` after its first job): the offline teacher hands a turn's 16 answers over within
    70 ms, and sent at once the first went alone to a cold KernelGym service: the other nine waited
    the 15.6 s it took there instead of running beside it on the service's other worker (a
    distillation shard of the default DAG on an H200, 2026-11-28: its first turn took 55 s)."""

    def __init__(self, evaluator: Evaluator, gather_idle_s: float = 0.1, gather_max_s: float = 1.0) -> None:
        self.evaluator = evaluator
        self.gather_idle_s = gather_idle_s
        self.gather_max_s = gather_max_s
        self.busy_s = 0.0
        self._queue: list[tuple[int, tuple[str, str]]] = []
        self._results: dict[int, Any] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="evaluation-stream", daemon=True)
        self._thread.start()

    def put(self, index: int, job: tuple[str, str]) -> None:
        with self._wake:
            self._queue.append((index, job))
            self._wake.notify()

    def results(self) -> dict[int, Any]:
        """Every result by index, once all jobs put so far are evaluated (re-raises an evaluator error)."""
        self.close()
        if self._error is not None:
            raise self._error
        return self._results

    def close(self) -> None:
        """Finish the jobs put so far and stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def __enter__(self) -> EvaluationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                self._gather()
                batch, self._queue = self._queue, []
            if not batch:
                return
            if self._error is not None:
                continue  # drain: the error is raised by `results`
            started = time.perf_counter()
            try:
                evaluated = self.evaluator.evaluate_many([job for _, job in batch])
                self._results.update(zip((index for index, _ in batch), evaluated, strict=True))
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                self._error = error
            finally:
                self.busy_s += time.perf_counter() - started


    def _gather(self) -> None:
        """With the lock held and a job queued: wait while more keep coming (see the class)."""
        deadline = time.monotonic() + self.gather_max_s
        while not self._closed:
            queued, left = len(self._queue), deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(min(self.gather_idle_s, left))
            if len(self._queue) == queued:
                return


def result_record(result: Any) -> dict[str, Any]:
    """A JSON-able copy of an evaluation result."""
    if isinstance(result, Mapping):
        return dict(result)
    if dataclasses.is_dataclass(result):
        return dataclasses.asdict(result)
    return dict(vars(result))


class CachedEvaluator:
    """An evaluator whose results are persisted per (namespace, reference, candidate).

    Resuming a multi-turn job needs it: the next turn's prompt embeds the feedback, and
    feedback carries measured times that differ between two evaluations of the same code.
    Replaying the first evaluation makes the resumed prompts identical to the original
    ones, so their answers come from the response cache instead of being paid for again.
    `namespace` (the protocol as JSON) keeps results of different protocols apart, and the judge's
    version (``kpipe.infra.provenance.judge_version``) those of another KernelGym code, torch or Triton:
    a rerun after such a change evaluates again.
    """

    def __init__(self, evaluator: Evaluator, path: str | os.PathLike, namespace: str = "") -> None:
        self.evaluator = evaluator
        self.namespace = namespace
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._results: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn write of a killed run
                self._results[record["key"]] = record["result"]

    def job_key(self, reference: str, candidate: str) -> str:
        return hashlib.sha256("\0".join((self.namespace, judge_version(), reference, candidate)).encode()).hexdigest()

    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[Any]:
        keys = [self.job_key(*job) for job in jobs]
        first_of: dict[str, int] = {}
        for index, key in enumerate(keys):
            if key not in self._results:
                first_of.setdefault(key, index)  # identical jobs in one batch are evaluated once
        unique = list(first_of)
        fresh = self.evaluator.evaluate_many([jobs[first_of[key]] for key in unique]) if unique else []
        with self.path.open("a") as handle:
            for key, result in zip(unique, fresh, strict=True):
                self._results[key] = result_record(result)
                handle.write(json.dumps({"key": key, "result": self._results[key]}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return [self._results[key] for key in keys]


def reference_reuse(setting: bool | None) -> bool:
    """Whether a job keeps each task's reference run in its KernelGym worker and judges later
    candidates of the task against it (`setting`; null: yes): its outputs serve them all, its stock
    of timing windows one window (and secret seed) per candidate, the run repeated once they are
    spent (kgym-14, ``kpipe.gym.judge.evaluation.run_reference``). Why yes: a batch runs faster (the pool
    sends a task's candidates to the worker that has run its reference, ``kpipe.gym.serve.pool.JobQueue``).
    Distillation and RL share this rule, so they share the run's one KernelGym service too."""
    return True if setting is None else bool(setting)


@contextlib.contextmanager
def open_evaluator(gym: Mapping[str, Any], *, reuse_reference: bool = False, progress: bool = True,
                   gpus: Sequence[str] | None = None) -> Iterator[Evaluator]:
    """The evaluator the `gym` config section names, closed (workers stopped) on exit.

    backend: pool (default; warm workers, one per GPU or N interpreter workers on a CPU; in a
    job of a Snakemake run with `gym.service: auto`, the run's one service of these settings,
    `kpipe.gym.serve.run_service`, instead of a pool of the job's own),
    local (a fresh interpreter per evaluation; slow, no shared state), service (a running
    `kpipe gym serve` at `url`, token from $KPIPE_GYM_TOKEN), or ray (`RayGym`: `actors`
    Ray actors, one per GPU by default, on the cluster at `ray_address`, or on a local Ray
    instance started for this block when null). `priority` (default 0): a shared service evaluates
    the queued jobs of a higher priority first (the Snakemake run's critical path sets it; a pool of
    the job's own has no one else to go before). `cache` names the SQLite result cache shared by
    every stage and rerun (null: no cache). `gpus` limits the pool to those GPU ids (one RL
    process per GPU evaluates on its own); the other backends place work themselves.
    """
    from kpipe.gym import Protocol
    from kpipe.gym.serve.run_service import workflow_run

    protocol = Protocol.from_dict(dict(gym.get("protocol", {})))
    backend = gym.get("backend", "pool")
    if backend == "local":
        yield LocalEvaluator(protocol, progress=progress, reuse_reference=reuse_reference)
    elif backend == "service":
        from kpipe.gym.serve.client import GymClient

        if not gym.get("url"):
            raise ValueError("gym.backend is 'service' but gym.url is not set")
        yield GymClient(gym["url"], priority=int(gym.get("priority", 0)))
    elif backend == "pool" and (run := workflow_run()) is not None:
        from kpipe.gym.serve.run_service import open_run_service, service_settings
        from kpipe.gym.confine.sandbox import opted_out

        settings = service_settings(protocol, reuse_reference, gym.get("cache"), gym.get("workers"), opted_out(),
                                    gym.get("workers_per_gpu"))
        with open_run_service(run, settings, progress=progress, priority=int(gym.get("priority", 0))) as client:
            yield client
    elif backend in ("pool", "ray"):
        from kpipe.gym.serve.cache import ResultCache

        cache = ResultCache(gym["cache"]) if gym.get("cache") else None
        if backend == "pool":
            from kpipe.gym.serve.pool import GymPool

            with GymPool(protocol, workers=gym.get("workers"), per_gpu=gym.get("workers_per_gpu"), cache=cache,
                         reuse_reference=reuse_reference, progress=progress, gpus=gpus) as pool:
                yield pool
        else:
            from kpipe.gym.serve.distributed import RayGym

            with RayGym(protocol, actors=gym.get("actors"), address=gym.get("ray_address"),
                        accelerator_type=gym.get("accelerator_type"), cache=cache, reuse_reference=reuse_reference,
                        progress=progress) as ray_gym:
                yield ray_gym
    else:
        raise ValueError(f"gym.backend must be pool, local, service or ray, got {backend!r}")
