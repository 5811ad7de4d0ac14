"""The one generation interface every engine implements.

Callers (distillation, RL rollouts, evaluation, STTS) only see `ChatRequest` in and
`Completion` out, so swapping an API model for a local checkpoint changes no caller.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}

# finish reasons beyond OpenAI's "stop" / "length": the request failed for good after retries
FINISH_ERROR = "error"


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion to produce.

    `seed` distinguishes parallel samples of the same prompt: it goes into the request hash
    (so the response cache keeps them apart) and, where the backend honours it, into sampling.
    """

    messages: list[Message]
    max_tokens: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False

    def request_hash(self, model: str) -> str:
        """Content hash of everything that determines the answer (the response cache key)."""
        payload = json.dumps({"model": model, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:24]


@dataclass
class Completion:
    """One generated answer; `error` is set (and finish_reason is "error") when it failed for good."""

    text: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    cost_usd: float = 0.0
    latency_s: float = 0.0
    attempts: int = 1
    error: str | None = None
    cached: bool = False

    @property
    def failed(self) -> bool:
        return self.finish_reason == FINISH_ERROR

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Completion:
        return cls(**data)


# Called once per request as soon as its completion is final: lets a cache persist answers
# before the whole batch is done, so a killed job loses none it already paid for.
ResultCallback = Callable[[int, Completion], None]


class Engine(Protocol):
    """Anything that turns chat requests into completions, in order."""

    model: str

    def generate(self, requests: list[ChatRequest], on_result: ResultCallback | None = None) -> list[Completion]: ...


@runtime_checkable
class CountsPromptTokens(Protocol):
    """An engine that knows the tokens its rendered prompt of each chat takes (a local model's tokenizer and chat
    template, as its `generate` renders them), counted in one batch (the tokenizer's threads); None where it cannot
    tell (a wrapped engine that cannot)."""

    def prompt_tokens(self, chats: list[list[Message]]) -> list[int] | None: ...


def prompt_tokens(engine: Engine, chats: list[list[Message]]) -> list[int] | None:
    """Each chat's prompt tokens as `engine` renders it, or None where it does not count (an API model)."""
    return engine.prompt_tokens(chats) if isinstance(engine, CountsPromptTokens) else None


@dataclass
class Usage:
    """Running token, cost and reliability totals of an engine (what a run spent)."""

    requests: int = 0
    failures: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    by_finish_reason: dict[str, int] = field(default_factory=dict)

    def add(self, completion: Completion) -> None:
        self.requests += 1
        self.failures += completion.failed
        self.retries += completion.attempts - 1
        self.prompt_tokens += completion.prompt_tokens
        self.completion_tokens += completion.completion_tokens
        self.cost_usd += completion.cost_usd
        reason = completion.finish_reason
        self.by_finish_reason[reason] = self.by_finish_reason.get(reason, 0) + 1
