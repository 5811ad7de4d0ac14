"""Each RL formula pinned to the paper's equations on cases computed by hand."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from kpipe.train import algos


def close(actual, expected, tol=1e-6):
    return torch.allclose(torch.as_tensor(actual, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# --- rewards -----------------------------------------------------------------------------


def test_reward_paper_eq1_and_eq8():
    assert algos.reward_paper(True, False, 2.0) == 3.0  # 1 + 2
    assert algos.reward_paper(True, False, 5.0) == 4.0  # speedup clipped at 3
    assert algos.reward_paper(True, False, 0.5) == 1.5  # slower but correct still earns C
    assert algos.reward_paper(True, False, 5.0, pr=0.5, use_pr=True) == 4.5  # Eq. 8: + C·PR
    assert algos.reward_paper(True, False, 2.0, pr=0.9) == 3.0  # PR ignored unless use_pr


def test_rewards_are_zero_when_hacked_or_failed():
    for name, reward in algos.REWARDS.items():
        assert reward(True, True, 2.5) == 0.0, name  # hacked counts as incorrect
        assert reward(False, False, None) == 0.0, name  # failed / timed out: no speedup at all
        assert reward(False, False, 2.5) == 0.0, name


def test_reward_released_code_weighting():
    assert algos.reward_released_code(True, False, 2.0, pr=0.4, use_pr=True) == pytest.approx(0.5 + 1.0 + 0.2)
    assert algos.reward_released_code(True, False, 4.0) == pytest.approx(0.5 + 1.5)


def test_reward_kevin():
    assert algos.reward_kevin(True, False, 2.0) == pytest.approx(2.3)
    assert algos.reward_kevin(True, False, 5.0) == pytest.approx(3.3)
    assert algos.reward_kevin(True, False, 5.0, speedup_cap=math.inf) == pytest.approx(5.3)
    with pytest.raises(ValueError, match="no profiling"):
        algos.reward_kevin(True, False, 1.0, pr=0.5, use_pr=True)


def test_kevin_preset_matches_kevin_32b():
    """Kevin §4.3 / App. B.2: score 0.3·correct + speedup (raw speedup, no cap), the discounted sum of the
    current and later turns' scores with gamma = 0.4; §6: 0 for a kernel using PyTorch functional ops."""
    from kpipe.train.rl_config import RLConfig

    cfg = RLConfig.from_dict({}, "kevin")
    assert (cfg.reward, cfg.gamma, cfg.return_aggregate, cfg.advantage, cfg.history) == (
        "kevin", 0.4, "sum", "kevin", "kevin")
    score = algos.turn_reward(cfg.reward, speedup_cap=cfg.speedup_cap)
    fast = {"correct": True, "hacked": False, "speedup_eager": 5.0, "findings": ["try_except: x (line 2)"]}
    assert score(fast) == pytest.approx(0.3 + 5.0)  # uncapped (the old cap of 3 gave 3.3)
    lazy = {**fast, "findings": ["torch_op_in_forward: torch.nn.functional.conv2d (line 9)"]}
    assert score(lazy) == 0.0
    rewards = [0.3 + 1.1, 0.0, 0.3 + 2.0]
    g = [rewards[0] + 0.4 * rewards[1] + 0.4**2 * rewards[2], rewards[1] + 0.4 * rewards[2], rewards[2]]
    assert close(algos.returns_by_trajectory(rewards, ["t"] * 3, [1, 2, 3], cfg.gamma, cfg.return_aggregate), g)


def test_kevin_advantages_normalise_per_task_over_all_turns():
    """Kevin §4: "For each task, we normalize the rewards across the samples": one group per task, every
    trajectory and turn in it (Eq. 3/5 group by (prompt, turn) instead)."""
    returns = [1.0, 3.0, 2.0, 6.0, 5.0, 9.0]
    tasks = ["a", "a", "a", "a", "b", "b"]
    valid = [True, True, True, False, True, True]
    a = [1.0, 3.0, 2.0]
    mean, std = statistics.fmean(a), statistics.stdev(a)
    expected = [(g - mean) / (std + 1e-6) for g in a] + [0.0]
    b = [5.0, 9.0]
    expected += [(g - statistics.fmean(b)) / (statistics.stdev(b) + 1e-6) for g in b]
    assert close(algos.kevin_advantages(returns, tasks, valid), expected)


