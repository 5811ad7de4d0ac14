"""What one turn earns: the per-turn rewards of Dr. Kernel and the baselines it is compared with.

A reward maps one KernelGym result (correct, hacked, speedup, PR, status) to a number: Eq. 1 of
the Dr. Kernel paper (``papers/dr-kernel.md``) and its PR term (Eq. 8), the authors' released
code's weighting, Kevin's score and TritonForge's tiers; ``rl.reward`` picks one by name
(:data:`REWARDS`). Plain Python on scalars: what the trainer then does with the rewards
(returns, advantages, filters, the loss) is :mod:`kpipe.train.algos`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

SPEEDUP_CAP = 3.0  # paper §4.2: speedups above 3x are mostly timing artefacts
KEVIN_CORRECTNESS_WEIGHT = 0.3  # Kevin App. B.2
RELEASED_CODE_WEIGHT = 0.5  # released code: every term of the reward weighted by 0.5
TRITONFORGE_COMPILED_REWARD = 0.1  # TritonForge (papers/tritonforge.md, its kernel generator): compiles
TRITONFORGE_CORRECT_REWARD = 0.3  # correct; + min(max(speedup - 1, 0), 2) when faster
# statuses of turns whose kernel never compiled: the request failed, no code / no Triton kernel, compiler error
TORCH_OP_FINDING = "torch_op_in_forward:"  # kpipe.gym.screen's finding for torch compute left in forward
TRITONFORGE_NOT_COMPILED = ("generation_error", "format_error", "compilation_error", "reference_error")


def clipped_speedup(speedup: float | None, cap: float = SPEEDUP_CAP) -> float:
    """min(T_ref / T_kernel, cap): the speedup term of Eq. 1, robust to timing artefacts."""
    if speedup is None or not math.isfinite(speedup) or speedup < 0:
        raise ValueError(f"a correct kernel needs a finite, non-negative speedup, got {speedup!r}")
    return min(speedup, cap)


def _checked_pr(pr: float | None) -> float:
    """PR (Eq. 7) is a time fraction; anything outside [0, 1] is a profiling bug."""
    if pr is None or not math.isfinite(pr) or not 0.0 <= pr <= 1.0:
        raise ValueError(f"the PR term needs a profiling ratio in [0, 1], got {pr!r}")
    return pr


def earns_reward(correct: bool, hacked: bool) -> bool:
    """C(y) of Eq. 1: only a correct, non-hacked kernel scores (failed, timed-out, hacked: 0)."""
    return bool(correct) and not bool(hacked)


def reward_paper(
    correct: bool,
    hacked: bool,
    speedup: float | None,
    pr: float | None = None,
    use_pr: bool = False,
    speedup_cap: float = SPEEDUP_CAP,
) -> float:
    """Eq. 1 (R = C + C·min(speedup, 3)), plus C·PR with `use_pr` (Eq. 8)."""
    if not earns_reward(correct, hacked):
        return 0.0
    reward = 1.0 + clipped_speedup(speedup, speedup_cap)
    if use_pr:
        reward += _checked_pr(pr)
    return reward


def reward_released_code(
    correct: bool,
    hacked: bool,
    speedup: float | None,
    pr: float | None = None,
    use_pr: bool = False,
    speedup_cap: float = SPEEDUP_CAP,
) -> float:
    """The released code's weighting: 0.5·C + 0.5·min(speedup, 3) [+ 0.5·PR·C]; 0 unless correct."""
    if not earns_reward(correct, hacked):
        return 0.0
    reward = RELEASED_CODE_WEIGHT * (1.0 + clipped_speedup(speedup, speedup_cap))
    if use_pr:
        reward += RELEASED_CODE_WEIGHT * _checked_pr(pr)
    return reward


