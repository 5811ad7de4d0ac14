"""The result of one KernelGym evaluation: one row of the `evals` table."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kpipe.gym.confine.environment import redact_secrets
from kpipe.infra.provenance import judge_version
from kpipe.gym.confine.sandbox import opted_out

if TYPE_CHECKING:
    from kpipe.gym.protocol import Protocol

# Every status an evaluation can end in. The GPU fault subclasses refine `runtime_error`
# where the CUDA error says what happened, so feedback and statistics can tell them apart.
STATUSES = (
    "pass",
    "mismatch",
    "runtime_error",
    "compilation_error",
    "timeout",
    "crashed",  # killed by a signal, or exited without a result (os._exit, sys.exit, killpg)
    "oom",  # host or device out of memory
    "resource_limit",  # ran into one of its limits (kpipe.gym.confine.limits), on the judge's evidence; the diagnostic names it
    "format_error",  # no ModelNew / no @triton.jit kernel / not a Python module
    "hacked",
    "illegal_memory_access",
    "misaligned_address",
    "illegal_instruction",
    "device_assert",
    # the judge's alone: the reference failed (after a retry alone on its GPU where it ran out of
    # memory), so the candidate has no verdict; a row of eval-batch's output (kpipe.gym.serve.batch)
    "reference_error",
)
GPU_FAULTS = ("illegal_memory_access", "misaligned_address", "illegal_instruction", "device_assert")
# the *reference* failed: the agent's evaluators and the service answer a mapping with it
# (``reference_error``), eval-batch a row (``reference_error_result``)
REFERENCE_ERROR = "reference_error"


def reference_error(message: str) -> dict[str, Any]:
    """What every evaluator (local, pool, service client) returns for a broken reference."""
    feedback = f"Status: {REFERENCE_ERROR}\nThe reference program failed: {message[:500]}"
    return {"status": REFERENCE_ERROR, "correct": False, "hacked": False, "feedback": feedback, "diagnostic": message}


def reference_error_result(key: str, reference_hash: str, candidate_hash: str, message: str) -> EvalResult:
    """A row for a candidate whose reference failed: no verdict on it, and the reason."""
    mapping = reference_error(message)
    return EvalResult(key=key, reference_hash=reference_hash, candidate_hash=candidate_hash, status=REFERENCE_ERROR,
                      diagnostic=mapping["diagnostic"][:3000], feedback=mapping["feedback"])


@dataclass
class EvalResult:
    """Fields are exactly the columns of ``kpipe.data.schemas.EVALS`` (a test checks it)."""

    key: str
    reference_hash: str
    candidate_hash: str
    status: str
    correct: bool = False
    # KernelBench's verdict on its own: its allclose (atol = rtol = 1e-2) on every correctness trial, without
    # kpipe's relative-norm and eval()-mode checks; None where the candidate never reached the comparison
    kb_correct: bool | None = None
    hacked: bool = False
    hack_reasons: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    diagnostic: str = ""
    feedback: str = ""
    candidate_ms: float | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    pr: float | None = None
    launched_kernels: list[str] = field(default_factory=list)
    timing_kind: str = "cpu"
    device: str = ""
    # the GPU the candidate ran on, from inside its process (UUID and PCI address; "cpu")
    device_id: str = ""
    # [start, end] Unix seconds of every timing window of this evaluation on the judge's clock: the
    # reference's handed to this candidate and the candidate's; on one GPU they never overlap
    timed_spans: list[list[float]] = field(default_factory=list)
    torch_version: str = ""
    triton_version: str = ""
    protocol_version: str = ""
    protocol: str = ""
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}")
        self.redact()

    def redact(self) -> None:
        """Strip this process's secret values from the text a candidate could have filled
        (kpipe.gym.confine.environment.redact_secrets): every result is built or read through here."""
        self.diagnostic = redact_secrets(self.diagnostic)
        self.feedback = redact_secrets(self.feedback)
        self.hack_reasons = [redact_secrets(reason) for reason in self.hack_reasons]

    def to_row(self) -> dict[str, Any]:
        """A dict row for ``kpipe.data.io.write_table(rows, path, "evals")``."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_row(), sort_keys=True)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> EvalResult:
        return cls(**row)


def eval_key(reference_src: str, candidate_src: str, protocol: Protocol, device_kind: str) -> str:
    """Content hash of everything that determines a result: the result cache's key. A result
    of an unconfined candidate (the user's named opt-out) never stands in for a confined one, nor one
    of another judge (kpipe's KernelGym code, torch, Triton: ``judge_version``).
    Here, not beside ``evaluate``: a pool keys every job it is given, and its caller need not
    import torch for that (it cost the first ``submit`` of a one-pass batch 3 s on an H200 host)."""
    confinement = ["unconfined"] if opted_out() else []
    blob = json.dumps([reference_src, candidate_src, protocol.to_json(), device_kind, judge_version(), *confinement])
    return hashlib.sha256(blob.encode()).hexdigest()