def test_reward_tritonforge_tiers():
    reward = algos.reward_tritonforge
    assert reward(False, False, None) == 0.0  # no code / request failed (nothing compiled)
    assert reward(False, True, None, compiled=True) == 0.0  # rejected
    assert reward(False, False, None, compiled=True) == 0.1  # compiles
    assert reward(True, False, 0.5, compiled=True) == 0.3  # correct, slower: no speed bonus
    assert reward(True, False, 1.0) == 0.3
    assert reward(True, False, 1.5) == pytest.approx(0.8)  # 0.3 + (1.5 - 1)
    assert reward(True, False, 1.7) == pytest.approx(1.0)  # the released filter's edge
    assert reward(True, False, 2.0) == pytest.approx(1.3)
    assert reward(True, False, 3.0) == pytest.approx(2.3)  # 0.3 + min(max(s - 1, 0), 2)
    assert reward(True, False, 10.0) == pytest.approx(2.3)
    with pytest.raises(ValueError, match="no profiling"):
        reward(True, False, 1.0, pr=0.5, use_pr=True)


def test_reward_rejects_bad_inputs():
    with pytest.raises(ValueError, match="speedup"):
        algos.reward_paper(True, False, None)
    with pytest.raises(ValueError, match="speedup"):
        algos.reward_paper(True, False, float("nan"))
    with pytest.raises(ValueError, match="profiling ratio"):
        algos.reward_paper(True, False, 1.0, pr=1.5, use_pr=True)
    with pytest.raises(ValueError, match="profiling ratio"):
        algos.reward_paper(True, False, 1.0, pr=None, use_pr=True)
    with pytest.raises(KeyError, match="known: paper"):
        algos.reward_fn("nope")
    assert algos.reward_fn("kevin").fn is algos.reward_kevin


# --- returns -----------------------------------------------------------------------------


def test_reward_to_go_eq2():
    assert close(algos.reward_to_go([1.0, 2.0, 3.0], 1.0), [6.0, 5.0, 3.0])
    assert close(algos.reward_to_go([1.0, 2.0, 3.0], 0.5), [2.75, 3.5, 3.0])
    assert close(algos.reward_to_go([1.0, 2.0, 3.0], 0.0), [1.0, 2.0, 3.0])  # the gamma = 0 ablation
    # batched, with a shorter trajectory padded by zeros
    assert close(algos.reward_to_go(torch.tensor([[1.0, 2.0, 0.0], [1.0, 1.0, 1.0]])), [[3, 2, 0], [3, 2, 1]])
    with pytest.raises(ValueError, match="gamma"):
        algos.reward_to_go([1.0], 1.5)


def test_kevin_returns():
    assert close(algos.kevin_return([1.0, 0.0, 2.0]), [1.32, 0.8, 2.0])  # sum, gamma = 0.4
    assert close(algos.discounted_max_return([1.0, 0.0, 2.0]), [1.0, 0.8, 2.0])  # max, gamma = 0.4


def test_returns_by_trajectory_on_shuffled_rows():
    rewards = [3.0, 1.0, 5.0, 2.0, 0.0]
    trajectories = ["a", "a", "b", "a", "b"]
    turns = [3, 1, 1, 2, 2]
    assert close(algos.returns_by_trajectory(rewards, trajectories, turns), [3.0, 6.0, 5.0, 5.0, 0.0])
    assert close(algos.returns_by_trajectory(rewards, trajectories, turns, 0.4, "max"), [3.0, 1.0, 5.0, 2.0, 0.0])
    with pytest.raises(ValueError, match="repeated turn"):
        algos.returns_by_trajectory([1.0, 2.0], ["a", "a"], [1, 1])


# --- advantages --------------------------------------------------------------------------

RETURNS = [1.0, 2.0, 3.0, 6.0]
GROUP = [("p", 1)] * 4


def test_grpo_eq3():
    assert close(algos.grpo_advantages(RETURNS, GROUP), [-2.0, -1.0, 0.0, 3.0])  # mean 3
    std = math.sqrt((4 + 1 + 0 + 9) / 3)
    assert close(algos.grpo_advantages(RETURNS, GROUP, normalize_std=True, eps=0.0),
                 [-2 / std, -1 / std, 0.0, 3 / std])


def test_trloo_eq5_and_its_closed_form():
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]  # G_i - mean of the other three
    assert close(algos.trloo_advantages(RETURNS, GROUP), expected)
    assert close(expected, [4 / 3 * a for a in (-2.0, -1.0, 0.0, 3.0)])  # N/(N-1)·(G - mean)


