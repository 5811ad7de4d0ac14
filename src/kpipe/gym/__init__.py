"""KernelGym: isolated, hack-resistant evaluation of a Triton kernel against its reference.

``evaluate(reference_src, candidate_src, protocol) -> EvalResult``; see docs/kernelgym.md.
Importing this package does not import torch: the CLI and other light users stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kpipe.gym.protocol import PROTOCOL_VERSION, Protocol
from kpipe.gym.result import STATUSES, EvalResult, eval_key

if TYPE_CHECKING:
    from kpipe.gym.evaluation import ReferenceFailure, evaluate

__all__ = ["PROTOCOL_VERSION", "STATUSES", "EvalResult", "Protocol", "ReferenceFailure", "eval_key", "evaluate"]


def __getattr__(name: str) -> Any:
    if name in ("evaluate", "ReferenceFailure"):
        from kpipe.gym import evaluation as module

        return getattr(module, name)
    raise AttributeError(f"module 'kpipe.gym' has no attribute {name!r}")
