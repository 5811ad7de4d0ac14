"""The RL math of Dr. Kernel as small pure functions (cf. verl's ``core_algos.py``): what one turn
earns (the rewards), returns, advantages, sample filters, TritonForge's group buffer, the policy loss.
Rewards and advantage estimators each sit in one registry (`REWARDS`, `ADVANTAGES`), registered
beside their function; the config keys ``rl.reward`` and ``rl.advantage`` name an entry.

Equation numbers refer to the Dr. Kernel paper (``papers/dr-kernel.md``). Where the
authors' released code (hkust-nlp/KernelGYM on a patched verl) differs from the paper,
both are here and the paper is the default; the docstring says which is which.

Row layout: the trainer works on flat rows, one per (trajectory, turn). Group-wise
functions take per-row values plus per-row keys (prompt id, trajectory id, turn); keys
are any hashables (tuples included) or an integer tensor (fast path, used for large
batches). Invalid rows (a turn that was never reached, a row rejected by a filter) are
excluded from every baseline and get advantage 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

GroupKeys = Sequence[Hashable] | torch.Tensor
Singleton = Literal["zero", "return"]
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
PRSScope = Literal["all", "correct"]
KLEstimator = Literal["k1", "low_var_kl"]
KL_ESTIMATORS: tuple[KLEstimator, ...] = ("k1", "low_var_kl")
KL_CLAMP = 10.0  # verl / slime clamp of the low_var_kl estimate
PRS_SCOPES: tuple[PRSScope, ...] = ("all", "correct")

KEVIN_GAMMA = 0.4  # Kevin §4.3: discount of the sum over later turns' scores
MRS_DELTA = 1e-3  # Eq. 6: keep w in [1 - delta, 1 + delta]
MRS_TOKEN_VETO = 1e-4  # Eq. 6: reject a sequence if any token ratio is below this
PRS_TAU = 0.3  # Eq. 9 cutoff
PRS_SOFTNESS = 0.1  # Eq. 9 softness s
ZERO_VARIANCE_MIN_STD = 1e-3  # released code: groups whose last-turn rewards barely differ teach nothing
TRITONFORGE_MIN_VALID_GROUP_RATIO = 1.0  # TritonForge §3.2.3: a group must be complete
TRITONFORGE_MIN_VALID_ITEM_RATIO = 0.7  # TritonForge §3.2.3: >= 70% of a group's items must survive the filter
TRITONFORGE_EPS = 1e-8  # the buffer's z-score epsilon (slime's default_normalize_group_data)


# ---------------------------------------------------------------------------------------
# Rewards (Eq. 1, Eq. 8, the released code's, Kevin's, TritonForge's): one registry (`REWARDS`)
# ---------------------------------------------------------------------------------------
# A reward maps one KernelGym result (correct, hacked, speedup, PR; a reward may read more of it
# through its `extras`) to a number; plain Python on scalars.

SPEEDUP_CAP = 3.0  # paper §4.2: speedups above 3x are mostly timing artefacts
KEVIN_CORRECTNESS_WEIGHT = 0.3  # Kevin App. B.2
RELEASED_CODE_WEIGHT = 0.5  # released code: every term of the reward weighted by 0.5
TRITONFORGE_COMPILED_REWARD = 0.1  # TritonForge (papers/tritonforge.md, its kernel generator): compiles
TRITONFORGE_CORRECT_REWARD = 0.3  # correct; + min(max(speedup - 1, 0), 2) when faster
TORCH_OP_FINDING = "torch_op_in_forward:"  # kpipe.gym.judge.screen's finding for torch compute left in forward
# statuses of turns whose kernel never compiled: the request failed, no code / no Triton kernel, compiler error
TRITONFORGE_NOT_COMPILED = ("generation_error", "format_error", "compilation_error", "reference_error")


def result_field(result: object, name: str) -> object:
    """A field of a KernelGym result: an EvalResult, or an `evals` row as a dict."""
    return result.get(name) if isinstance(result, dict) else getattr(result, name, None)


@dataclass(frozen=True)
class Reward:
    """A registered reward: fn(correct, hacked, speedup, pr, use_pr, speedup_cap, **extras), `extras`
    reading what else it needs from the KernelGym result (TritonForge: compiled; Kevin: torch ops)."""

    name: str
    fn: Callable[..., float]
    extras: Callable[[object], dict[str, Any]]

    def __call__(self, *args: Any, **kwargs: Any) -> float:
        return self.fn(*args, **kwargs)


REWARDS: dict[str, Reward] = {}
RewardFunction = TypeVar("RewardFunction", bound=Callable[..., float])


def register_reward(name: str, extras: Callable[[object], dict[str, Any]] = lambda result: {}
                    ) -> Callable[[RewardFunction], RewardFunction]:
    """Register the decorated function as the reward `name` (config key ``rl.reward``, whose choices are
    the registry's); `extras` maps a KernelGym result to the function's keyword arguments beyond the six."""
    def register(fn: RewardFunction) -> RewardFunction:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} registered twice")
        REWARDS[name] = Reward(name, fn, extras)
        return fn
    return register


def reward_fn(name: str) -> Reward:
    """The reward registered as `name` (config key ``rl.reward``)."""
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; known: {', '.join(REWARDS)}")
    return REWARDS[name]


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


@register_reward("paper")
def reward_paper(correct: bool, hacked: bool, speedup: float | None, pr: float | None = None, use_pr: bool = False,
                 speedup_cap: float = SPEEDUP_CAP) -> float:
    """Eq. 1 (R = C + C·min(speedup, 3)), plus C·PR with `use_pr` (Eq. 8)."""
    if not earns_reward(correct, hacked):
        return 0.0
    reward = 1.0 + clipped_speedup(speedup, speedup_cap)
    if use_pr:
        reward += _checked_pr(pr)
    return reward


@register_reward("released_code")
def reward_released_code(correct: bool, hacked: bool, speedup: float | None, pr: float | None = None,
                         use_pr: bool = False, speedup_cap: float = SPEEDUP_CAP) -> float:
    """The released code's weighting: 0.5·C + 0.5·min(speedup, 3) [+ 0.5·PR·C]; 0 unless correct."""
    if not earns_reward(correct, hacked):
        return 0.0
    reward = RELEASED_CODE_WEIGHT * (1.0 + clipped_speedup(speedup, speedup_cap))
    if use_pr:
        reward += RELEASED_CODE_WEIGHT * _checked_pr(pr)
    return reward


def uses_torch_ops(findings: Sequence[str] | None) -> bool:
    """Kevin's rule on a kpipe turn: the screen found torch compute (torch.*, F.*) in ModelNew.forward."""
    return any(finding.startswith(TORCH_OP_FINDING) for finding in findings or ())


@register_reward("kevin", extras=lambda result: {"torch_ops": uses_torch_ops(result_field(result, "findings"))})
def reward_kevin(correct: bool, hacked: bool, speedup: float | None, pr: float | None = None, use_pr: bool = False,
                 speedup_cap: float = SPEEDUP_CAP, torch_ops: bool = False) -> float:
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


def kernel_compiled(status: str | None) -> bool:
    """TritonForge's ``compiled`` for a kpipe turn: KernelGym got past compilation, i.e. any status but a
    failed request, a format violation (no code, no ModelNew or Triton kernel), a compiler error or a
    broken reference. Runtime faults, mismatches, timeouts and hacks ran a compiled kernel."""
    return status is not None and status not in TRITONFORGE_NOT_COMPILED


@register_reward("tritonforge", extras=lambda result: {"compiled": kernel_compiled(result_field(result, "status"))})
def reward_tritonforge(correct: bool, hacked: bool, speedup: float | None, pr: float | None = None,
                       use_pr: bool = False, speedup_cap: float = SPEEDUP_CAP, compiled: bool = False) -> float:
    """TritonForge's tiers, from its released scripts (its paper's text names a `raw_reward` but gives no tiers):
    0 (no code, rejected, request failed), 0.1 (compiles), 0.3 (correct),
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


def turn_reward(name: str, use_pr: bool = False, baseline: Literal["eager", "compile"] = "eager",
                speedup_cap: float = SPEEDUP_CAP) -> Callable[[object], float]:
    """The reward `name` as a function of one KernelGym result (an EvalResult, an `evals` row
    as a dict, or None when nothing could be evaluated): the agent loop's ``reward_fn``."""
    reward = reward_fn(name)
    if baseline not in ("eager", "compile"):
        raise ValueError(f"baseline must be 'eager' or 'compile', got {baseline!r}")

    def score(result: object) -> float:
        if result is None:
            return 0.0
        return reward(bool(result_field(result, "correct")), bool(result_field(result, "hacked")),
                      result_field(result, f"speedup_{baseline}"), result_field(result, "pr"), use_pr, speedup_cap,
                      **reward.extras(result))

    return score


# ---------------------------------------------------------------------------------------
# Returns (Eq. 2, Kevin's discounted aggregation)
# ---------------------------------------------------------------------------------------


def _as_float_tensor(values: torch.Tensor | Sequence[float]) -> torch.Tensor:
    tensor = torch.as_tensor(values)
    return tensor if tensor.is_floating_point() else tensor.to(torch.get_default_dtype())


def _rows_by(keys: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    rows_of: dict[Hashable, list[int]] = {}
    for row, key in enumerate(keys):
        rows_of.setdefault(key, []).append(row)
    return rows_of


def _check_same_length(values: torch.Tensor, **others: Sequence | torch.Tensor) -> None:
    for name, other in others.items():
        if len(other) != len(values):
            raise ValueError(f"{name} has {len(other)} rows, expected {len(values)}")


def _check_gamma(gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"discount gamma must be in [0, 1], got {gamma}")


def reward_to_go(rewards: torch.Tensor | Sequence[float], gamma: float = 1.0) -> torch.Tensor:
    """Eq. 2: G_t = sum_{t' >= t} gamma^(t'-t) R_t' along the last (turn) dimension.

    Trailing zero padding of shorter trajectories leaves every G_t unchanged.
    """
    _check_gamma(gamma)
    rewards = _as_float_tensor(rewards)
    returns = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for turn in reversed(range(rewards.shape[-1])):
        running = rewards[..., turn] + gamma * running
        returns[..., turn] = running
    return returns


def discounted_max_return(rewards: torch.Tensor | Sequence[float], gamma: float = KEVIN_GAMMA) -> torch.Tensor:
    """Kevin's "max" aggregation: G_t = max_{t' >= t} gamma^(t'-t) R_t' (rewards one high kernel)."""
    _check_gamma(gamma)
    rewards = _as_float_tensor(rewards)
    returns = torch.empty_like(rewards)
    running = torch.full_like(rewards[..., 0], -math.inf)
    for turn in reversed(range(rewards.shape[-1])):
        running = torch.maximum(rewards[..., turn], gamma * running)
        returns[..., turn] = running
    return returns


def kevin_return(rewards: torch.Tensor | Sequence[float], gamma: float = KEVIN_GAMMA) -> torch.Tensor:
    """Kevin's final recipe: the discounted sum of the current and later turns' scores, gamma = 0.4."""
    return reward_to_go(rewards, gamma)


def returns_by_trajectory(
    rewards: torch.Tensor | Sequence[float],
    trajectory_ids: Sequence[Hashable],
    turns: Sequence[int],
    gamma: float = 1.0,
    aggregate: Literal["sum", "max"] = "sum",
) -> torch.Tensor:
    """Eq. 2 on flat rows: each row's return over the later turns of its own trajectory."""
    rewards = _as_float_tensor(rewards)
    _check_same_length(rewards, trajectory_ids=trajectory_ids, turns=turns)
    if aggregate not in ("sum", "max"):
        raise ValueError(f"aggregate must be 'sum' or 'max', got {aggregate!r}")
    to_go = reward_to_go if aggregate == "sum" else discounted_max_return
    returns = torch.empty_like(rewards)
    for key, rows in _rows_by(trajectory_ids).items():
        rows.sort(key=lambda row: int(turns[row]))
        if len({int(turns[row]) for row in rows}) != len(rows):
            raise ValueError(f"trajectory {key!r} has a repeated turn")
        index = torch.tensor(rows)
        returns[index] = to_go(rewards[index], gamma)
    return returns


# ---------------------------------------------------------------------------------------
# Advantages (Eq. 3, Eq. 5, trajectory RLOO): one registry, one signature (cf. verl's register_adv_est)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageBatch:
    """What every estimator is given, per row: its return (or the group buffer's value), its turn's
    reward, its prompt, trajectory and turn, whether it counts (`valid`); and what a group of one gets."""

    returns: torch.Tensor
    rewards: torch.Tensor
    prompt_ids: Sequence[Hashable]
    trajectory_ids: Sequence[Hashable]
    turns: Sequence[int]
    valid: torch.Tensor | Sequence[bool] | None = None
    singleton: Singleton = "zero"

    @property
    def prompt_turns(self) -> list[tuple[Hashable, int]]:
        return prompt_turn_keys(self.prompt_ids, self.turns)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its function, the arguments it takes from a batch, and whether its groups
    are the paper's (prompt, turn) ones (what TritonForge's group buffer normalises)."""

    name: str
    fn: Callable[..., torch.Tensor]
    inputs: Callable[[AdvantageBatch], tuple[Any, ...]]
    prompt_turn_groups: bool

    def __call__(self, batch: AdvantageBatch) -> torch.Tensor:
        return self.fn(*self.inputs(batch))


ADVANTAGES: dict[str, AdvantageEstimator] = {}
Estimator = TypeVar("Estimator", bound=Callable[..., torch.Tensor])


def register_advantage(name: str, inputs: Callable[[AdvantageBatch], tuple[Any, ...]],
                       prompt_turn_groups: bool = True) -> Callable[[Estimator], Estimator]:
    """Register the decorated function as the estimator `name` (config key ``rl.advantage``, whose
    choices are the registry's); `inputs` picks its arguments from an `AdvantageBatch`."""
    def register(fn: Estimator) -> Estimator:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} registered twice")
        ADVANTAGES[name] = AdvantageEstimator(name, fn, inputs, prompt_turn_groups)
        return fn
    return register


def advantage_fn(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; call it with an `AdvantageBatch`."""
    if name not in ADVANTAGES:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name]


def group_index(keys: GroupKeys, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Dense group ids 0..G-1 for per-row keys; an int tensor [n] or [n, k] takes the fast path."""
    if isinstance(keys, torch.Tensor):
        if keys.dim() not in (1, 2) or keys.is_floating_point():
            raise ValueError("tensor group keys must be integers of shape [n] or [n, k]")
        unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
        return inverse.to(device), len(unique)
    ids: dict[Hashable, int] = {}
    index = [ids.setdefault(key, len(ids)) for key in keys]
    return torch.tensor(index, dtype=torch.long, device=device), len(ids)


def prompt_turn_keys(prompt_ids: Sequence[Hashable], turns: Sequence[int]) -> list[tuple[Hashable, int]]:
    """The paper's advantage groups: rollouts of the same prompt at the same turn."""
    if len(prompt_ids) != len(turns):
        raise ValueError(f"{len(prompt_ids)} prompt ids but {len(turns)} turns")
    return [(prompt, int(turn)) for prompt, turn in zip(prompt_ids, turns)]


def _group_sum(values: torch.Tensor, index: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _valid_mask(valid: torch.Tensor | Sequence[bool] | None, like: torch.Tensor) -> torch.Tensor:
    if valid is None:
        return torch.ones_like(like, dtype=torch.bool)
    valid = torch.as_tensor(valid, dtype=torch.bool, device=like.device)
    _check_same_length(like, valid=valid)
    return valid


@register_advantage("grpo", lambda batch: (batch.returns, batch.prompt_turns, batch.valid))
def grpo_advantages(
    returns: torch.Tensor | Sequence[float],
    group_keys: GroupKeys,
    valid: torch.Tensor | Sequence[bool] | None = None,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Eq. 3: A = G - mean of the valid group, self included (so E[A·score] shrinks by 1 - 1/N).

    With `normalize_std`, divide by the group's standard deviation (Bessel-corrected, as
    verl's GRPO does) plus `eps`: the original GRPO. A group of one gets 0.
    """
    returns = _as_float_tensor(returns)
    _check_same_length(returns, group_keys=group_keys)
    valid = _valid_mask(valid, returns)
    index, n_groups = group_index(group_keys, returns.device)
    weight = valid.to(returns.dtype)
    count = _group_sum(weight, index, n_groups)
    mean = _group_sum(returns * weight, index, n_groups) / count.clamp(min=1)
    advantages = returns - mean[index]
    if normalize_std:
        squares = _group_sum(weight * advantages.square(), index, n_groups)
        std = (squares / (count - 1).clamp(min=1)).sqrt()
        advantages = advantages / (std[index] + eps)
    return torch.where(valid, advantages, torch.zeros_like(advantages))


def leave_one_out_advantages(
    values: torch.Tensor | Sequence[float],
    group_keys: GroupKeys,
    valid: torch.Tensor | Sequence[bool] | None = None,
    singleton: Singleton = "zero",
) -> torch.Tensor:
    """A_i = V_i - mean_{j != i} V_j over the valid members of i's group (RLOO's baseline).

    A group with one valid member has no baseline: its advantage is 0 (the paper's Eq. 5
    needs N > 1) or, with ``singleton="return"``, the value itself (the released code).
    """
    values = _as_float_tensor(values)
    _check_same_length(values, group_keys=group_keys)
    valid = _valid_mask(valid, values)
    index, n_groups = group_index(group_keys, values.device)
    weight = valid.to(values.dtype)
    count = _group_sum(weight, index, n_groups)[index]
    total = _group_sum(values * weight, index, n_groups)[index]
    others_mean = (total - values * weight) / (count - 1).clamp(min=1)
    advantages = values - others_mean
    if singleton == "zero":
        advantages = torch.where(count > 1, advantages, torch.zeros_like(advantages))
    elif singleton != "return":
        raise ValueError(f"singleton must be 'zero' or 'return', got {singleton!r}")
    return torch.where(valid, advantages, torch.zeros_like(advantages))


@register_advantage("trloo", lambda batch: (batch.returns, batch.prompt_turns, batch.valid, batch.singleton))
def trloo_advantages(
    returns: torch.Tensor | Sequence[float],
    group_keys: GroupKeys,
    valid: torch.Tensor | Sequence[bool] | None = None,
    singleton: Singleton = "zero",
) -> torch.Tensor:
    """Eq. 5 (TRLOO): A_{i,t} = G_{i,t} - mean of the other valid returns of (prompt, turn).

    Equals N/(N-1)·(G - mean) and is unbiased (Appendix A). Paper: `valid` = rollouts that
    reached the turn and were not rejected, singleton groups get 0. Released code: pass
    `valid` = every row that exists (filter-rejected rows still count in the baseline)
    and ``singleton="return"`` (a group of one gets A = G).
    """
    return leave_one_out_advantages(returns, group_keys, valid, singleton)


@register_advantage("rloo_trajectory", lambda batch: (batch.rewards, batch.prompt_ids, batch.trajectory_ids,
                                                      batch.valid, batch.singleton), prompt_turn_groups=False)
def rloo_trajectory_advantages(
    rewards: torch.Tensor | Sequence[float],
    prompt_ids: Sequence[Hashable],
    trajectory_ids: Sequence[Hashable],
    valid: torch.Tensor | Sequence[bool] | None = None,
    singleton: Singleton = "zero",
) -> torch.Tensor:
    """Trajectory-level RLOO: each trajectory's summed (valid) rewards, leave-one-out across the
    trajectories of its prompt; every turn row gets its trajectory's advantage."""
    rewards = _as_float_tensor(rewards)
    _check_same_length(rewards, prompt_ids=prompt_ids, trajectory_ids=trajectory_ids)
    valid = _valid_mask(valid, rewards)
    trajectory, n_trajectories = group_index(list(trajectory_ids), rewards.device)
    prompt_of: dict[int, Hashable] = {}
    for row, traj in enumerate(trajectory.tolist()):
        if prompt_of.setdefault(traj, prompt_ids[row]) != prompt_ids[row]:
            raise ValueError(f"trajectory {trajectory_ids[row]!r} spans two prompts")
    prompt_of_trajectory = [prompt_of[traj] for traj in range(n_trajectories)]
    weight = valid.to(rewards.dtype)
    trajectory_return = _group_sum(rewards * weight, trajectory, n_trajectories)
    trajectory_valid = _group_sum(weight, trajectory, n_trajectories) > 0
    advantages = leave_one_out_advantages(trajectory_return, prompt_of_trajectory, trajectory_valid, singleton)
    return torch.where(valid, advantages[trajectory], torch.zeros_like(rewards))


@register_advantage("grpo_std", lambda batch: (batch.returns, batch.prompt_turns, batch.valid))
def grpo_std_advantages(
    returns: torch.Tensor | Sequence[float],
    group_keys: GroupKeys,
    valid: torch.Tensor | Sequence[bool] | None = None,
) -> torch.Tensor:
    """The original GRPO: Eq. 3 divided by the group's standard deviation."""
    return grpo_advantages(returns, group_keys, valid, normalize_std=True)


@register_advantage("kevin", lambda batch: (batch.returns, batch.prompt_ids, batch.valid), prompt_turn_groups=False)
def kevin_advantages(
    returns: torch.Tensor | Sequence[float],
    prompt_ids: Sequence[Hashable],
    valid: torch.Tensor | Sequence[bool] | None = None,
) -> torch.Tensor:
    """Kevin §4: "For each task, we normalize the rewards across the samples for advantage calculation":
    A = (G - mean) / std over every valid row of the task, all its trajectories and turns together
    (not per (prompt, turn) as Eq. 3 / Eq. 5), then the GRPO loss."""
    return grpo_advantages(returns, list(prompt_ids), valid, normalize_std=True)


# ---------------------------------------------------------------------------------------
# Sample filters (Eq. 6, Eq. 9, the released code's masks). True = keep.
# ---------------------------------------------------------------------------------------


def log_geometric_mean_ratio(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log w of Eq. 6 per sequence: the mean over response tokens of log pi_train - log pi_rollout."""
    mask = mask.to(torch.float64)
    log_ratio = (train_logp.to(torch.float64) - rollout_logp.to(torch.float64)) * mask
    return log_ratio.sum(-1) / mask.sum(-1)


def mrs_mask(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    delta: float = MRS_DELTA,
    token_veto: float = MRS_TOKEN_VETO,
) -> torch.Tensor:
    """Eq. 6 (MRS): keep a sequence iff its geometric-mean ratio w is in [1-delta, 1+delta] and
    no token's ratio pi_train/pi_rollout is below `token_veto`. Empty sequences are rejected."""
    mask = mask.to(torch.bool)
    log_w = log_geometric_mean_ratio(train_logp, rollout_logp, mask)
    in_band = (log_w >= math.log1p(-delta)) & (log_w <= math.log1p(delta))
    token_log_ratio = train_logp.to(torch.float64) - rollout_logp.to(torch.float64)
    vetoed = ((token_log_ratio < math.log(token_veto)) & mask).any(-1)
    return in_band & ~vetoed & mask.any(-1)


def _bool_tensor(values: torch.Tensor | Sequence[bool | None]) -> torch.Tensor:
    """Flags from Parquet may be null: a missing flag is False."""
    if isinstance(values, torch.Tensor):
        return values.to(torch.bool)
    return torch.tensor([bool(value) if value is not None else False for value in values], dtype=torch.bool)


def _prs_inputs(
    pr: torch.Tensor | Sequence[float | None],
    correct: torch.Tensor | Sequence[bool],
    hacked: torch.Tensor | Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """PR with missing values as 0 (no profile: no generated-kernel time), and C(y) per row."""
    if not isinstance(pr, torch.Tensor):
        pr = torch.tensor([math.nan if value is None else float(value) for value in pr], dtype=torch.float64)
    pr = torch.nan_to_num(pr.to(torch.float64), nan=0.0)
    eligible = _bool_tensor(correct) & ~_bool_tensor(hacked)
    _check_same_length(pr, eligible=eligible)
    return pr, eligible


def _prs_scoped(keep: torch.Tensor, eligible: torch.Tensor, scope: PRSScope) -> torch.Tensor:
    """Eq. 9 filters every sample (scope "all"); the released code only correct, non-hacked ones ("correct")."""
    if scope == "all":
        return keep
    if scope == "correct":
        return torch.where(eligible, keep, torch.ones_like(keep))
    raise ValueError(f"PRS scope must be one of {PRS_SCOPES}, got {scope!r}")


def prs_keep_probability(
    pr: torch.Tensor | Sequence[float | None],
    correct: torch.Tensor | Sequence[bool],
    hacked: torch.Tensor | Sequence[bool],
    tau: float = PRS_TAU,
    softness: float = PRS_SOFTNESS,
    scope: PRSScope = "all",
) -> torch.Tensor:
    """Eq. 9 (PRS): p_{i,t} = clip((PR_{i,t} - tau) / s, 0, 1) "for each sample (i, t)".

    A missing PR (no profile: an incorrect, hacked or unprofiled kernel) counts as 0, so with the
    paper's scope ``"all"`` such a sample is dropped. ``scope="correct"`` is the released code:
    only correct, non-hacked turns are filtered; the others are kept (p = 1).
    """
    if softness <= 0:
        raise ValueError(f"PRS softness s must be > 0, got {softness} (use prs_hard_keep for a hard cut)")
    pr, eligible = _prs_inputs(pr, correct, hacked)
    return _prs_scoped(((pr - tau) / softness).clamp(0.0, 1.0), eligible, scope)


def prs_hard_keep(
    pr: torch.Tensor | Sequence[float | None],
    correct: torch.Tensor | Sequence[bool],
    hacked: torch.Tensor | Sequence[bool],
    tau: float = PRS_TAU,
    scope: PRSScope = "all",
) -> torch.Tensor:
    """Appendix D ablation "w/o s": keep iff PR >= tau (same scope as `prs_keep_probability`)."""
    pr, eligible = _prs_inputs(pr, correct, hacked)
    return _prs_scoped(pr >= tau, eligible, scope)


def bernoulli_keep(probability: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw keep/drop per row with the given keep probabilities (PRS's sampling step)."""
    return torch.rand(probability.shape, generator=generator, dtype=torch.float64) < probability


def zero_variance_group_mask(
    rewards: torch.Tensor | Sequence[float],
    prompt_ids: Sequence[Hashable],
    trajectory_ids: Sequence[Hashable],
    turns: Sequence[int],
    min_std: float = ZERO_VARIANCE_MIN_STD,
) -> torch.Tensor:
    """Released code: drop every row of a prompt whose trajectories' last-turn rewards have
    (population) std < `min_std` — all advantages there are ~0, so it only adds noise."""
    rewards = _as_float_tensor(rewards)
    _check_same_length(rewards, prompt_ids=prompt_ids, trajectory_ids=trajectory_ids, turns=turns)
    last_reward: dict[Hashable, tuple[int, float]] = {}
    prompt_of: dict[Hashable, Hashable] = {}
    for row, (traj, turn) in enumerate(zip(trajectory_ids, turns)):
        if traj not in last_reward or int(turn) > last_reward[traj][0]:
            last_reward[traj] = (int(turn), float(rewards[row]))
        prompt_of[traj] = prompt_ids[row]
    finals: dict[Hashable, list[float]] = {}
    for traj, (_, reward) in last_reward.items():
        finals.setdefault(prompt_of[traj], []).append(reward)
    keep_prompt = {prompt: torch.tensor(values, dtype=torch.float64).std(correction=0).item() >= min_std
                   for prompt, values in finals.items()}
    return torch.tensor([keep_prompt[prompt] for prompt in prompt_ids], dtype=torch.bool)


def regression_mask(
    rewards: torch.Tensor | Sequence[float],
    trajectory_ids: Sequence[Hashable],
    turns: Sequence[int],
) -> torch.Tensor:
    """Released code: drop a turn that scores 0 after an earlier turn of its trajectory scored > 0
    (a regression is usually a risky rewrite of a working kernel; not punished)."""
    rewards = _as_float_tensor(rewards)
    _check_same_length(rewards, trajectory_ids=trajectory_ids, turns=turns)
    keep = torch.ones(len(rewards), dtype=torch.bool)
    for rows in _rows_by(trajectory_ids).values():
        scored_before = False
        for row in sorted(rows, key=lambda r: int(turns[r])):
            if scored_before and rewards[row] <= 0:
                keep[row] = False
            scored_before = scored_before or bool(rewards[row] > 0)
    return keep


# ---------------------------------------------------------------------------------------
# TritonForge's group buffer (papers/tritonforge.md §3.2.3, slime's rollout buffer): five hooks
# over the items of a group (kpipe: the rows of one (prompt, turn), their returns as rewards)
# ---------------------------------------------------------------------------------------


def tritonforge_group_stats(raw: torch.Tensor | Sequence[float], group_keys: GroupKeys) -> dict[str, float]:
    """Hook 1 (get_group_data_meta_info): what the buffer reports before it touches anything: groups,
    items, mean group size and the raw rewards' mean, (Bessel) std, min and max."""
    raw = _as_float_tensor(raw)
    _check_same_length(raw, group_keys=group_keys)
    _, n_groups = group_index(group_keys, raw.device)
    items = len(raw)
    return {"groups": float(n_groups), "items": float(items), "group_size_mean": items / max(n_groups, 1),
            "reward_mean": float(raw.mean()) if items else 0.0,
            "reward_std": float(raw.std()) if items > 1 else 0.0,
            "reward_min": float(raw.min()) if items else 0.0, "reward_max": float(raw.max()) if items else 0.0}


def _min_items(group_size: int, ratio: float) -> int:
    """The buffer's int(group_size · ratio), at least one item."""
    return max(1, int(group_size * ratio))


def tritonforge_valid_group_mask(
    raw: torch.Tensor | Sequence[float],
    group_keys: GroupKeys,
    group_size: int,
    min_valid_group_ratio: float = TRITONFORGE_MIN_VALID_GROUP_RATIO,
) -> torch.Tensor:
    """Hook 2 (is_valid_group), per row: its group is complete (at least int(group_size · ratio) items)
    and its raw rewards are not all equal (a group without reward diversity has no signal)."""
    raw = _as_float_tensor(raw)
    _check_same_length(raw, group_keys=group_keys)
    index, n_groups = group_index(group_keys, raw.device)
    size = _group_sum(torch.ones_like(raw), index, n_groups)
    low = torch.full((n_groups,), math.inf, dtype=raw.dtype).scatter_reduce(0, index, raw, "amin")
    high = torch.full((n_groups,), -math.inf, dtype=raw.dtype).scatter_reduce(0, index, raw, "amax")
    valid = (size >= _min_items(group_size, min_valid_group_ratio)) & (high > low)
    return valid[index]


def tritonforge_item_mask(statuses: Sequence[str | None]) -> torch.Tensor:
    """Hook 3 (filter_item) as TritonForge describes it: drop an item whose kernel never compiled
    (compile failure) or that broke the format (no code, no Triton kernel, the request failed)."""
    return torch.tensor([kernel_compiled(status) for status in statuses], dtype=torch.bool)


def tritonforge_released_item_mask(raw: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Hook 3 as released (slime's ``default_filter_item``): keep iff 0 <= reward <= 1. Under TritonForge's
    reward every correct kernel faster than 1.7x scores above 1, so none of them reaches training."""
    raw = torch.as_tensor(raw, dtype=torch.float64)  # Python floats exactly: 1 + 1e-9 is outside
    return (raw >= 0.0) & (raw <= 1.0)


def tritonforge_enough_items_mask(
    item_keep: torch.Tensor | Sequence[bool],
    group_keys: GroupKeys,
    group_size: int,
    min_valid_item_ratio: float = TRITONFORGE_MIN_VALID_ITEM_RATIO,
) -> torch.Tensor:
    """The buffer's check between hooks 3 and 4, per row: at least int(group_size · ratio) of its group's
    items survived the filter (else the whole group is dropped)."""
    keep = _bool_tensor(item_keep)
    index, n_groups = group_index(group_keys)
    _check_same_length(keep, group_keys=group_keys)
    survivors = _group_sum(keep.to(torch.float64), index, n_groups)
    return (survivors >= _min_items(group_size, min_valid_item_ratio))[index]


def tritonforge_normalize(
    raw: torch.Tensor | Sequence[float],
    group_keys: GroupKeys,
    valid: torch.Tensor | Sequence[bool],
    eps: float = TRITONFORGE_EPS,
) -> torch.Tensor:
    """Hook 4 (normalize_group_data): (r - mean) / (std + eps) over the valid items of each group only
    (population std); a group whose valid rewards are equal (all 0 included) gets 0, invalid items get 0.
    The raw rewards are not touched: the caller keeps them (TritonForge's ``raw_reward``)."""
    raw = _as_float_tensor(raw)
    _check_same_length(raw, group_keys=group_keys)
    valid = _valid_mask(valid, raw)
    index, n_groups = group_index(group_keys, raw.device)
    weight = valid.to(raw.dtype)
    count = _group_sum(weight, index, n_groups).clamp(min=1)
    mean = _group_sum(raw * weight, index, n_groups) / count
    std = (_group_sum(weight * (raw - mean[index]).square(), index, n_groups) / count).sqrt()
    normalized = torch.where(std[index] < eps, torch.zeros_like(raw), (raw - mean[index]) / (std[index] + eps))
    return torch.where(valid, normalized, torch.zeros_like(raw))


def tritonforge_pad(
    values: torch.Tensor | Sequence[float],
    group_keys: GroupKeys,
    valid: torch.Tensor | Sequence[bool],
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hook 5 (pad_group_data): a group of n valid items becomes exactly `group_size` slots. Each value is
    scaled by group_size / n, then the first group_size - n items are appended again and both copies
    halved, which adds what zero-advantage dummies would (the released code's own reasoning).

    Returns (source row, value) of every slot, groups in order of first appearance. Needs
    n >= group_size / 2 (each item is duplicated at most once; the enough-items check ensures it).
    """
    values = _as_float_tensor(values)
    _check_same_length(values, group_keys=group_keys)
    valid = _valid_mask(valid, values)
    index, _ = group_index(group_keys)
    members: dict[int, list[int]] = {}
    for row, group in enumerate(index.tolist()):
        if valid[row]:
            members.setdefault(group, []).append(row)
    slot_rows: list[int] = []
    slot_values: list[torch.Tensor] = []
    for rows in members.values():
        pad = group_size - len(rows)
        if pad < 0 or pad > len(rows):
            raise ValueError(f"cannot pad a group of {len(rows)} valid items to {group_size} slots")
        scaled = [values[row] * group_size / len(rows) for row in rows]
        halved = [value / 2 if k < pad else value for k, value in enumerate(scaled)]
        slot_rows += rows + rows[:pad]
        slot_values += halved + halved[:pad]
    if not slot_rows:
        return torch.empty(0, dtype=torch.long), values.new_empty(0)
    return torch.tensor(slot_rows, dtype=torch.long), torch.stack(slot_values)


def tritonforge_buffer_values(
    raw: torch.Tensor | Sequence[float],
    group_keys: GroupKeys,
    valid: torch.Tensor | Sequence[bool],
    group_size: int,
    eps: float = TRITONFORGE_EPS,
) -> torch.Tensor:
    """Hooks 4 and 5 per row: the row's normalised, padded value summed over its slots. PPO's loss is
    positively homogeneous in the advantage, so one row with the sum trains as its two halved copies do.
    Invalid rows get 0."""
    normalized = tritonforge_normalize(raw, group_keys, valid, eps)
    rows, slots = tritonforge_pad(normalized, group_keys, valid, group_size)
    return torch.zeros_like(normalized).index_add_(0, rows, slots.to(normalized.dtype))


# ---------------------------------------------------------------------------------------
# Policy loss and monitored quantities
# ---------------------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is set; 0 where nothing is (a fully rejected batch adds no gradient)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def aggregate_loss(loss_per_token: torch.Tensor, mask: torch.Tensor, agg_mode: AggMode) -> torch.Tensor:
    """Reduce a [batch, tokens] loss to a scalar.

    token-mean: every token weighs the same (long responses dominate);
    seq-mean-token-sum: sum within a sequence, mean over sequences (the released code's);
    seq-mean-token-mean: mean within a sequence, mean over sequences (original GRPO).
    Sequence means are over sequences with at least one unmasked token, so rows a filter
    rejected do not dilute the loss (verl averages over every row of the micro-batch).
    """
    mask = mask.to(loss_per_token.dtype)
    if agg_mode == "token-mean":
        return masked_mean(loss_per_token, mask)
    if agg_mode == "seq-mean-token-sum":
        per_sequence = (loss_per_token * mask).sum(-1)
    elif agg_mode == "seq-mean-token-mean":
        per_sequence = masked_mean(loss_per_token, mask, dim=-1)
    else:
        raise ValueError(f"unknown loss aggregation {agg_mode!r}")
    return masked_mean(per_sequence, mask.sum(-1) > 0)


def ppo_clip_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = 3.0,
    agg_mode: AggMode = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate per token, with decoupled clip range [1-eps_low, 1+eps_high]
    (DAPO's clip-higher) and dual clip (negative advantages: loss at most -A·dual_clip).

    `advantages` is per token [batch, tokens] or per sequence [batch]. Returns the scalar
    loss to minimise and stats: clip_frac (tokens where the clip is active), dual_clip_frac
    (tokens where the dual clip binds), approx_kl (mean old_logp - logp).
    """
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    mask = mask.to(torch.bool)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": masked_mean((clipped > unclipped).to(logp.dtype), mask).item()}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -advantages * dual_clip
        dual_bound = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
        stats["dual_clip_frac"] = masked_mean(dual_bound.to(logp.dtype), mask).item()
    stats["approx_kl"] = masked_mean(-log_ratio, mask).item()
    return aggregate_loss(loss, mask, agg_mode), stats


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "low_var_kl") -> torch.Tensor:
    """A per-token estimate of KL(pi_theta || pi_ref) from the sampled tokens' log-probs (Schulman's estimators).

    k1: log pi - log pi_ref (unbiased, can be negative); low_var_kl (k3): exp(r) - r - 1 with r = log pi_ref -
    log pi (unbiased, never negative, lower variance), clamped to [-10, 10] as verl and slime's ``low_var_kl``.
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "low_var_kl":
        log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
        return (log_ratio.exp() - log_ratio - 1.0).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: KLEstimator,
            agg_mode: AggMode) -> torch.Tensor:
    """The KL regulariser added to the policy loss (kl_coef times this), aggregated as the policy loss is."""
    return aggregate_loss(kl_per_token(logp, ref_logp, estimator), mask, agg_mode)


def log_probs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log pi(token) per position: logits [..., vocab], token_ids [...]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax per position: logsumexp(z) - sum softmax(z)·z."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def perplexity(mean_nll: float) -> float:
    """exp(mean negative token log-prob): the rollout (vLLM) and trainer (FSDP) perplexities the
    paper monitors (Figure 7) are this on each engine's log-probs of the same tokens. It takes the
    mean, not the tokens: several processes' token sums are combined first."""
    return math.exp(mean_nll)