def test_invalid_rows_are_left_out_of_the_baseline():
    returns = RETURNS + [100.0]
    group = GROUP + [("p", 1)]
    valid = [True, True, True, True, False]
    assert close(algos.trloo_advantages(returns, group, valid), [-8 / 3, -4 / 3, 0.0, 4.0, 0.0])
    assert close(algos.grpo_advantages(returns, group, valid), [-2.0, -1.0, 0.0, 3.0, 0.0])


def test_trloo_paper_vs_released_code_variants():
    # the row with return 6 was rejected by a filter
    paper = algos.trloo_advantages(RETURNS, GROUP, valid=[True, True, True, False])
    assert close(paper, [1 - 2.5, 0.0, 3 - 1.5, 0.0])
    released = algos.trloo_advantages(RETURNS, GROUP, singleton="return")  # rejected row still in the baseline
    assert close(released, [-8 / 3, -4 / 3, 0.0, 4.0])
    # singleton groups: no baseline in the paper (A = 0), A = G in the released code
    assert close(algos.trloo_advantages([5.0], [("q", 2)]), [0.0])
    assert close(algos.trloo_advantages([5.0], [("q", 2)], singleton="return"), [5.0])
    assert close(algos.grpo_advantages([5.0], [("q", 2)], normalize_std=True), [0.0])
    with pytest.raises(ValueError, match="singleton"):
        algos.trloo_advantages([5.0], [("q", 2)], singleton="one")


def test_groups_are_keyed_by_prompt_and_turn():
    prompts = ["p", "p", "p", "p", "q", "q"]
    turns = [1, 1, 2, 2, 1, 1]
    returns = [1.0, 3.0, 10.0, 20.0, 4.0, 4.0]
    keys = algos.prompt_turn_keys(prompts, turns)
    expected = [-2.0, 2.0, -10.0, 10.0, 0.0, 0.0]
    assert close(algos.trloo_advantages(returns, keys), expected)
    tensor_keys = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 2], [1, 1], [1, 1]])
    assert close(algos.trloo_advantages(returns, tensor_keys), expected)  # fast path agrees
    with pytest.raises(ValueError, match="rows"):
        algos.trloo_advantages(returns, keys[:-1])


def test_rloo_trajectory_advantages():
    rewards = [1.0, 2.0, 0.0, 0.0, 3.0, 7.0]
    prompts = ["A", "A", "A", "A", "A", "B"]
    trajectories = ["a1", "a1", "a2", "a2", "a3", "b1"]
    # trajectory returns a1 = 3, a2 = 0, a3 = 3; b1 is alone
    advantages = algos.rloo_trajectory_advantages(rewards, prompts, trajectories)
    assert close(advantages, [1.5, 1.5, -3.0, -3.0, 1.5, 0.0])
    with pytest.raises(ValueError, match="spans two prompts"):
        algos.rloo_trajectory_advantages([1.0, 1.0], ["A", "B"], ["t", "t"])


# --- filters -----------------------------------------------------------------------------


def test_mrs_eq6():
    rollout = torch.full((6, 2), -1.0)
    log_ratio = torch.tensor([
        [0.0, 0.0],  # identical engines: keep
        [0.002, 0.002],  # w = e^0.002 > 1.001: reject
        [0.0005, -0.0005],  # w = 1: keep
        [math.log(1e-5), -math.log(1e-5)],  # w = 1 but one token ratio < 1e-4: vetoed
        [math.log(0.9995), math.log(1e-9)],  # the vetoing token is masked out: keep (w = 0.9995)
        [0.0, 0.0],  # no response tokens: reject
    ])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0], [0, 0]])
    keep = algos.mrs_mask(rollout + log_ratio, rollout, mask)
    assert keep.tolist() == [True, False, True, False, True, False]
    w = algos.log_geometric_mean_ratio(rollout + log_ratio, rollout, mask)[:5].exp()
    assert close(w, [1.0, math.exp(0.002), 1.0, 1.0, 0.9995])


