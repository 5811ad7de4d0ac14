"""KernelGym as an HTTP service (FastAPI), so any RL framework can use it as its reward.

``kpipe gym serve`` wraps one ``GymPool`` (protocol fixed at start, reported by /v1/health).
Endpoints (OpenAPI at /openapi.json, docs at /docs):

- ``POST /v1/evaluate``: one evaluation, synchronous up to its ``deadline_s``; past the
  deadline the answer is 202 ``pending`` with the key to poll (the evaluation goes on);
- ``POST /v1/batches`` then ``GET /v1/batches/{id}``: submit many, poll progress and results;
- ``GET /v1/results/{key}``: a result by its ``eval_key`` (cached or submitted here);
- ``GET /v1/health``, ``GET /v1/workers``.

Bad input (a reference that is not a KernelBench program, oversized bodies, malformed JSON)
is a 4xx with a reason; a failing candidate is a 200 with its status. With a token every
endpoint wants ``Authorization: Bearer <token>`` (a run's service always has one: its jobs read it
from the run's record, which no candidate can reach); a request without it is refused (401) and
logged with its client's address.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kpipe.gym.serve.pool import GymPool
from kpipe.gym.judge.result import REFERENCE_ERROR, EvalResult

log = logging.getLogger(__name__)

MAX_SOURCE_CHARS = 200_000
MAX_BATCH_JOBS = 1024
MAX_REQUEST_BYTES = 16 * 1024 * 1024
MAX_DEADLINE_S = 3600.0
REMEMBERED_RESULTS = 20_000  # results kept in memory for /v1/results (beyond the cache)
REMEMBERED_BATCHES = 1_000
KEY_PATTERN = r"^[0-9a-f]{64}$"
API_VERSION = "1"


class Job(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reference_src: str = Field(min_length=1, max_length=MAX_SOURCE_CHARS, description="KernelBench-format reference (class Model, get_inputs, get_init_inputs)")
    candidate_src: str = Field(max_length=MAX_SOURCE_CHARS, description="Candidate program (class ModelNew + @triton.jit kernels)")


PRIORITY_FIELD = Field(default=0, ge=-1000, le=1000,
                       description="Queued jobs of a higher priority are evaluated first (a Snakemake run gives its critical path 10)")


class EvaluateRequest(Job):
    priority: int = PRIORITY_FIELD
    deadline_s: float = Field(default=600.0, gt=0, le=MAX_DEADLINE_S, description="Wait at most this long; then 202 pending")


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    jobs: list[Job] = Field(min_length=1, max_length=MAX_BATCH_JOBS)
    priority: int = PRIORITY_FIELD


class Outcome(BaseModel):
    """One job: ``done`` with its result, ``pending``, or ``reference_error`` (bad input found
    only when the reference ran)."""

    key: str
    state: Literal["done", "pending", "reference_error"]
    result: dict[str, Any] | None = Field(default=None, description="The evals-table row (kpipe.gym.EvalResult)")
    error: str | None = None


class BatchStatus(BaseModel):
    batch_id: str
    total: int
    done: int
    failures: int = Field(description="finished jobs whose status is not pass")
    state: Literal["running", "done"]
    outcomes: list[Outcome] | None = None


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    api_version: str
    workers: int
    workers_alive: int
    pending: int
    device_kind: str
    protocol: dict[str, Any]
    reuse_reference: bool = Field(description="each worker runs a task's reference once (kpipe.gym.serve.pool.GymPool)")


class Worker(BaseModel):
    slot: int
    gpu: str | None
    pid: int | None
    device_kind: str
    busy_with: str | None
    done: int
    restarts: int
    last_loss: str
    alive: bool
    start_s: float | None = Field(description="its last start-up, launch to ready, in seconds")
    start_phases: dict[str, float] = Field(description="where that start-up went, as the worker measured it")
    references: int = Field(description="task references its judge has run and reuses (the pool sends it their candidates first)")


class Problem(BaseModel):
    detail: Any


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await JSONResponse({"detail": f"request body over {self.limit} bytes"}, status_code=413)(scope, receive, send)
            return
        body = bytearray()
        while True:  # read the whole body first (bounded by the limit), then replay it
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # client went away: let the app see it
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await JSONResponse({"detail": f"request body over {self.limit} bytes"}, status_code=413)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class Registry:
    """Futures and finished outcomes the service has seen, bounded (oldest forgotten)."""

    def __init__(self, pool: GymPool) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        self.futures: OrderedDict[str, Future[Any]] = OrderedDict()
        self.batches: OrderedDict[str, list[tuple[str, Future[Any]]]] = OrderedDict()
        self.batch_ids = itertools.count(1)

    def submit(self, job: Job, priority: int = 0) -> tuple[str, Future[Any]]:
        check_reference_or_422(job.reference_src)
        key = self.pool.key(job.reference_src, job.candidate_src)
        future = self.pool.submit(job.reference_src, job.candidate_src, priority)
        with self.lock:
            self.futures[key] = future
            self.futures.move_to_end(key)
            while len(self.futures) > REMEMBERED_RESULTS:
                self.futures.popitem(last=False)
        return key, future

    def outcome(self, key: str) -> Outcome | None:
        with self.lock:
            future = self.futures.get(key)
        if future is not None:
            return outcome_of(key, future)
        cached = self.pool.cache.get(key) if self.pool.cache is not None else None
        return Outcome(key=key, state="done", result=cached.to_row()) if cached else None

    def add_batch(self, members: list[tuple[str, Future[Any]]]) -> str:
        batch_id = f"b{next(self.batch_ids)}"
        with self.lock:
            self.batches[batch_id] = members
            while len(self.batches) > REMEMBERED_BATCHES:
                self.batches.popitem(last=False)
        return batch_id


def outcome_of(key: str, future: Future[Any]) -> Outcome:
    if not future.done():
        return Outcome(key=key, state="pending")
    result = future.result()
    if isinstance(result, EvalResult):
        return Outcome(key=key, state="done", result=result.to_row())
    return Outcome(key=key, state=REFERENCE_ERROR, error=str(result.get("diagnostic", ""))[:2000])


def check_reference_or_422(reference_src: str) -> None:
    from kpipe.gym.judge.evaluation import check_reference

    try:
        check_reference(reference_src)
    except (ValueError, TypeError) as exc:
        raise HTTPException(status_code=422, detail=f"reference_src: {exc}") from None


def bearer_guard(token: str | None) -> Any:
    """Refuse (401) a request without the service's token, and log it: a refused request on a
    run's service is someone other than the run's jobs knocking (a candidate has neither the
    token nor a route to the service, kpipe.gym.confine.environment and kpipe.gym.confine.sandbox), worth a trace."""
    def guard(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            peer = request.client.host if request.client else "unknown"
            log.warning("KernelGym service refused %s %s from %s: %s bearer token", request.method, request.url.path, peer,
                        "no" if scheme.lower() != "bearer" else "a wrong")
            raise HTTPException(status_code=401, detail="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    return guard


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "bearer token required"},
    413: {"model": Problem, "description": "request body too large"},
    422: {"model": Problem, "description": "invalid request (the reason is in detail)"},
}


def create_app(pool: GymPool, token: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The service around `pool` (which the caller owns and closes)."""
    app = FastAPI(title="KernelGym", version=API_VERSION,
                  description="Isolated, hack-resistant evaluation of Triton kernels against KernelBench references.")
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    registry = Registry(pool)
    guarded = [Depends(bearer_guard(token))]

    @app.post("/v1/evaluate", response_model=Outcome, dependencies=guarded,
              responses={**ERRORS, 202: {"model": Outcome, "description": "still running at the deadline: poll /v1/results/{key}"}})
    async def evaluate(body: EvaluateRequest) -> Any:
        """Evaluate one candidate; waits up to ``deadline_s``."""
        key, future = registry.submit(body, body.priority)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=body.deadline_s)
        except asyncio.TimeoutError:
            return JSONResponse(Outcome(key=key, state="pending").model_dump(), status_code=202)
        outcome = outcome_of(key, future)
        if outcome.state == REFERENCE_ERROR:
            raise HTTPException(status_code=422, detail=f"reference_src failed to run: {outcome.error}")
        return outcome

    @app.post("/v1/batches", response_model=BatchStatus, status_code=202, dependencies=guarded, responses=ERRORS)
    def submit_batch(body: BatchRequest) -> BatchStatus:
        """Queue every job; poll ``GET /v1/batches/{batch_id}``."""
        for i, job in enumerate(body.jobs):
            try:
                check_reference_or_422(job.reference_src)
            except HTTPException as exc:
                raise HTTPException(status_code=422, detail=f"jobs[{i}].{exc.detail}") from None
        members = [registry.submit(job, body.priority) for job in body.jobs]
        return batch_status(registry.add_batch(members), members, include=False)

    @app.get("/v1/batches/{batch_id}", response_model=BatchStatus, dependencies=guarded,
             responses={**ERRORS, 404: {"model": Problem, "description": "unknown batch"}})
    def get_batch(batch_id: str = Path(max_length=64), outcomes: bool = True) -> BatchStatus:
        """Progress of a batch and, with ``outcomes``, every job's outcome in submission order."""
        with registry.lock:
            members = registry.batches.get(batch_id)
        if members is None:
            raise HTTPException(status_code=404, detail=f"unknown batch {batch_id!r}")
        return batch_status(batch_id, members, include=outcomes)

    @app.get("/v1/results/{key}", response_model=Outcome, dependencies=guarded,
             responses={**ERRORS, 404: {"model": Problem, "description": "no such result"}})
    def get_result(key: str = Path(pattern=KEY_PATTERN)) -> Outcome:
        """A result by its eval_key (from the cache, or submitted to this service)."""
        outcome = registry.outcome(key)
        if outcome is None:
            raise HTTPException(status_code=404, detail=f"no result with key {key}")
        return outcome

    @app.get("/v1/health", response_model=Health, dependencies=guarded, responses={401: ERRORS[401]})
    def health() -> Health:
        workers = pool.workers()
        alive = sum(w["alive"] for w in workers)
        return Health(status="ok" if alive == len(workers) else "degraded", api_version=API_VERSION,
                      workers=len(workers), workers_alive=alive, pending=pool.pending(),
                      device_kind=pool.device_kind, protocol=pool.protocol.to_dict(),
                      reuse_reference=pool.reuse_reference)

    @app.get("/v1/workers", response_model=list[Worker], dependencies=guarded, responses={401: ERRORS[401]})
    def workers() -> list[dict[str, Any]]:
        return pool.workers()

    return app


def batch_status(batch_id: str, members: list[tuple[str, Future[Any]]], include: bool) -> BatchStatus:
    outcomes = [outcome_of(key, future) for key, future in members]
    finished = [o for o in outcomes if o.state != "pending"]
    failures = sum(1 for o in finished if o.state != "done" or (o.result or {}).get("status") != "pass")
    return BatchStatus(batch_id=batch_id, total=len(members), done=len(finished), failures=failures,
                       state="done" if len(finished) == len(members) else "running",
                       outcomes=outcomes if include else None)


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
