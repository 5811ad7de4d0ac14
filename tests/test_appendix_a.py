"""Monte-Carlo reproduction of the paper's Appendix A (Eq. 4).

A softmax policy over K arms with noisy rewards has the analytic policy gradient
dJ/dtheta_k = pi_k (mu_k - pi·mu). Over many independent groups of N rollouts, the mean
of the per-group estimator g = 1/N sum_i (grad log pi(a_i)) A_i should be
(1 - 1/N)·dJ/dtheta with GRPO's self-including baseline and dJ/dtheta with TRLOO's
leave-one-out baseline. The advantages come from kpipe.train.algos itself.
"""

from __future__ import annotations

import torch

from kpipe.train import algos

THETA = torch.tensor([0.2, -0.3, 0.5], dtype=torch.float64)
MEAN_REWARD = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
REWARD_NOISE = 0.5
N_GROUPS = 50_000
Z = 4.0  # tolerance in standard errors, per gradient component


def analytic_gradient() -> torch.Tensor:
    pi = torch.softmax(THETA, 0)
    return pi * (MEAN_REWARD - pi @ MEAN_REWARD)


def sample_groups(group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Actions, rewards and the score grad log pi(a) = onehot(a) - pi for every rollout."""
    generator = torch.Generator().manual_seed(seed)
    pi = torch.softmax(THETA, 0)
    actions = torch.multinomial(pi, N_GROUPS * group_size, replacement=True, generator=generator)
    noise = torch.randn(N_GROUPS * group_size, generator=generator, dtype=torch.float64)
    rewards = MEAN_REWARD[actions] + REWARD_NOISE * noise
    scores = torch.nn.functional.one_hot(actions, len(THETA)).double() - pi
    return actions, rewards, scores


def per_group_gradients(scores, advantages, group, valid) -> torch.Tensor:
    """g per group = sum over its valid rollouts of score·A, divided by the number of them (Eq. 11)."""
    weighted = scores * advantages.unsqueeze(-1)
    sums = torch.zeros(N_GROUPS, scores.shape[1], dtype=torch.float64).index_add_(0, group, weighted)
    counts = torch.zeros(N_GROUPS, dtype=torch.float64).index_add_(0, group, valid.double())
    return sums / counts.clamp(min=1).unsqueeze(-1)


def mean_and_standard_error(samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return samples.mean(0), samples.std(0) / len(samples) ** 0.5


def test_analytic_gradient_matches_autograd():
    theta = THETA.clone().requires_grad_(True)
    (torch.softmax(theta, 0) @ MEAN_REWARD).backward()
    assert torch.allclose(theta.grad, analytic_gradient())


def test_grpo_is_shrunk_by_one_minus_one_over_n_and_trloo_is_unbiased():
    group_size = 4
    _, rewards, scores = sample_groups(group_size, seed=0)
    group = torch.arange(N_GROUPS).repeat_interleave(group_size)
    valid = torch.ones_like(rewards, dtype=torch.bool)
    true = analytic_gradient()

    grpo, grpo_se = mean_and_standard_error(
        per_group_gradients(scores, algos.grpo_advantages(rewards, group), group, valid))
    trloo, trloo_se = mean_and_standard_error(
        per_group_gradients(scores, algos.trloo_advantages(rewards, group), group, valid))

    assert ((trloo - true).abs() < Z * trloo_se).all(), (trloo, true, trloo_se)
    shrunk = (1 - 1 / group_size) * true
    assert ((grpo - shrunk).abs() < Z * grpo_se).all(), (grpo, shrunk, grpo_se)
    # the shrinkage is real: GRPO misses the true gradient by far more than its noise
    assert ((grpo - true).abs() / grpo_se).max() > 3 * Z


def test_trloo_stays_unbiased_when_group_sizes_vary():
    """Rollouts dropped at random (independently of their actions) leave groups of 1..6 valid
    members. Over groups with at least 2, TRLOO stays unbiased while GRPO shrinks by
    E[1 - 1/N_t] (the paper's argument for TRLOO under varying group sizes)."""
    capacity = 6
    _, rewards, scores = sample_groups(capacity, seed=1)
    group = torch.arange(N_GROUPS).repeat_interleave(capacity)
    generator = torch.Generator().manual_seed(2)
    valid = torch.rand(len(rewards), generator=generator) < 0.6
    counts = torch.zeros(N_GROUPS).index_add_(0, group, valid.float())
    usable = counts >= 2
    true = analytic_gradient()

    trloo_per_group = per_group_gradients(scores, algos.trloo_advantages(rewards, group, valid), group, valid)
    grpo_per_group = per_group_gradients(scores, algos.grpo_advantages(rewards, group, valid), group, valid)
    trloo, trloo_se = mean_and_standard_error(trloo_per_group[usable])
    grpo, grpo_se = mean_and_standard_error(grpo_per_group[usable])

    assert ((trloo - true).abs() < Z * trloo_se).all(), (trloo, true, trloo_se)
    expected_shrink = (1 - 1 / counts[usable].double()).mean()
    assert ((grpo - expected_shrink * true).abs() < Z * grpo_se).all(), (grpo, expected_shrink * true, grpo_se)