def test_prs_eq9_soft_and_hard():
    pr = [0.2, 0.3, 0.35, 0.4, 0.9, None, 0.0, 0.9]
    correct = [True] * 6 + [False, True]
    hacked = [False] * 6 + [None, True]  # a null flag (Parquet) is False
    p = algos.prs_keep_probability(pr, correct, hacked)
    assert close(p, [0.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0, 1.0])  # Eq. 9 on every sample: PR alone decides
    p_code = algos.prs_keep_probability(pr, correct, hacked, scope="correct")
    assert close(p_code, [0.0, 0.0, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0])  # released code: incorrect / hacked kept
    hard = algos.prs_hard_keep(pr, correct, hacked, scope="correct")
    assert hard.tolist() == [False, True, True, True, True, False, True, True]
    with pytest.raises(ValueError, match="softness"):
        algos.prs_keep_probability(pr, correct, hacked, softness=0.0)
    with pytest.raises(ValueError, match="scope"):
        algos.prs_keep_probability(pr, correct, hacked, scope="some")


def test_prs_default_scope_is_eq9_for_every_sample():
    """Eq. 9: "For each sample (i, t), we retain it with probability clip((PR - tau)/s, 0, 1)". An
    incorrect turn has no profile (PR = 0 < tau): p = 0 (the old default kept it with p = 1)."""
    tau, s = 0.3, 0.1
    pr, correct, hacked = [None, 0.05, 0.37, None], [False, True, True, True], [False, False, False, True]
    expected = [min(max(((value or 0.0) - tau) / s, 0.0), 1.0) for value in pr]
    assert close(algos.prs_keep_probability(pr, correct, hacked), expected)
    assert algos.prs_hard_keep(pr, correct, hacked).tolist() == [False, False, True, False]


def test_bernoulli_keep_frequency():
    generator = torch.Generator().manual_seed(0)
    assert algos.bernoulli_keep(torch.tensor([0.0, 1.0]), generator).tolist() == [False, True]
    draws = algos.bernoulli_keep(torch.full((20000,), 0.25), generator).double()
    assert abs(draws.mean().item() - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 20000)


def test_zero_variance_group_mask():
    rewards = [0.0, 2.0, 1.0, 2.0, 0.0, 1.0]
    prompts = ["A", "A", "A", "A", "B", "B"]
    trajectories = ["a1", "a1", "a2", "a2", "b1", "b2"]
    turns = [1, 2, 1, 2, 1, 1]
    # A's last-turn rewards are 2 and 2 (std 0): dropped although earlier turns differ
    keep = algos.zero_variance_group_mask(rewards, prompts, trajectories, turns)
    assert keep.tolist() == [False, False, False, False, True, True]


