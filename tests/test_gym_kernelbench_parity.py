"""Where KernelGym deliberately differs from KernelBench's harness, and the one-build-per-child
copies of the model that must behave like fresh seeded constructions."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from kpipe.gym import Protocol
from kpipe.gym.candidate.child import Builds, build_model
from kpipe.gym.judge.evaluation import tolerance

# KernelBench at the vendored commit (anchors/kernelbench_harness/eval.py,
# get_tolerance_for_precision, used by run_and_check_correctness) compares fp32 outputs with
# atol = rtol = 1e-4; KernelBench v0/v0.1 and the paper use 1e-2, as our Protocol does.
KERNELBENCH_FP32_TOLERANCE = 1e-4


def test_l2_14_verdict_differs_from_kernelbench_by_tolerance_only() -> None:
    """L2_14 (Gemm_Divide_Sum_Scaling): out = 0.75 * x . colsum(W), |out| ~ 1e3 at KernelBench's
    sizes. KernelBench's own H100 record of the bank's column-sum rewrite: max abs diff
    0.017-0.023, mean 0.0046, 0/5 trials pass. Deviations of that size fail a 1e-4 tolerance
    (on the outputs with |out| below ~200) and pass kpipe's 1e-2: the verdicts differ by the
    tolerance, a deliberate choice (not by how inputs are drawn: at 1e-2 no KernelBench trial
    could fail, its smallest |out| in trial 0 is 4.3, giving a bound of 0.053 > 0.023)."""
    generator = torch.Generator().manual_seed(0)
    k = 8192
    col_sum = torch.randn(k, generator=generator, dtype=torch.float64) * k**0.5  # sum of 8192 N(0,1) weights
    x = torch.rand(1024, k, generator=generator, dtype=torch.float64)  # torch.rand, as get_inputs
    reference = (0.75 * x @ col_sum).unsqueeze(1)
    deviation = (torch.rand(reference.shape, generator=generator, dtype=torch.float64) * 2 - 1) * 0.0092  # mean |.| 0.0046
    deviation[reference.abs().argmin()] = 0.02  # KernelBench's recorded maximum lands somewhere
    candidate = (reference + deviation).float()
    from kpipe.gym.judge.compare import Tolerance, compare_tensor

    assert Protocol().atol == Protocol().rtol == 1e-2
    ours = compare_tensor(candidate, reference.float(), tolerance(Protocol()))
    theirs = compare_tensor(candidate, reference.float(), Tolerance(KERNELBENCH_FP32_TOLERANCE, KERNELBENCH_FP32_TOLERANCE, 0.05))
    assert ours.ok, ours.detail
    assert not theirs.ok and "max abs diff" in theirs.detail
    # the same protocol knob reproduces KernelBench's verdict when asked
    assert not compare_tensor(candidate, reference.float(), tolerance(Protocol(atol=1e-4, rtol=1e-4))).ok


class Noisy(nn.Module):
    """Weights, a buffer and a forward that draws random numbers (dropout in train mode)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("scale", torch.rand(width))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.linear(x) * self.scale)


class SelfCopy(Noisy):
    def __deepcopy__(self, memo: dict) -> SelfCopy:  # a "copy" that is the model itself
        return self


class Uncopyable(Noisy):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.handle = (i for i in range(3))  # generators cannot be deep-copied


def test_copies_behave_like_fresh_seeded_constructions() -> None:
    x = torch.randn(4, 16)
    for cls in (Noisy, SelfCopy, Uncopyable):
        builds = Builds(cls, [16], 42, "cpu")
        for _ in range(2):  # the first model runs (and draws) before the copies are taken
            builds.model(x)
        fresh = builds.fresh()
        constructed = build_model(cls, [16], 42, "cpu")
        assert fresh is not builds.model and type(fresh) is cls
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), constructed.state_dict().values()))
        # same random state after the copy as after a construction: train-mode dropout agrees
        out_copy = fresh(x)
        torch.manual_seed(42)
        build_model(cls, [16], 42, "cpu")  # reset the RNG as a construction leaves it
        assert torch.equal(out_copy, constructed(x))


def test_earlier_protocols_are_read_without_their_retired_timing_fields_and_key_apart() -> None:
    """kgym-14 runs cuBLAS with its default workspace, as KernelBench does; a kgym-13 record holds the
    child's timing fields kgym-14 removed and still reads (they are dropped), a kgym-2 record keeps
    its workspace setting, and neither shares a cache key with the current protocol."""
    from kpipe.gym.judge.result import eval_key

    default = Protocol(baseline="eager")
    assert default.cublas_workspace_config == ""
    kgym13 = {**default.to_dict(), "version": "kgym-13", "timing_start": "behind_flush", "paired_reference_trials": 50}
    assert Protocol.from_dict(kgym13).version == "kgym-13"
    kgym2 = {k: v for k, v in default.to_dict().items() if k not in ("cublas_workspace_config", "warmup_ms")}
    earlier = Protocol.from_dict({**kgym2, "version": "kgym-2"})
    assert (earlier.cublas_workspace_config, earlier.warmup_ms) == (":4096:8", 0.0)
    assert Protocol.from_json(default.to_json()).to_json() == default.to_json()
    assert eval_key("r", "c", default, "cpu") != eval_key("r", "c", earlier, "cpu")
    with pytest.raises(ValueError, match="timing_start"):
        Protocol.from_dict({**default.to_dict(), "timing_start": "behind_flush"})  # retired only in earlier versions' records
