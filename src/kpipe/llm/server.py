"""`kpipe serve`: an OpenAI-compatible chat-completions server over any `Responder`.

Two responders: the offline teacher (answers from the bank of known solutions, so the
default pipeline distills real multi-turn trajectories without a network) and a local HF
model. Optional fault injection (429, 500, delays past the client's timeout, truncated and
code-less answers) exercises the client's retry path and the loop's bookkeeping for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from kpipe.infra.process import tied_to_this_process
from kpipe.llm.types import ChatRequest, Completion

FAULT_KINDS = ("429", "500", "delay", "truncate", "codeless")
CODELESS_TEXT = "I have analysed the architecture and will think further about how to optimise it."


class Responder(Protocol):
    """Produces one answer to one chat request (the server adds HTTP and faults)."""

    def respond(self, request: ChatRequest) -> Completion: ...


@dataclass(frozen=True)
class FaultConfig:
    """Per-attempt probabilities of each fault; at most one fault per attempt."""

    rate_429: float = 0.0
    rate_500: float = 0.0
    rate_delay: float = 0.0
    rate_truncate: float = 0.0
    rate_codeless: float = 0.0
    delay_s: float = 5.0
    seed: int = 0

    @classmethod
    def parse(cls, spec: str, delay_s: float = 5.0, seed: int = 0) -> FaultConfig:
        """From "429=0.1,500=0.05,delay=0.05,truncate=0.05,codeless=0.05" (empty: no faults)."""
        rates: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, value = item.partition("=")
            if kind not in FAULT_KINDS:
                raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULT_KINDS)}")
            rates[f"rate_{kind}"] = float(value)
        if sum(rates.values()) > 1:
            raise ValueError(f"fault rates sum to {sum(rates.values()):.2f} > 1")
        return cls(**rates, delay_s=delay_s, seed=seed)

    def pick(self, content_hash: str, attempt: int) -> str | None:
        """The fault for this attempt at this content, or None. Deterministic in (seed, content,
        attempt), so runs reproduce, yet a retried request eventually gets through."""
        u = random.Random(f"{self.seed}:{content_hash}:{attempt}").random()
        for kind in FAULT_KINDS:
            rate = getattr(self, f"rate_{kind}")
            if u < rate:
                return kind
            u -= rate
        return None


def approx_tokens(text: str) -> int:
    """~4 characters per token: the offline teacher has no tokenizer, and usage must be nonzero."""
    return max(1, (len(text) + 3) // 4)


def request_from_body(body: dict[str, Any]) -> ChatRequest:
    """The `ChatRequest` an OpenAI chat-completions body asks for."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return ChatRequest(
        messages=[{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in messages],
        max_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or 8192),
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        seed=body.get("seed"),
        logprobs=bool(body.get("logprobs", False)),
    )


def completion_body(completion: Completion, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": completion.text},
                "finish_reason": completion.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        },
    }


def truncated(completion: Completion) -> Completion:
    """The first half of an answer, as a max-tokens cut-off returns it."""
    half = completion.text[: len(completion.text) // 2]
    return Completion(text=half, finish_reason="length", prompt_tokens=completion.prompt_tokens,
                      completion_tokens=approx_tokens(half))


class ServerStats:
    """What the server saw: attempts and successful answers per request content (tests count
    these to prove a resumed run re-sends nothing already answered)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()

    def as_json(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": sum(self.attempts.values()),
                "answered": sum(self.answered.values()),
                "distinct_answered": len(self.answered),
                "answered_by_hash": dict(self.answered),
                "faults": dict(self.faults),
            }


def make_app(responder: Responder, model: str, faults: FaultConfig | None = None) -> FastAPI:
    """The FastAPI app: /v1/chat/completions, /v1/models, /health, /stats."""
    app = FastAPI(title=f"kpipe serve ({model})")
    stats = ServerStats()
    app.state.stats = stats

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "model": model}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "kpipe"}]}

    @app.get("/stats")
    def get_stats() -> dict[str, Any]:
        return stats.as_json()

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> JSONResponse:
        body = await raw.json()
        try:
            request = request_from_body(body)
        except (ValueError, KeyError, TypeError) as error:
            return JSONResponse({"error": {"message": str(error), "type": "invalid_request_error"}}, status_code=400)
        content_hash = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]
        with stats.lock:
            attempt = stats.attempts[content_hash]
            stats.attempts[content_hash] += 1
        fault = faults.pick(content_hash, attempt) if faults else None
        if fault is not None:
            with stats.lock:
                stats.faults[fault] += 1
        if fault == "429":
            return JSONResponse({"error": {"message": "rate limited (injected)", "type": "rate_limit"}}, status_code=429)
        if fault == "500":
            return JSONResponse({"error": {"message": "server error (injected)", "type": "server_error"}}, status_code=500)
        if fault == "delay":
            await asyncio.sleep(faults.delay_s)  # type: ignore[union-attr]
        completion = await run_in_threadpool(responder.respond, request)
        if fault == "truncate":
            completion = truncated(completion)
        elif fault == "codeless":
            completion = Completion(text=CODELESS_TEXT, finish_reason="stop", prompt_tokens=completion.prompt_tokens,
                                    completion_tokens=approx_tokens(CODELESS_TEXT))
        if fault != "delay":  # a delayed answer reaches a client that has already given up
            with stats.lock:
                stats.answered[content_hash] += 1
        return JSONResponse(completion_body(completion, model))

    return app


class BackgroundServer:
    """Runs an app with uvicorn in a thread (tests, and workflow scripts that need a server
    for the duration of one job)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("kpipe serve did not start")
            time.sleep(0.02)
        return self

    @property
    def base_url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/v1"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def serving_in_subprocess(serve_args: list[str], startup_timeout_s: float = 120.0) -> Iterator[Callable[[], str]]:
    """Start `kpipe serve <serve_args>` in a child process for the duration of a block; yields a
    function that waits for its base URL, so that the caller starts other things (the run's
    KernelGym service) while the server comes up. Used by jobs that need a server for their own
    lifetime (offline distillation and evaluation)."""
    with tempfile.TemporaryDirectory(prefix="kpipe-serve-") as scratch:
        ready = Path(scratch) / "url"
        command = [sys.executable, "-m", "kpipe.cli", "serve", *serve_args, "--port", "0", "--ready-file", str(ready)]
        # dies with this job, also when the job cannot clean up (Ctrl-C under load left one holding the run's
        # output pipe, and Snakemake's caller waited on it)
        child = subprocess.Popen(tied_to_this_process(command), start_new_session=True)
        deadline = time.monotonic() + startup_timeout_s

        def base_url() -> str:
            while not ready.exists():
                if child.poll() is not None:
                    raise RuntimeError(f"kpipe serve {' '.join(serve_args)} exited with status {child.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kpipe serve did not start within {startup_timeout_s:.0f}s")
                time.sleep(0.05)
            return ready.read_text().strip()

        try:
            yield base_url
        finally:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


@contextlib.contextmanager
def served_in_subprocess(serve_args: list[str], startup_timeout_s: float = 120.0) -> Iterator[str]:
    """`serving_in_subprocess`, its base URL waited for before the block."""
    with serving_in_subprocess(serve_args, startup_timeout_s) as base_url:
        yield base_url()