def test_regression_mask():
    rewards = [0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    trajectories = ["a"] * 5 + ["b"] * 2
    turns = [1, 2, 3, 4, 5, 1, 2]
    assert algos.regression_mask(rewards, trajectories, turns).tolist() == [True, True, False, True, False, True, True]


# --- policy loss -------------------------------------------------------------------------


def test_ppo_clip_dual_clip_by_hand():
    ratio = torch.tensor([[1.5, 0.5, 0.5, 5.0, 1.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    old = torch.zeros(1, 5)
    # per token: max(-A r, -A clip(r, 0.8, 1.28)), then min(., 3) where A < 0
    expected = torch.tensor([-1.28, -0.5, 0.8, 3.0, 1.0])
    loss, stats = algos.ppo_clip_policy_loss(ratio.log(), old, advantages, torch.ones(1, 5))
    assert loss.item() == pytest.approx(expected.mean().item())
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["dual_clip_frac"] == pytest.approx(1 / 5)
    loss_no_dual, _ = algos.ppo_clip_policy_loss(ratio.log(), old, advantages, torch.ones(1, 5), dual_clip=None)
    assert loss_no_dual.item() == pytest.approx((expected.sum().item() - 3.0 + 5.0) / 5)


def test_loss_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third row rejected by a filter
    assert algos.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    # at ratio 1 the policy loss is -A per token: the same reductions apply
    logp = torch.zeros(3, 3)
    pg, _ = algos.ppo_clip_policy_loss(logp, logp, -loss, mask, agg_mode="seq-mean-token-sum")
    assert pg.item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="aggregation"):
        algos.aggregate_loss(loss, mask, "sum")


def test_policy_gradient_at_ratio_one_is_minus_advantage():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])  # per sequence
    loss, _ = algos.ppo_clip_policy_loss(logp, logp.detach(), advantages, torch.ones(2, 2))
    loss.backward()
    assert close(logp.grad, [[-0.5, -0.5], [0.25, 0.25]])  # -A / number of tokens


def test_entropy_logprobs_perplexity():
    assert algos.entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    two = torch.tensor([0.0, math.log(3.0)])  # probabilities 0.25, 0.75
    assert algos.entropy_from_logits(two).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    logp = algos.log_probs_from_logits(two.expand(2, 2), torch.tensor([0, 1]))
    assert close(logp, [math.log(0.25), math.log(0.75)])
    assert algos.perplexity(-(math.log(0.5) + math.log(0.25)) / 2) == pytest.approx(1 / math.sqrt(0.125))
    assert algos.masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0


def test_advantage_registry_one_signature():
    """Every estimator is called with one AdvantageBatch and gives what its function gives."""
    prompts, turns, trajectories = ["a", "a", "a", "b", "b", "b"], [1, 1, 2, 1, 1, 1], [0, 1, 0, 2, 3, 4]
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0, 1.0, 0.0], dtype=torch.float64)
    returns = torch.tensor([3.0, 0.0, 2.0, 3.0, 1.0, 0.0], dtype=torch.float64)
    valid = torch.tensor([True, True, True, True, False, True])
    batch = algos.AdvantageBatch(returns, rewards, prompts, trajectories, turns, valid, singleton="return")
    keys = algos.prompt_turn_keys(prompts, turns)
    expected = {
        "trloo": algos.trloo_advantages(returns, keys, valid, "return"),
        "grpo": algos.grpo_advantages(returns, keys, valid),
        "grpo_std": algos.grpo_advantages(returns, keys, valid, normalize_std=True),
        "rloo_trajectory": algos.rloo_trajectory_advantages(rewards, prompts, trajectories, valid, "return"),
        "kevin": algos.kevin_advantages(returns, prompts, valid),
    }
    assert set(algos.ADVANTAGES) == set(expected)
    for name, advantages in expected.items():
        assert torch.equal(algos.advantage_fn(name)(batch), advantages), name
    assert algos.advantage_fn("trloo").fn is algos.trloo_advantages
    assert [name for name, e in algos.ADVANTAGES.items() if not e.prompt_turn_groups] == ["rloo_trajectory", "kevin"]
    with pytest.raises(KeyError, match="known: grpo, trloo"):
        algos.advantage_fn("ppo")
    with pytest.raises(ValueError, match="registered twice"):
        algos.register_advantage("grpo", lambda batch: ())(algos.grpo_advantages)


def test_every_configured_advantage_resolves_through_the_registry():
    """RLConfig's choices, the ablations' and the config files' `rl.advantage`, and the config schema's
    enum are the registry's names."""
    from pathlib import Path

    import yaml

    from kpipe.train.rl_config import ABLATIONS, RLConfig

    root = Path(__file__).resolve().parents[1]
    schema = yaml.safe_load((root / "workflow" / "schemas" / "config.schema.yaml").read_text())
    enum = schema["properties"]["rl"]["properties"]["advantage"]["enum"]
    assert sorted(enum) == sorted(algos.ADVANTAGES)
    configured = {RLConfig().advantage} | {overlay["advantage"] for overlay in ABLATIONS.values() if "advantage" in overlay}
    for path in (root / "config").rglob("*.yaml"):
        rl = (yaml.safe_load(path.read_text()) or {}).get("rl") or {}
        configured |= {rl["advantage"]} if "advantage" in rl else set()
    assert configured >= {"trloo", "grpo", "kevin"}
    for name in configured:
        assert algos.advantage_fn(name).name == name
        assert RLConfig(advantage=name).advantage == name
    with pytest.raises(ValueError, match="advantage must be one of"):
        RLConfig(advantage="ppo")
    with pytest.raises(ValueError, match="use it with grpo, trloo, grpo_std"):
        RLConfig(advantage="kevin", buffer="tritonforge")


def test_turn_reward_reads_kernelgym_results():
    from types import SimpleNamespace as EvalResult  # attribute access, like kpipe.gym's EvalResult

    result = EvalResult(status="pass", correct=True, hacked=False, speedup_eager=2.0, speedup_compile=0.5, pr=0.25)
    assert algos.turn_reward("paper")(result) == 3.0
    assert algos.turn_reward("paper", use_pr=True, baseline="compile")(result) == 1.75
    assert algos.turn_reward("released_code", use_pr=True)({"correct": True, "hacked": False, "speedup_eager": 4.0,
                                                            "pr": 0.5}) == pytest.approx(0.5 + 1.5 + 0.25)
    assert algos.turn_reward("kevin")(None) == 0.0  # nothing to evaluate (format error)
    hacked = EvalResult(status="hacked", correct=True, hacked=True, speedup_eager=9.0, pr=None)
    assert algos.turn_reward("paper")(hacked) == 0.0


