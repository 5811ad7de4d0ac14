"""KernelGym: isolated, hack-resistant evaluation of a Triton kernel against its reference.

``evaluate(reference_src, candidate_src, protocol) -> EvalResult``; see docs/kernelgym.md.

The package is split at its trust boundary: ``candidate`` (what runs inside the candidate's
process), ``judge`` (the evaluation protocol's steps and the verdict), ``confine`` (isolation,
the sandbox, limits, the fork server) and ``serve`` (pool, service, client, cache); ``protocol``
and ``exchange`` are what the two sides share. The candidate's side imports nothing from the
judge's (tests/test_gym_boundary.py).

Importing this package imports only the protocol: not torch (the CLI and other light users stay
fast), and not the judge, which a candidate's process never loads. The rest of the public API is
imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kpipe.gym.protocol import PROTOCOL_VERSION, Protocol

if TYPE_CHECKING:
    from kpipe.gym.judge.evaluation import ReferenceFailure, evaluate
    from kpipe.gym.judge.result import STATUSES, EvalResult, eval_key

__all__ = ["PROTOCOL_VERSION", "STATUSES", "EvalResult", "Protocol", "ReferenceFailure", "eval_key", "evaluate"]


def __getattr__(name: str) -> Any:
    if name in ("evaluate", "ReferenceFailure"):
        from kpipe.gym.judge import evaluation

        return getattr(evaluation, name)
    if name in ("STATUSES", "EvalResult", "eval_key"):
        from kpipe.gym.judge import result

        return getattr(result, name)
    raise AttributeError(f"module 'kpipe.gym' has no attribute {name!r}")