def reward_kevin(
    correct: bool,
    hacked: bool,
    speedup: float | None,
    pr: float | None = None,
    use_pr: bool = False,
    speedup_cap: float = SPEEDUP_CAP,
    torch_ops: bool = False,
) -> float:
    """Kevin's score 0.3·correct + speedup (speedup only for correct kernels), and 0 for a kernel that
    uses PyTorch ops (Kevin §6.2: "assign 0 reward to responses with any PyTorch functional operators").

    Kevin does not clip the speedup: its preset (``ablation: kevin``) sets ``speedup_cap`` to infinity.
    The cap defaults to the paper's 3 so that ``reward: kevin`` alone differs from the base run in one thing.
    `torch_ops` comes from KernelGym's screen (`uses_torch_ops`).
    """
    if use_pr:
        raise ValueError("Kevin's reward has no profiling (PR) term")
    if not earns_reward(correct, hacked) or torch_ops:
        return 0.0
    return KEVIN_CORRECTNESS_WEIGHT + clipped_speedup(speedup, speedup_cap)


def uses_torch_ops(findings: Sequence[str] | None) -> bool:
    """Kevin's rule on a kpipe turn: the screen found torch compute (torch.*, F.*) in ModelNew.forward."""
    return any(finding.startswith(TORCH_OP_FINDING) for finding in findings or ())


def kernel_compiled(status: str | None) -> bool:
    """TritonForge's ``compiled`` for a kpipe turn: KernelGym got past compilation, i.e. any status but a
    failed request, a format violation (no code, no ModelNew or Triton kernel), a compiler error or a
    broken reference. Runtime faults, mismatches, timeouts and hacks ran a compiled kernel."""
    return status is not None and status not in TRITONFORGE_NOT_COMPILED


def reward_tritonforge(
    correct: bool,
    hacked: bool,
    speedup: float | None,
    pr: float | None = None,
    use_pr: bool = False,
    speedup_cap: float = SPEEDUP_CAP,
    compiled: bool = False,
) -> float:
    """TritonForge's tiers: 0 (no code, rejected, request failed), 0.1 (compiles), 0.3 (correct),
    0.3 + min(max(speedup - 1, 0), 2) (correct and faster; the 2 is `speedup_cap` - 1).

    `compiled` comes from the turn's status (`kernel_compiled`); a hacked kernel is rejected (0).
    """
    if use_pr:
        raise ValueError("TritonForge's reward has no profiling (PR) term")
    if hacked:
        return 0.0
    if correct:
        return TRITONFORGE_CORRECT_REWARD + max(clipped_speedup(speedup, speedup_cap) - 1.0, 0.0)
    return TRITONFORGE_COMPILED_REWARD if compiled else 0.0


RewardFn = Callable[..., float]
REWARDS: dict[str, RewardFn] = {
    "paper": reward_paper,
    "released_code": reward_released_code,
    "kevin": reward_kevin,
    "tritonforge": reward_tritonforge,
}


def reward_fn(name: str) -> RewardFn:
    """The reward function registered as `name` (config key ``rl.reward``)."""
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; known: {', '.join(REWARDS)}")
    return REWARDS[name]


def _field(result: object, name: str) -> object:
    return result.get(name) if isinstance(result, dict) else getattr(result, name, None)


def turn_reward(
    name: str, use_pr: bool = False, baseline: Literal["eager", "compile"] = "eager", speedup_cap: float = SPEEDUP_CAP
) -> Callable[[object], float]:
    """The reward `name` as a function of one KernelGym result (an EvalResult, an `evals` row
    as a dict, or None when nothing could be evaluated): the agent loop's ``reward_fn``."""
    reward = reward_fn(name)
    if baseline not in ("eager", "compile"):
        raise ValueError(f"baseline must be 'eager' or 'compile', got {baseline!r}")

    def score(result: object) -> float:
        if result is None:
            return 0.0
        args = (bool(_field(result, "correct")), bool(_field(result, "hacked")),
                _field(result, f"speedup_{baseline}"), _field(result, "pr"), use_pr, speedup_cap)
        if reward is reward_tritonforge:  # the only reward with a tier for compiling
            return reward(*args, compiled=kernel_compiled(_field(result, "status")))
        if reward is reward_kevin:  # the only reward that zeroes kernels using PyTorch ops
            return reward(*args, torch_ops=uses_torch_ops(_field(result, "findings")))
        return reward(*args)

    return score