def test_turn_reward_tritonforge_reads_compilation_from_the_status():
    score = algos.turn_reward("tritonforge")
    turn = {"correct": False, "hacked": False, "speedup_eager": None, "pr": None}
    assert score({**turn, "status": "mismatch"}) == 0.1
    assert score({**turn, "status": "runtime_error"}) == 0.1
    for status in ("compilation_error", "format_error", "generation_error"):
        assert score({**turn, "status": status}) == 0.0, status
    assert score({**turn, "status": "hacked", "hacked": True}) == 0.0
    assert score({**turn, "status": "pass", "correct": True, "speedup_eager": 2.5}) == pytest.approx(1.8)
    assert score(None) == 0.0


# --- TritonForge's group buffer ----------------------------------------------------------

# One group of 8 rollouts (a prompt at a turn): status, speedup, and TritonForge's reward of each.
TF_STATUSES = ["format_error", "compilation_error", "mismatch", "hacked", "pass", "pass", "pass", "pass"]
TF_SPEEDUPS = [None, None, None, 3.0, 0.5, 1.5, 2.0, 4.0]
TF_REWARDS = [0.0, 0.0, 0.1, 0.0, 0.3, 0.8, 1.3, 2.3]
TF_GROUP = [("p", 1)] * 8


def test_tritonforge_group_rewards_are_the_tiers():
    score = algos.turn_reward("tritonforge")
    rewards = [score({"status": status, "correct": status == "pass", "hacked": status == "hacked",
                      "speedup_eager": speedup, "pr": None}) for status, speedup in zip(TF_STATUSES, TF_SPEEDUPS)]
    assert rewards == pytest.approx(TF_REWARDS)


def test_tritonforge_filters_which_items_each_keeps():
    described = algos.tritonforge_item_mask(TF_STATUSES)
    released = algos.tritonforge_released_item_mask(TF_REWARDS)
    # as described: drop compile failures and format violations; every fast kernel stays
    assert described.tolist() == [False, False, True, True, True, True, True, True]
    # as released: drop rewards outside [0, 1], i.e. the 2x and 4x kernels (anything faster than 1.7x)
    assert released.tolist() == [True, True, True, True, True, True, False, False]
    assert algos.tritonforge_released_item_mask([1.0, 1.0 + 1e-9, -0.1]).tolist() == [True, False, False]


def test_tritonforge_group_checks():
    # hook 2: complete (>= group_size * ratio items) and not all rewards equal
    assert algos.tritonforge_valid_group_mask(TF_REWARDS, TF_GROUP, 8).all()
    assert not algos.tritonforge_valid_group_mask(TF_REWARDS[:7], TF_GROUP[:7], 8).any()  # one missing
    assert algos.tritonforge_valid_group_mask(TF_REWARDS[:7], TF_GROUP[:7], 8, 0.7).all()
    assert not algos.tritonforge_valid_group_mask([0.3] * 8, TF_GROUP, 8).any()  # no reward diversity
    # between hooks 3 and 4: int(8 * 0.7) = 5 survivors needed
    assert algos.tritonforge_enough_items_mask([True] * 5 + [False] * 3, TF_GROUP, 8).all()
    assert not algos.tritonforge_enough_items_mask([True] * 4 + [False] * 4, TF_GROUP, 8).any()
    stats = algos.tritonforge_group_stats(TF_REWARDS, TF_GROUP)
    assert stats["groups"] == 1 and stats["items"] == 8 and stats["reward_max"] == pytest.approx(2.3)
    assert stats["reward_mean"] == pytest.approx(sum(TF_REWARDS) / 8)
    assert stats["reward_std"] == pytest.approx(statistics.stdev(TF_REWARDS))


