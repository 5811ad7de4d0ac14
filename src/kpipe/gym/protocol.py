"""The evaluation protocol: every setting that can change a KernelGym result.

The protocol travels (as JSON) with every result and is part of its cache key, so two
results are comparable exactly when their protocols are equal.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Bump when the meaning of a result changes (a new check, a different statistic).
PROTOCOL_VERSION = "kgym-2"

BASELINES = ("eager", "compile", "both")
# where a timed call's start event is recorded: after a host synchronize (the GPU idle, so the
# call's launch overhead is inside the region) or queued behind the L2 flush (KernelBench: the
# launch overhead hides behind the flush)
TIMING_STARTS = ("after_sync", "behind_flush")
# fields added after kgym-2 whose defaults keep kgym-2's meaning: serialised only when they
# differ from these, so every earlier protocol's JSON and cache keys stay what they were
LATER_FIELDS = {"timing_start": "after_sync", "cublas_workspace_config": ":4096:8"}
DEVICES = ("auto", "cuda", "cpu")

# Static findings (kpipe.gym.screen) that reject a candidate as hacked by default; the
# others only inform (they are listed in the result and the feedback).
DEFAULT_REJECT_FINDINGS = (
    "try_except",
    "inherits_model",
    "monkey_patch",
    "thread",
    "tensor_subclass",
    "introspection",
    "subprocess",
    "network",
    "env_access",
    "ctypes",
)


@dataclass(frozen=True)
class Protocol:
    """How one candidate is judged. Defaults follow the paper (K=5 correctness trials)
    and the KernelGym brief (100 timed trials, 10x re-verification threshold)."""

    correct_trials: int = 5
    perf_trials: int = 100
    warmup: int = 10
    atol: float = 1e-2
    rtol: float = 1e-2
    # ||cand - ref|| / ||ref|| must stay below this: all-zeros output cannot pass on
    # tasks whose outputs are smaller than atol.
    norm_rtol: float = 0.05
    baseline: str = "both"
    device: str = "auto"
    timeout_s: float = 300.0
    reject_findings: tuple[str, ...] = DEFAULT_REJECT_FINDINGS
    hacking_check: bool = True
    ghost_replay: bool = True
    profile: bool = True
    recheck_speedup_above: float = 10.0
    # timed outputs compared with the reference (spot check of the timed path)
    timed_output_checks: int = 3
    # outputs larger than this are compared on a sample of this many elements (head, tail
    # and random positions): full copies of 8 GB KernelBench outputs cannot travel. 2^20
    # random positions miss a wrong region covering a fraction f of the output with
    # probability (1 - f)^(2^19) (f = 1e-5: 0.5%); larger samples cost seconds per
    # evaluation in copies, pickling and comparison (benchmarks/gym_pool.py)
    compare_max_elements: int = 1 << 20
    feedback_max_chars: int = 4000
    # address-space limit of the candidate process in MiB (host OOM); None = unlimited.
    # Leave None on CUDA: the driver reserves far more virtual memory than it uses.
    memory_limit_mb: int | None = None
    seed: int = 42
    l2_flush_mb: int = 256
    timing_start: str = "after_sync"  # TIMING_STARTS
    # CUBLAS_WORKSPACE_CONFIG of the children ("" : unset, cuBLAS's default workspace, as
    # KernelBench runs); an inherited setting wins over the default
    cublas_workspace_config: str = ":4096:8"
    version: str = field(default=PROTOCOL_VERSION)

    def __post_init__(self) -> None:
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES}, got {self.baseline!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.correct_trials < 1 or self.perf_trials < 1 or self.warmup < 0:
            raise ValueError("correct_trials and perf_trials must be >= 1 and warmup >= 0")
        if self.timing_start not in TIMING_STARTS:
            raise ValueError(f"timing_start must be one of {TIMING_STARTS}, got {self.timing_start!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if not isinstance(self.reject_findings, tuple):
            object.__setattr__(self, "reject_findings", tuple(self.reject_findings))

    @property
    def wants_eager(self) -> bool:
        return self.baseline in ("eager", "both")

    @property
    def wants_compile(self) -> bool:
        return self.baseline in ("compile", "both")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["reject_findings"] = sorted(self.reject_findings)
        for name, default in LATER_FIELDS.items():
            if data[name] == default:
                del data[name]
        return data

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): equal protocols give equal strings and cache keys."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Protocol:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown protocol key(s): {', '.join(unknown)}")
        values = dict(data)
        if "reject_findings" in values:
            values["reject_findings"] = tuple(values["reject_findings"])
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> Protocol:
        return cls.from_dict(json.loads(text))
