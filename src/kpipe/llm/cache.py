"""A response cache keyed by request hash, so a killed job pays for no answer twice.

An append-only JSON-lines file: each answer is appended and flushed the moment it arrives
(through the engines' `on_result` callback), so a kill loses at most the requests in
flight. A torn last line (killed mid-write) is ignored on load. Failed requests are not
cached: a rerun tries them again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kpipe.llm.types import ChatRequest, Completion, Engine, Message, ResultCallback, prompt_tokens


class ResponseCache:
    """request hash -> Completion, persisted as JSON lines at `path`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, Completion] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn write of a killed run
                self._entries[record["hash"]] = Completion.from_json(record["completion"])

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Completion | None:
        return self._entries.get(key)

    def put(self, key: str, completion: Completion) -> None:
        if completion.failed or key in self._entries:
            return
        self._entries[key] = completion
        with self.path.open("a") as handle:
            handle.write(json.dumps({"hash": key, "completion": completion.to_json()}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


class CachedEngine:
    """An engine that answers repeated requests from a `ResponseCache` and sends only the rest."""

    def __init__(self, engine: Engine, cache: ResponseCache) -> None:
        self.engine = engine
        self.cache = cache
        self.model = engine.model
        self.sent = 0  # requests passed to the wrapped engine
        self.hits = 0

    def prompt_tokens(self, chats: list[list[Message]]) -> list[int] | None:
        return prompt_tokens(self.engine, chats)

    def generate(self, requests: list[ChatRequest], on_result: ResultCallback | None = None) -> list[Completion]:
        keys = [r.request_hash(self.model) for r in requests]
        results: list[Completion | None] = []
        for index, key in enumerate(keys):
            hit = self.cache.get(key)
            if hit is not None:
                hit = Completion.from_json({**hit.to_json(), "cached": True})
                self.hits += 1
                if on_result is not None:
                    on_result(index, hit)
            results.append(hit)
        missing = [i for i, result in enumerate(results) if result is None]
        self.sent += len(missing)

        def store(position: int, completion: Completion) -> None:
            index = missing[position]
            self.cache.put(keys[index], completion)
            if on_result is not None:
                on_result(index, completion)

        if missing:
            fresh = self.engine.generate([requests[i] for i in missing], on_result=store)
            for index, completion in zip(missing, fresh, strict=True):
                results[index] = completion
        return results  # type: ignore[return-value]
