"""OpenAI-compatible chat completions (remote APIs, `vllm serve`, SGLang, `kpipe serve`).

Retries are done here rather than by the client so each attempt is counted, backoff is
configurable (tests use milliseconds) and a request that never succeeds becomes a
`Completion` with finish_reason "error" instead of an exception that would lose the batch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import openai
from tqdm.auto import tqdm

from kpipe.llm.types import FINISH_ERROR, ChatRequest, Completion, ResultCallback, Usage

log = logging.getLogger(__name__)
# the OpenAI client's transport logs every request at INFO: thousands of lines per distillation shard
# in the job log, between its progress bars (httpx; httpx2 from openai 3)
HTTP_LOGGERS = ("httpx", "httpx2")
for _name in HTTP_LOGGERS:
    logging.getLogger(_name).setLevel(logging.WARNING)

RETRYABLE = (openai.RateLimitError, openai.InternalServerError, openai.APITimeoutError, openai.APIConnectionError)
NO_KEY = "EMPTY"  # local servers accept any key; the client refuses an empty one
MAX_TOKENS_PARAMS = ("max_tokens", "max_completion_tokens")
OMITTABLE_PARAMS = ("temperature", "top_p", "seed")


@dataclass(frozen=True)
class Price:
    """US dollars per million tokens."""

    input_per_m: float
    output_per_m: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_per_m + completion_tokens * self.output_per_m) / 1e6


@dataclass
class OpenAIConfig:
    """Where and how to call. `api_key_env` names the variable holding the key (never the key)."""

    model: str
    base_url: str | None = None
    api_key_env: str | None = "OPENAI_API_KEY"
    concurrency: int = 8
    max_retries: int = 6
    timeout_s: float = 600.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    prices: dict[str, Price] = field(default_factory=dict)
    max_tokens_param: str = "max_tokens"  # reasoning models (GPT-5) want "max_completion_tokens"
    # sampling parameters left out of every request, where the API refuses them (GPT-5 and the o-series:
    # temperature and top_p other than 1; Claude Sonnet 4.5: temperature and top_p together) or ignores them
    omit_params: list[str] = field(default_factory=list)
    extra_body: dict[str, Any] = field(default_factory=dict)  # backend-specific sampling args
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens_param not in MAX_TOKENS_PARAMS:
            raise ValueError(f"max_tokens_param must be one of {', '.join(MAX_TOKENS_PARAMS)}, got {self.max_tokens_param!r}")
        unknown = sorted(set(self.omit_params) - set(OMITTABLE_PARAMS))
        if unknown:
            raise ValueError(f"omit_params: {', '.join(unknown)} cannot be left out (choose from {', '.join(OMITTABLE_PARAMS)})")


def request_params(config: OpenAIConfig, request: ChatRequest) -> dict[str, Any]:
    """The chat-completions arguments of one request: the request's sampling under the names this API takes
    (`max_tokens_param`), less the parameters it refuses (`omit_params`)."""
    params: dict[str, Any] = {
        "model": config.model,
        "messages": request.messages,
        "temperature": request.temperature,
        "top_p": request.top_p,
        config.max_tokens_param: request.max_tokens,
    }
    if request.seed is not None:
        params["seed"] = request.seed
    for name in config.omit_params:
        params.pop(name, None)
    if request.logprobs:
        params["logprobs"] = True
    if config.extra_body:
        params["extra_body"] = config.extra_body
    return params


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(max, base * 2**attempt)] (AWS style),
    so many clients rate-limited together do not retry in lockstep."""
    return rng.uniform(0, min(max_s, base_s * 2**attempt))


def retry_after_s(error: Exception) -> float | None:
    """The server's Retry-After hint in seconds, when it gave one."""
    response = getattr(error, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def resolve_api_key(api_key_env: str | None) -> str:
    """The key from the named environment variable; local servers need none."""
    if api_key_env is None:
        return NO_KEY
    key = os.environ.get(api_key_env)
    if not key:
        raise RuntimeError(f"environment variable {api_key_env} is not set (it should hold the API key)")
    return key


class OpenAIEngine:
    """Chat completions over HTTP with bounded concurrency, retries and cost accounting."""

    def __init__(self, config: OpenAIConfig, seed: int = 0) -> None:
        self.config = config
        self.model = config.model
        self.usage = Usage()
        self._api_key = resolve_api_key(config.api_key_env)
        self._rng = random.Random(seed)

    def __repr__(self) -> str:  # never show the key
        return f"OpenAIEngine(model={self.model!r}, base_url={self.config.base_url!r})"

    def generate(self, requests: list[ChatRequest], on_result: ResultCallback | None = None) -> list[Completion]:
        return asyncio.run(self._generate_all(requests, on_result))

    async def _generate_all(self, requests: list[ChatRequest], on_result: ResultCallback | None) -> list[Completion]:
        client = openai.AsyncOpenAI(
            base_url=self.config.base_url, api_key=self._api_key, timeout=self.config.timeout_s, max_retries=0
        )
        limit = asyncio.Semaphore(self.config.concurrency)
        bar = tqdm(total=len(requests), desc=f"generate {self.model}", disable=not self.config.progress, leave=False)

        async def one(index: int, request: ChatRequest) -> Completion:
            async with limit:
                completion = await self._with_retries(client, request)
            self.usage.add(completion)
            bar.update()
            if on_result is not None:
                on_result(index, completion)
            return completion

        try:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
        finally:
            bar.close()
            await client.close()

    async def _with_retries(self, client: openai.AsyncOpenAI, request: ChatRequest) -> Completion:
        started = time.perf_counter()
        for attempt in range(self.config.max_retries + 1):
            try:
                completion = await self._call(client, request)
            except RETRYABLE as error:
                if attempt == self.config.max_retries:
                    return self._failure(error, attempt + 1, started)
                delay = retry_after_s(error)
                if delay is None:
                    delay = backoff_delay(attempt, self.config.backoff_base_s, self.config.backoff_max_s, self._rng)
                log.info("retrying after %s (attempt %d, %.2fs)", type(error).__name__, attempt + 1, delay)
                await asyncio.sleep(min(delay, self.config.backoff_max_s))
            except openai.APIError as error:  # 4xx other than 429: retrying cannot help
                return self._failure(error, attempt + 1, started)
            else:
                completion.attempts = attempt + 1
                completion.latency_s = time.perf_counter() - started
                return completion
        raise AssertionError("unreachable")

    def _failure(self, error: Exception, attempts: int, started: float) -> Completion:
        return Completion(
            text="",
            finish_reason=FINISH_ERROR,
            attempts=attempts,
            latency_s=time.perf_counter() - started,
            error=f"{type(error).__name__}: {str(error)[:300]}",
        )

    async def _call(self, client: openai.AsyncOpenAI, request: ChatRequest) -> Completion:
        response = await client.chat.completions.create(**request_params(self.config, request))
        choice = response.choices[0]
        usage = response.usage
        prompt_tokens = usage.prompt_tokens if usage else 0
        completion_tokens = usage.completion_tokens if usage else 0
        price = self.config.prices.get(self.model)
        logprobs = None
        if request.logprobs and choice.logprobs is not None and choice.logprobs.content is not None:
            logprobs = [item.logprob for item in choice.logprobs.content]
        return Completion(
            text=choice.message.content or "",
            finish_reason=choice.finish_reason or "stop",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            logprobs=logprobs,
            cost_usd=price.cost(prompt_tokens, completion_tokens) if price else 0.0,
        )
