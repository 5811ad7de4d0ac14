"""What the loop needs of KernelGym, and the simplest way to get it.

The loop talks to any object with `evaluate_many(jobs) -> results` (jobs are
(reference_src, candidate_src) pairs, results carry the `evals` columns: status, correct,
hacked, speedup_eager, speedup_compile, pr, feedback, key, ...). `LocalEvaluator` calls
`kpipe.gym.evaluate` one job at a time; the GPU pool and the HTTP service implement the
same method.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from tqdm.auto import tqdm


class Evaluator(Protocol):
    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[Any]: ...


def result_field(result: Any, name: str, default: Any = None) -> Any:
    """A field of an evaluation result, whether it is a dataclass/object or a mapping."""
    if isinstance(result, Mapping):
        return result.get(name, default)
    return getattr(result, name, default)


REFERENCE_ERROR = "reference_error"


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
            message = f"Status: {REFERENCE_ERROR}\nThe reference program failed: {str(error)[:500]}"
            return {"status": REFERENCE_ERROR, "correct": False, "hacked": False, "feedback": message}

    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[Any]:
        return [
            self.evaluate_one(reference, candidate)
            for reference, candidate in tqdm(jobs, desc="evaluate", disable=not self.progress, leave=False)
        ]
