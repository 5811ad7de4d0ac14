"""KernelGym across nodes, on Ray: one actor per GPU behind one ``evaluate_many``.

Each actor owns a one-worker ``GymPool`` pinned to the GPU Ray gave it, so an evaluation on a
cluster runs exactly as it does on one box: the core's ``evaluate()`` judging, warm forked
children running the candidate, the pool's own retry when a candidate kills its worker.
Ray adds what one box cannot: placement across nodes, and the actors' lifetime. An actor
that dies (its node lost, its process killed, the OOM killer) is restarted by Ray and the
job it held is submitted once more, to whichever actor is free first; a second loss is
answered with a ``crashed`` result that says why. Nothing is silently lost, and identical
jobs are evaluated once: within a batch and through the driver's result cache.

Scheduling is pull-based: an actor holds at most one job, so a slow evaluation never queues
others behind it while another GPU idles. Results come back in job order, as from
``GymPool.evaluate_many``: ``EvalResult`` objects, or the ``reference_error`` mapping for a
reference that itself fails.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kpipe.gym.serve.pool import MAX_ATTEMPTS, GymPool, is_pass, lost_result
from kpipe.gym.serve.worker import Job
from kpipe.gym.protocol import Protocol
from kpipe.gym.judge.result import EvalResult

if TYPE_CHECKING:
    from kpipe.gym.serve.cache import ResultCache

RAY_MISSING = "Ray is not installed: pip install 'kpipe[distributed]' (ray[default])"
WAIT_POLL_S = 1.0  # how often the progress bar refreshes while every actor is busy
PROBE_INTERVAL_S = 1.0  # how often a lost actor is asked whether it is back
# Ray restarts a lost actor wherever a GPU is free; with none free for this long, the jobs
# still waiting are answered `crashed` rather than waiting forever
ACTOR_RECOVERY_TIMEOUT_S = 600.0
ACTOR_START_TIMEOUT_S = 600.0  # actors Ray cannot place (more than the cluster's GPUs) would wait forever


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(RAY_MISSING) from None
    return ray


class GymActor:
    """The body of one Ray actor: one GPU (or one CPU slot), one pool worker.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's GPU before this runs, so the pool's
    default slot is exactly that GPU; without a GPU the slot runs Triton's interpreter.
    """

    def __init__(self, protocol_json: str, reuse_reference: bool, fork: bool) -> None:
        self.pool = GymPool(Protocol.from_json(protocol_json), workers=1, reuse_reference=reuse_reference,
                            fork=fork, progress=False)

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "device_kind": self.pool.device_kind,
                **{k: v for k, v in self.pool.workers()[0].items() if k in ("gpu", "done", "restarts")}}

    def evaluate(self, reference: str, candidate: str) -> Any:
        return self.pool.evaluate(reference, candidate)

    def close(self) -> None:
        self.pool.close()


def default_actor_count(cluster: dict[str, float], use_gpus: bool, cpus_per_actor: float) -> int:
    """One actor per GPU of the cluster; on a CPU-only cluster, one per `cpus_per_actor` CPUs
    of half the cluster (each evaluation's child also uses threads)."""
    if use_gpus:
        return int(cluster.get("GPU", 0))
    return max(1, int(cluster.get("CPU", 1) // 2 // max(cpus_per_actor, 1)))


def was_evaluated(result: Any) -> bool:
    """A real evaluation's result (cacheable), not a reference error nor the pool's answer for
    a job that lost its worker twice: only the core's ``evaluate()`` records torch's version."""
    return isinstance(result, EvalResult) and bool(result.torch_version)


class RayGym:
    """Evaluates (reference, candidate) pairs under one protocol on Ray actors, one per GPU.

    `address`: ``None`` joins the Ray instance this process already started or starts a local
    one; ``"auto"`` joins the cluster started with ``ray start`` (see docs/scaling.md). A Ray
    connection this object opened is closed by ``close()`` (a local instance it started stops).
    `accelerator_type` (e.g. ``"H100"``) keeps every actor on one GPU kind: timings of
    different kinds are not comparable, so mixed kinds are refused.
    """

    def __init__(
        self,
        protocol: Protocol | None = None,
        actors: int | None = None,
        *,
        address: str | None = None,
        cpus_per_actor: float = 1.0,
        accelerator_type: str | None = None,
        cache: ResultCache | None = None,
        reuse_reference: bool = False,
        fork: bool = True,
        progress: bool = True,
    ) -> None:
        ray = import_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self.protocol = protocol or Protocol()
        self.cache = cache
        self.progress = progress
        cluster = ray.cluster_resources()
        use_gpus = self.protocol.device != "cpu" and cluster.get("GPU", 0) >= 1
        count = default_actor_count(cluster, use_gpus, cpus_per_actor) if actors is None else actors
        if count < 1:
            raise ValueError(f"actors must be >= 1, got {count}")
        options: dict[str, Any] = {"num_cpus": cpus_per_actor, "num_gpus": 1 if use_gpus else 0,
                                   "max_restarts": -1, "max_task_retries": 0}
        if accelerator_type:
            options["accelerator_type"] = accelerator_type
        actor_class = ray.remote(GymActor).options(**options)
        self._actors = [actor_class.remote(self.protocol.to_json(), reuse_reference, fork) for _ in range(count)]
        try:
            infos = ray.get([actor.info.remote() for actor in self._actors], timeout=ACTOR_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise RuntimeError(f"{count} evaluation actor(s) did not start within {ACTOR_START_TIMEOUT_S:g} s: "
                               f"the cluster has {cluster.get('GPU', 0):g} GPU(s), {cluster.get('CPU', 0):g} CPU(s)") from None
        kinds = {info["device_kind"] for info in infos}
        if len(kinds) != 1:
            self.close()
            raise RuntimeError(f"the actors' GPUs differ ({', '.join(sorted(kinds))}): set accelerator_type")
        self.device_kind: str = kinds.pop()
        self._next_id = 0
        self._recovering: dict[int, float] = {}  # slot of a lost actor -> when to probe it

    def key(self, reference: str, candidate: str) -> str:
        from kpipe.gym.judge.result import eval_key

        return eval_key(reference, candidate, self.protocol, self.device_kind)

    def workers(self) -> list[dict[str, Any]]:
        """Each actor's slot, pid, node, GPU, evaluations done and in-actor worker restarts;
        an actor that Ray is restarting shows ``alive: False`` and why."""
        ray = import_ray()
        refs = [actor.info.remote() for actor in self._actors]
        states = []
        for slot, ref in enumerate(refs):
            try:
                states.append({"slot": slot, "alive": True, **ray.get(ref)})
            except ray.exceptions.RayError as exc:
                states.append({"slot": slot, "alive": False, "error": f"{type(exc).__name__}: {exc}"})
        return states

    def evaluate(self, reference: str, candidate: str) -> Any:
        return self.evaluate_many([(reference, candidate)])[0]

    def evaluate_many(self, jobs: Iterable[tuple[str, str]]) -> list[Any]:
        """Evaluate every (reference_src, candidate_src) pair; results in the same order."""
        pairs = list(jobs)
        if not all(isinstance(r, str) and isinstance(c, str) for r, c in pairs):
            raise TypeError("reference and candidate must be program source text")
        keys = [self.key(reference, candidate) for reference, candidate in pairs]
        results: dict[str, Any] = {}
        todo: collections.deque[Job] = collections.deque()
        queued: set[str] = set()
        for key, (reference, candidate) in zip(keys, pairs):
            if key in results or key in queued:
                continue
            cached = self.cache.get(key) if self.cache is not None else None
            if cached is not None:
                results[key] = cached
                continue
            self._next_id += 1
            queued.add(key)
            todo.append(Job(self._next_id, reference, candidate, key, Future()))
        with tqdm(total=len(todo), desc="evaluate (ray)", unit="eval", disable=not self.progress, leave=False) as bar:
            self._run(todo, results, bar)
        return [results[key] for key in keys]

    def _run(self, todo: collections.deque[Job], results: dict[str, Any], bar: tqdm) -> None:
        """Keep every healthy actor busy with one job until all are answered.

        A lost actor is not offered work again until it answers a probe: Ray refuses calls
        to an actor that is restarting, and such a refusal must not cost a job an attempt.
        """
        ray = import_ray()
        free = collections.deque(slot for slot in range(len(self._actors)) if slot not in self._recovering)
        in_flight: dict[Any, tuple[Job | None, int]] = {}  # a probe carries no job
        failures = 0
        last_capacity = time.monotonic()

        def answer(job: Job, result: Any) -> None:
            nonlocal failures
            results[job.key] = result
            failures += not is_pass(result)
            bar.update(1)
            bar.set_postfix(failures=failures, refresh=False)

        while todo or any(job is not None for job, _ in in_flight.values()):
            now = time.monotonic()
            for slot, probe_at in list(self._recovering.items()):
                if probe_at <= now:
                    del self._recovering[slot]
                    in_flight[self._actors[slot].info.remote()] = (None, slot)
            while todo and free:
                job, slot = todo.popleft(), free.popleft()
                job.attempts += 1
                in_flight[self._actors[slot].evaluate.remote(job.reference, job.candidate)] = (job, slot)
            if free or any(job is not None for job, _ in in_flight.values()):
                last_capacity = now
            elif now - last_capacity > ACTOR_RECOVERY_TIMEOUT_S:
                for job in todo:
                    job.losses.append(f"no evaluation actor was available for {ACTOR_RECOVERY_TIMEOUT_S:g} s")
                    answer(job, lost_result(job, self.protocol, self.device_kind))
                todo.clear()
                break
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=WAIT_POLL_S)
            for ref in done:
                job, slot = in_flight.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    self._recovering[slot] = time.monotonic() + PROBE_INTERVAL_S
                    if job is None:
                        continue
                    job.losses.append(f"actor {slot} lost: {type(exc).__name__}: {exc}")
                    if job.attempts < MAX_ATTEMPTS:
                        todo.appendleft(job)
                        continue
                    result = lost_result(job, self.protocol, self.device_kind)
                else:
                    free.append(slot)
                    if job is None:
                        continue
                    if self.cache is not None and was_evaluated(result):
                        self.cache.put(result)
                answer(job, result)
        for _, slot in in_flight.values():  # probes still out: ask again on the next batch
            self._recovering[slot] = time.monotonic()

    def close(self) -> None:
        """Stop the actors' pools, then the actors; then Ray, if this object started it
        (a Ray instance the caller had started stays up)."""
        ray = import_ray()
        try:
            ray.get([actor.close.remote() for actor in self._actors], timeout=60)
        except ray.exceptions.RayError:
            pass  # an actor that is already gone has nothing left to close
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RayGym:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
