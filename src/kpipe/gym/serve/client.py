"""A Python client of ``kpipe gym serve``; also an evaluator for ``kpipe.agent``.

``GymClient(url).evaluate_many(jobs)`` submits one batch, polls it and returns results in
job order, like ``GymPool`` and ``LocalEvaluator``: EvalResult objects, or a
``reference_error`` mapping for a reference that failed to run. Connection errors and
429/502/503/504 answers are retried with exponential backoff; other 4xx are raised at once
(they mean bad input, and retrying cannot help). Light: no torch import.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import httpx
from tqdm.auto import tqdm

from kpipe.gym.judge.result import REFERENCE_ERROR, EvalResult, reference_error

RETRY_STATUSES = (429, 502, 503, 504)
TOKEN_ENV = "KPIPE_GYM_TOKEN"


class GymServiceError(RuntimeError):
    """The service refused a request (4xx) or stayed unreachable through every retry."""


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Exponential backoff: base, 2*base, 4*base, ... capped."""
    return min(cap_s, base_s * 2**attempt)


def outcome_result(outcome: dict[str, Any]) -> Any:
    """An outcome of the API as what evaluators return."""
    if outcome["state"] == "done":
        return EvalResult.from_row(outcome["result"])
    if outcome["state"] == REFERENCE_ERROR:
        return reference_error(outcome.get("error") or "")
    raise ValueError(f"outcome {outcome['key']} is still pending")


class GymClient:
    """Talks to one KernelGym service. The token defaults to ``$KPIPE_GYM_TOKEN``."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 5,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        poll_s: float = 1.0,
        batch_size: int = 512,
        progress: bool = True,
        priority: int = 0,
    ) -> None:
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.retries = retries
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.poll_s = poll_s
        self.batch_size = batch_size
        self.progress = progress
        self.priority = priority  # sent with every job: the service serves higher priorities first

    def request(self, method: str, path: str, accept: tuple[int, ...] = (), **kwargs: Any) -> httpx.Response:
        """One API call with retries on transient failures; 4xx other than `accept` raise
        GymServiceError."""
        for attempt in range(self.retries + 1):
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise GymServiceError(f"{method} {path}: service unreachable ({exc})") from exc
            else:
                if response.status_code not in RETRY_STATUSES:
                    if response.status_code >= 400 and response.status_code not in accept:
                        raise GymServiceError(f"{method} {path}: {response.status_code} {detail(response)}")
                    return response
                if attempt == self.retries:
                    raise GymServiceError(f"{method} {path}: {response.status_code} after {self.retries} retries")
            time.sleep(backoff_s(attempt, self.backoff_base_s, self.backoff_cap_s))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ endpoints

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health").json()

    def workers(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/workers").json()

    def result(self, key: str) -> dict[str, Any] | None:
        """The outcome stored under `key`, or None if the service has none."""
        response = self.request("GET", f"/v1/results/{key}", accept=(404,))
        return None if response.status_code == 404 else response.json()

    def evaluate(self, reference_src: str, candidate_src: str, deadline_s: float = 600.0) -> Any:
        """One evaluation; a 202 (past the service's deadline) is polled until done."""
        body = {"reference_src": reference_src, "candidate_src": candidate_src, "deadline_s": deadline_s,
                "priority": self.priority}
        response = self.request("POST", "/v1/evaluate", json=body)
        outcome = response.json()
        while outcome["state"] == "pending":
            time.sleep(self.poll_s)
            outcome = self.request("GET", f"/v1/results/{outcome['key']}").json()
        return outcome_result(outcome)

    def submit_batch(self, jobs: Iterable[tuple[str, str]]) -> str:
        body = {"jobs": [{"reference_src": r, "candidate_src": c} for r, c in jobs], "priority": self.priority}
        return self.request("POST", "/v1/batches", json=body).json()["batch_id"]

    def batch(self, batch_id: str, outcomes: bool = True) -> dict[str, Any]:
        return self.request("GET", f"/v1/batches/{batch_id}", params={"outcomes": outcomes}).json()

    def evaluate_many(self, jobs: Iterable[tuple[str, str]]) -> list[Any]:
        """Evaluate every (reference_src, candidate_src) pair; results in job order."""
        jobs = list(jobs)
        chunks = [jobs[i : i + self.batch_size] for i in range(0, len(jobs), self.batch_size)]
        batch_ids = [self.submit_batch(chunk) for chunk in chunks]
        results: list[Any] = []
        with tqdm(total=len(jobs), desc="evaluate (remote)", unit="eval", disable=not self.progress, leave=False) as bar:
            for batch_id in batch_ids:
                while (status := self.batch(batch_id, outcomes=False))["state"] != "done":
                    bar.set_postfix(failures=status["failures"], refresh=False)
                    time.sleep(self.poll_s)
                status = self.batch(batch_id)
                results.extend(outcome_result(outcome) for outcome in status["outcomes"])
                bar.update(status["total"])
        return results

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> GymClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", ""))[:500]
    except ValueError:
        return response.text[:500]