@pytest.mark.parametrize("mask", ["described", "released"])
def test_tritonforge_normalize_and_pad_over_the_valid_items_only(mask):
    keep = (algos.tritonforge_item_mask(TF_STATUSES) if mask == "described"
            else algos.tritonforge_released_item_mask(TF_REWARDS))
    valid = [r for r, k in zip(TF_REWARDS, keep.tolist()) if k]
    mean, std = statistics.fmean(valid), statistics.pstdev(valid)
    expected = [(r - mean) / (std + algos.TRITONFORGE_EPS) if k else 0.0 for r, k in zip(TF_REWARDS, keep.tolist())]
    normalized = algos.tritonforge_normalize(TF_REWARDS, TF_GROUP, keep)
    assert close(normalized, expected)
    # padding 6 valid items to 8 slots: scale by 8/6, repeat the first two with both copies halved
    rows, slots = algos.tritonforge_pad(normalized, TF_GROUP, keep, 8)
    kept_rows = [i for i, k in enumerate(keep.tolist()) if k]
    assert rows.tolist() == kept_rows + kept_rows[:2]
    scaled = [expected[i] * 8 / 6 for i in kept_rows]
    assert close(slots, [scaled[0] / 2, scaled[1] / 2, *scaled[2:], scaled[0] / 2, scaled[1] / 2])
    # per row, the slots add up to the scaled value: what the trainer uses
    per_row = algos.tritonforge_buffer_values(TF_REWARDS, TF_GROUP, keep, 8)
    assert close(per_row, [value * 8 / 6 for value in expected])
    # GRPO on top (mean-centring over the same items) changes nothing: the values have mean 0
    assert close(algos.grpo_advantages(per_row, TF_GROUP, keep), per_row)
    fastest_trained = max(TF_SPEEDUPS[i] for i in kept_rows if TF_STATUSES[i] == "pass")
    assert fastest_trained == (1.5 if mask == "released" else 4.0)  # released: nothing above 1.7x trains


def test_tritonforge_normalize_equal_rewards_give_zero_and_pad_needs_half_the_group():
    assert close(algos.tritonforge_normalize([0.0, 0.0, 0.0], [1, 1, 1], [True] * 3), [0.0] * 3)
    assert close(algos.tritonforge_normalize([0.3, 0.3, 5.0], [1, 1, 1], [True, True, False]), [0.0] * 3)
    # two groups: the full one is only scaled by 1
    rows, slots = algos.tritonforge_pad([1.0, -1.0, 2.0, -2.0], ["a", "a", "b", "b"], [True] * 4, 2)
    assert rows.tolist() == [0, 1, 2, 3] and close(slots, [1.0, -1.0, 2.0, -2.0])
    with pytest.raises(ValueError, match="cannot pad a group of 1 valid items to 4 slots"):
        algos.tritonforge_pad([1.0, 0.0], [1, 1], [True, False], 4)


def test_prs_hard_keeps_pr_exactly_at_tau_from_python_floats():
    """PR arrives as Python floats; a float32 round trip would put 0.9 below tau = 0.9."""
    keep = algos.prs_hard_keep([0.9], [True], [False], tau=0.9)
    assert keep.tolist() == [True]


def test_kl_estimators_are_schulmans_k1_and_k3():
    """k1 = log(pi/pi_ref), k3 = pi_ref/pi - log(pi_ref/pi) - 1 per sampled token; both average to
    KL(pi || pi_ref) over tokens drawn from pi, k3 with lower variance and never below 0."""
    torch.manual_seed(0)
    pi = torch.softmax(0.5 * torch.randn(5, dtype=torch.float64), -1)  # close enough that no estimate hits the clamp
    ref = torch.softmax(0.5 * torch.randn(5, dtype=torch.float64), -1)
    exact = float((pi * (pi / ref).log()).sum())
    tokens = torch.multinomial(pi, 200000, replacement=True, generator=torch.Generator().manual_seed(1))
    logp, ref_logp = pi.log()[tokens], ref.log()[tokens]
    k1, k3 = algos.kl_per_token(logp, ref_logp, "k1"), algos.kl_per_token(logp, ref_logp, "low_var_kl")
    assert close(k1.mean(), exact, tol=0.01) and close(k3.mean(), exact, tol=0.01)
    assert bool((k3 >= 0).all()) and float(k3.var()) < float(k1.var())
    ratio = (ref / pi)[tokens[:3]]
    assert close(k3[:3], ratio - ratio.log() - 1)
    mask = torch.tensor([[1, 1, 0]])
    lp, rp = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    assert close(algos.kl_loss(lp, rp, mask, "k1", "seq-mean-token-sum"), [0.5 + -1.0])
    with pytest.raises(ValueError, match="KL estimator"):
        algos.kl_per_token(lp, rp, "k2")
