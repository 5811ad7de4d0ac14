"""RL iteration machinery (kpipe.train.rl, kpipe.train.rl_config): config, filters, advantages on
hand-computed rows, trainer/rollout log-prob agreement, gradient accumulation, kill-and-resume."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from kpipe.agent.evaluator import LocalEvaluator
from kpipe.agent.loop import AgentTask
from kpipe.data.io import read_table, write_table
from kpipe.infra.jobs import JOBS_MODULE, write_job_file
from kpipe.infra.launch import NodeInfo, accelerate_command, free_port
from kpipe.llm.hf_engine import HFEngine
from kpipe.llm.types import ChatRequest
from kpipe.train import algos, rl, rl_batch, rl_update, rollouts
from kpipe.train.rl_config import ABLATIONS, AGG_MODES, IterationSettings, RLConfig, with_ablation

REPO = Path(__file__).resolve().parents[1]
RELU = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.rand(4, 4)]

def get_init_inputs():
    return []
'''


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def nano_model(tmp_path_factory) -> Path:
    """The default config's policy (nano, BPE of 4,000 tokens): a prompt is ~240 tokens where the byte
    tokenizer made it ~3,300, and attention over those lengths was most of this module's time."""
    from kpipe.train.tiny_model import build_tiny_model, policy_corpus

    return build_tiny_model(tmp_path_factory.mktemp("nano") / "model", seed=0, size="nano", corpus=policy_corpus(),
                            vocab_size=4000)


# ----------------------------------------------------------------------------- config


def test_defaults_are_the_papers_settings():
    cfg = RLConfig()
    assert (cfg.rollouts_per_prompt, cfg.prompts_per_step, cfg.max_turns, cfg.gamma) == (16, 16, 3, 1.0)
    assert (cfg.advantage, cfg.lr, cfg.eps_low, cfg.eps_high, cfg.dual_clip) == ("trloo", 1e-6, 0.2, 0.28, 3.0)
    assert (cfg.loss_agg, cfg.mrs_delta, cfg.mrs_token_veto, cfg.prs_tau, cfg.prs_softness) == (
        "seq-mean-token-sum", 1e-3, 1e-4, 0.3, 0.1)
    assert cfg.hacking_check and not (cfg.mrs or cfg.use_pr or cfg.prs)


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_an_ablation_changes_exactly_its_keys(name):
    base, ablated = dataclasses.asdict(RLConfig()), dataclasses.asdict(with_ablation(RLConfig(), name))
    changed = {key for key in base if base[key] != ablated[key]}
    assert changed == set(ABLATIONS[name])
    assert RLConfig.from_dict({"ablation": name}) == with_ablation(RLConfig(), name)


@pytest.mark.parametrize("values, message", [
    ({"advantage": "ppo"}, "advantage must be one of"),
    ({"gamma": 1.5}, "gamma must be in"),
    ({"reward": "kevin", "use_pr": True}, "no PR term"),
    ({"reward": "tritonforge", "use_pr": True}, "tritonforge reward has no PR term"),
    ({"buffer": "tritonforge", "advantage": "rloo_trajectory"}, "buffer normalises"),
    ({"buffer_min_valid_item_ratio": 0.4}, "padding repeats each item at most once"),
    ({"buffer": "grpo"}, "buffer must be one of"),
    ({"learning_rate": 1e-6}, "unknown key"),
    ({"ablation": "w/o everything"}, "unknown ablation"),
    ({"max_turns": "3"}, "max_turns must be int"),
])
def test_bad_settings_fail_with_one_line(values, message):
    with pytest.raises(ValueError, match=message):
        RLConfig.from_dict(values)


def test_ablation_overlay_files_name_the_papers_ablations():
    files = sorted((REPO / "config" / "ablations").glob("*.yaml"))
    runs: dict[str, dict] = {}
    for path in files:
        runs.update(yaml.safe_load(path.read_text())["rl"]["runs"])
    assert set(runs) == set(ABLATIONS)
    for name, overlay in runs.items():  # a preset may add its batch shape (kevin.yaml: 8 x 16 x 4)
        shape = {key: value for key, value in overlay.items() if key != "ablation"}
        assert not set(shape) & set(ABLATIONS[name])
        assert RLConfig.from_dict(overlay) == with_ablation(RLConfig(**shape), name)


# ----------------------------------------------------------------------------- filters and advantages


def turn_row(task: str, sample: int, turn: int, reward: float, **fields) -> dict:
    return {"task_id": task, "sample": sample, "turn": turn, "reward": reward, "correct": reward > 0, "hacked": False,
            "pr": None, **fields}


def batch_of(rows: list[dict], **fields) -> rl_batch.StepBatch:
    """A step's batch of `rows` (one token each), with the phases' `fields` already filled."""
    batch = rl_batch.StepBatch(rows=rows, samples=[rl_batch.TokenSample([1], [1]) for _ in rows], pad_id=0,
                               rewards=torch.tensor([float(row["reward"]) for row in rows], dtype=torch.float64),
                               has_tokens=torch.ones(len(rows), dtype=torch.bool), rollout_logp=[[0.0] for _ in rows])
    for name, value in fields.items():
        setattr(batch, name, value)
    return batch


def filtered(batch: rl_batch.StepBatch, cfg: RLConfig, generator: torch.Generator | None = None) -> rl_batch.StepBatch:
    """The returns and filters phases on `batch`, as the loop runs them."""
    batch.returns = rl_batch.returns(batch, cfg)
    batch.masks = rl_batch.buffer_masks(batch, cfg) | rl_batch.filter_masks(batch, cfg, generator or torch.Generator())
    batch.reasons = rl_batch.rejection_reasons(batch.has_tokens, batch.masks)
    batch.kept = torch.tensor([reason is None for reason in batch.reasons])
    return batch


def test_regression_rows_are_rejected_and_left_out_of_the_trloo_baseline():
    # one prompt, three trajectories of two turns; trajectory 0 regresses at turn 2
    rows = [turn_row("a", 0, 1, 2.0), turn_row("a", 0, 2, 0.0),
            turn_row("a", 1, 1, 0.0), turn_row("a", 1, 2, 1.0),
            turn_row("a", 2, 1, 0.0), turn_row("a", 2, 2, 3.0)]
    cfg = RLConfig(regression_filter=True)
    batch = filtered(batch_of(rows), cfg)
    assert batch.reasons == [None, "regression", None, None, None, None]
    assert batch.returns.tolist() == [2.0, 0.0, 1.0, 1.0, 3.0, 3.0]  # gamma = 1: reward-to-go
    advantages = rl_batch.advantages(batch, cfg)
    # turn 1: G = (2, 1, 3): A_i = G_i - mean of the other two
    assert advantages[[0, 2, 4]].tolist() == pytest.approx([2 - 2.0, 1 - 2.5, 3 - 1.5])
    # turn 2: trajectory 0 is rejected, so the group is (1, 3): A = G - the other one
    assert advantages[[1, 3, 5]].tolist() == pytest.approx([0.0, 1 - 3, 3 - 1])
    # the released code's variant: rejected rows still count in the baseline
    released = rl_batch.advantages(batch, dataclasses.replace(cfg, baseline_includes_rejected=True))
    assert released[[3, 5]].tolist() == pytest.approx([1 - 1.5, 3 - 0.5])


def test_gamma_zero_and_grpo_are_what_their_equations_say():
    rows = [turn_row("a", 0, 1, 1.0), turn_row("a", 0, 2, 2.0), turn_row("a", 1, 1, 0.0), turn_row("a", 1, 2, 0.0)]
    cfg = RLConfig(gamma=0.0, advantage="grpo")
    batch = filtered(batch_of(rows), cfg)
    assert batch.returns.tolist() == [1.0, 2.0, 0.0, 0.0]
    advantages = rl_batch.advantages(batch, cfg)
    assert advantages.tolist() == pytest.approx([0.5, 1.0, -0.5, -1.0])  # Eq. 3: G - group mean, self included


@pytest.mark.parametrize("buffer", ["tritonforge", "tritonforge_released"])
def test_tritonforge_buffer_rows_kept_and_their_advantages(buffer):
    # prompt a: 4 rollouts of one turn (TritonForge rewards: compile error, compiles, correct, 2x faster);
    # prompt b: every rollout correct at the same speed, so no reward diversity
    statuses = ["compilation_error", "mismatch", "pass", "pass"]
    rows = [turn_row("a", i, 1, r, status=s) for i, (r, s) in enumerate(zip([0.0, 0.1, 0.3, 1.3], statuses))]
    rows += [turn_row("b", i, 1, 0.3, status="pass") for i in range(4)]
    cfg = dataclasses.replace(with_ablation(RLConfig(), buffer), rollouts_per_prompt=4)  # groups of 4 here (TritonForge: 8)
    batch = filtered(batch_of(rows), cfg)
    reasons = batch.reasons
    dropped = "buffer_item"
    if buffer == "tritonforge":  # the compile error is filtered; the 2x kernel trains
        assert reasons[:4] == [dropped, None, None, None]
        kept = [0.1, 0.3, 1.3]
    else:  # the released filter drops the 2x kernel (reward 1.3 > 1) and keeps the compile error
        assert reasons[:4] == [None, None, None, dropped]
        kept = [0.0, 0.1, 0.3]
    assert reasons[4:] == ["buffer_group"] * 4
    kept_mask = batch.kept
    advantages = rl_batch.advantages(batch, cfg)
    mean, std = statistics.fmean(kept), statistics.pstdev(kept)
    expected = iter([(r - mean) / (std + 1e-8) * 4 / 3 for r in kept])  # z-score, padded from 3 to 4 slots
    assert advantages[:4].tolist() == pytest.approx([next(expected) if k else 0.0 for k in kept_mask[:4]])
    assert advantages[4:].tolist() == [0.0] * 4
    assert rl_batch.buffer_masks(batch, RLConfig()) == {}


def test_prs_filters_every_turn_by_its_profiling_ratio_and_the_released_scope_only_correct_ones():
    rows = [turn_row("a", 0, 1, 2.0, pr=0.05), turn_row("a", 1, 1, 2.0, pr=0.9), turn_row("a", 2, 1, 0.0)]
    batch = batch_of(rows, mrs_keep=torch.ones(3, dtype=torch.bool))
    masks = rl_batch.filter_masks(batch, RLConfig(prs=True), torch.Generator().manual_seed(0))
    assert masks["prs"].tolist() == [False, True, False]  # Eq. 9 on every sample; incorrect: PR = 0
    code = rl_batch.filter_masks(batch, RLConfig(prs=True, prs_scope="correct"), torch.Generator().manual_seed(0))
    assert code["prs"].tolist() == [False, True, True]  # released code: incorrect turns kept
    hard = rl_batch.filter_masks(batch, RLConfig(prs=True, prs_hard=True, prs_tau=0.85, prs_scope="correct"),
                                 torch.Generator())
    assert hard["prs"].tolist() == [False, True, True]


def test_mrs_rejects_a_sequence_whose_rollout_probabilities_drifted():
    train = [torch.log(torch.tensor([0.5, 0.5])), torch.log(torch.tensor([0.5, 0.5])), torch.zeros(0)]
    rollout = [torch.log(torch.tensor([0.5, 0.5])).tolist(), torch.log(torch.tensor([0.5, 0.49])).tolist(), []]
    keep, log_w = rl_batch.mismatch_keep(train, rollout, RLConfig(mrs=True))
    assert keep.tolist() == [True, False, False]  # w = sqrt(0.5 / 0.49) = 1.0101 is outside [0.999, 1.001]
    assert log_w[1].item() == pytest.approx(0.5 * float(torch.log(torch.tensor(0.5 / 0.49))), rel=1e-6)


def test_rollout_metrics_count_hacks_among_generated_turns_and_fast_p_at_the_last_turn():
    rows = [turn_row("a", 0, 1, 0.0, status="format_error", speedup_eager=None),
            turn_row("a", 0, 2, 2.5, status="pass", speedup_eager=1.5),
            turn_row("a", 1, 1, 0.0, status="hacked", speedup_eager=None),
            turn_row("a", 1, 2, 1.9, status="pass", speedup_eager=0.9)]
    rows[2]["hacked"] = True
    values = rollouts.rollout_metrics(rows, max_turns=2)
    assert values["hacking_ratio"] == pytest.approx(1 / 4)  # every generated turn, the format error too
    assert values["reward_mean"] == pytest.approx(4.4 / 4)
    assert values["reward_mean_turn2"] == pytest.approx(2.2)
    assert (values["fast@1"], values["fast@1.2"]) == (0.5, 0.5)  # turn 2: speedups 1.5 and 0.9
    assert values["correct_frac"] == 0.5


# ----------------------------------------------------------------------------- trainer vs rollout engine


def test_trainer_recomputes_the_rollout_log_probs_on_the_same_tokens(nano_model):
    model, tokenizer = rl.load_policy(nano_model, RLConfig())
    engine = HFEngine(model.eval(), tokenizer, name="nano", batch_size=4, progress=False)
    prompts = [[{"role": "user", "content": "write a kernel"}],
               [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "a longer request, left padded"}]]
    requests = [ChatRequest(messages=m, max_tokens=12, temperature=0.7, seed=i, logprobs=True)
                for i, m in enumerate(prompts)]
    completions = engine.generate(requests)
    rows = [{"prompt_messages": m, "response_token_ids": c.token_ids} for m, c in zip(prompts, completions)]
    samples = rl_batch.token_samples(rows, tokenizer)
    train = rl_update.policy_log_probs(model, samples, 0.7, 10_000, tokenizer.pad_token_id, torch.device("cpu"))
    for logp, completion in zip(train, completions):
        assert torch.allclose(logp, torch.tensor(completion.logprobs), atol=1e-4)
    keep, _ = rl_batch.mismatch_keep(train, [c.logprobs for c in completions], RLConfig(mrs=True))
    assert keep.all()


class RecordingOptimizer:
    """Stands in for AdamW: keeps the gradient of the one step it is asked to take."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = [p.grad.clone() for p in self.model.parameters()]

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "token-mean"])
def test_micro_batching_leaves_the_gradient_unchanged(nano_model, agg):
    from accelerate import Accelerator

    model, tokenizer = rl.load_policy(nano_model, RLConfig())
    items = [rl_batch.TrainItem(("t", i, 1), rl_batch.TokenSample(list(range(40, 40 + n)), list(range(60, 60 + m))), adv,
                          torch.full((m,), -5.0))
             for i, (n, m, adv) in enumerate([(5, 3, 1.0), (9, 6, -0.5), (4, 2, 0.25)])]
    grads = []
    for budget in (10_000, 1):  # one micro-batch, then one sample per micro-batch
        optimizer = RecordingOptimizer(model)
        cfg = RLConfig(loss_agg=agg, micro_batch_tokens=budget, grad_clip=1e9)
        rl_update.ppo_clip_steps(Accelerator(cpu=True), model, optimizer, items, cfg, tokenizer.pad_token_id,
                         torch.Generator().manual_seed(0))
        grads.append(optimizer.grads)
    for whole, accumulated in zip(*grads):
        assert torch.allclose(whole, accumulated, atol=1e-6)


def test_the_kl_term_adds_kl_coef_times_the_reference_kl_to_the_loss(nano_model):
    """TritonForge's "standard KL": loss = PPO loss + kl_coef · KL(pi || pi_ref), k3 per token, aggregated as
    the loss; with pi_ref = pi the term is 0, and its gradient pulls the policy towards the reference."""
    from accelerate import Accelerator

    model, tokenizer = rl.load_policy(nano_model, RLConfig())
    sample = rl_batch.TokenSample(list(range(40, 45)), list(range(60, 63)))
    pi = rl_update.policy_log_probs(model, [sample], 1.0, 10_000, tokenizer.pad_token_id, torch.device("cpu"))[0]

    def update(ref_logp, **cfg):
        optimizer = RecordingOptimizer(model)
        item = rl_batch.TrainItem(("t", 0, 1), sample, 0.0, pi, ref_logp)  # advantage 0: only the KL term acts
        stats = rl_update.ppo_clip_steps(Accelerator(cpu=True), model, optimizer, [item],
                                        RLConfig(grad_clip=1e9, **cfg), tokenizer.pad_token_id,
                                        torch.Generator().manual_seed(0))
        return stats, torch.cat([g.flatten() for g in optimizer.grads])

    stats, grads = update(pi, kl_coef=0.1)
    assert stats["kl"] == pytest.approx(0.0, abs=1e-6) and grads.abs().max() < 1e-6
    far = pi - 1.0  # a reference that finds every sampled token e times less likely
    stats, grads = update(far, kl_coef=0.1, kl_estimator="k1")
    assert stats["kl"] == pytest.approx(3.0, abs=1e-4)  # k1 summed over 3 tokens (seq-mean-token-sum)
    assert stats["loss"] == pytest.approx(0.1 * 3.0, abs=1e-4) and grads.abs().max() > 0
    assert "kl" not in update(far)[0]  # kl_coef 0 (the default): no term


def test_a_step_whose_gradient_is_not_finite_is_not_taken(nano_model):
    """A NaN gradient (here from a NaN advantage) would make every weight NaN and the next
    iteration's sampling fail: the step is dropped and counted, a finite one still taken."""
    from accelerate import Accelerator

    model, tokenizer = rl.load_policy(nano_model, RLConfig())
    sample = rl_batch.TokenSample(list(range(40, 45)), list(range(60, 63)))

    def update(advantage):
        optimizer = RecordingOptimizer(model)
        item = rl_batch.TrainItem(("t", 0, 1), sample, advantage, torch.full((3,), -5.0), torch.zeros(3))
        stats = rl_update.ppo_clip_steps(Accelerator(cpu=True), model, optimizer, [item],
                                        RLConfig(mini_batches=1, ppo_epochs=2), tokenizer.pad_token_id,
                                        torch.Generator().manual_seed(0))
        return stats, optimizer.grads

    stats, grads = update(float("nan"))
    assert grads is None and (stats["skipped_steps"], stats["optimizer_steps"]) == (2.0, 0.0)
    stats, grads = update(1.0)
    assert grads is not None and (stats["skipped_steps"], stats["optimizer_steps"]) == (0.0, 2.0)


# ----------------------------------------------------------------------------- one iteration, killed and resumed


class OneProcess:
    """What RolloutSource asks of an accelerator, for one process."""
    process_index, num_processes, is_main_process = 0, 1, True


@pytest.mark.parametrize(("async_mode", "step", "saved", "generated"), [
    ("off_policy_1", 1, False, [1]),  # the next step's, generated during the block and saved after it
    ("off_policy_1", 1, True, []),  # saved by a killed attempt: kept, not generated again
    ("off_policy_1", 2, False, []),  # past the iteration's last step
    ("off", 1, False, []),
])
def test_the_rollout_source_generates_ahead_only_what_off_policy_1_needs(tmp_path, monkeypatch, async_mode, step,
                                                                        saved, generated):
    settings = IterationSettings(cfg=RLConfig(steps_per_iteration=2, async_mode=async_mode), run="r", iteration=3,
                                 tasks=(AgentTask("relu", RELU),), init_model=tmp_path, model_out=tmp_path,
                                 trajectories=tmp_path, metrics=tmp_path, scratch=tmp_path, progress=False)
    source = rollouts.RolloutSource(settings, OneProcess(), engine=None, policy=None)
    if saved:
        source.path(step).touch()
    calls: list[int] = []
    monkeypatch.setattr(source, "generate", lambda step, evaluator, stream=None: calls.append(step) or [])
    monkeypatch.setattr(rollouts, "gather_object", lambda rows: rows)
    with source.ahead(step, evaluator=None):
        pass
    assert calls == generated and source.path(step).exists() == (saved or bool(generated))
    assert settings.global_step(step) == 3 * 2 + step


def test_a_killed_iteration_resumes_and_writes_each_output_once(nano_model, tmp_path, monkeypatch):
    cfg = RLConfig(prompts_per_step=1, rollouts_per_prompt=2, max_turns=2, max_tokens=6, steps_per_iteration=2,
                   lr=1e-3, mrs=True, regression_filter=True)
    settings = IterationSettings(cfg=cfg, tasks=(AgentTask("relu", RELU),), init_model=nano_model,
                                 model_out=tmp_path / "iter=0", trajectories=tmp_path / "traj.parquet",
                                 metrics=tmp_path / "metrics.parquet", scratch=tmp_path / "scratch", run="t",
                                 iteration=0, state_out=tmp_path / "state", gym={"backend": "local"}, progress=False)
    real_update, real_rollouts = rl.update_policy, rollouts.rollout_rows
    calls = {"update": 0, "rollouts": 0}

    def update_then_die(*args, **kw):
        calls["update"] += 1
        if calls["update"] == 2:
            raise KeyboardInterrupt("killed during step 1's update")
        return real_update(*args, **kw)

    def counted_rollouts(*args, **kw):
        calls["rollouts"] += 1
        return real_rollouts(*args, **kw)

    monkeypatch.setattr(rl, "update_policy", update_then_die)
    monkeypatch.setattr(rollouts, "rollout_rows", counted_rollouts)
    with pytest.raises(KeyboardInterrupt):
        rl.run_iteration(settings)
    assert calls["rollouts"] == 2 and not settings.trajectories.exists()

    monkeypatch.setattr(rl, "update_policy", real_update)
    result = rl.run_iteration(settings)
    assert result.resumed_steps == 1 and calls["rollouts"] == 2  # step 1's saved rollouts were reused
    assert (settings.model_out / "config.json").exists() and (tmp_path / "state").is_dir()
    assert not settings.scratch.exists()
    out = {"trajectories_path": settings.trajectories, "metrics_path": settings.metrics}

    rows = read_table(out["trajectories_path"], "trajectories").to_pylist()
    assert len(rows) == 2 * 2 * 2 and {r["stage"] for r in rows} == {"rl"}
    assert all(r["kept"] == (r["rejected_by"] is None) and r["return_to_go"] is not None for r in rows)
    assert all(len(r["response_logprobs"]) == len(r["response_token_ids"]) for r in rows)
    metrics = read_table(out["metrics_path"], "train_metrics").to_pandas()
    assert sorted(metrics.loc[metrics.name == "reward_mean", "step"]) == [1, 2]
    for name in ("entropy", "grad_norm", "rollout_ppl", "train_ppl", "kept_frac_mrs", "kept_frac_regression",
                 "fast@1", "fast@1.2", "gen_s", "eval_s", "train_s", "optimizer_s"):
        assert (metrics.name == name).sum() == 2, name


def test_without_step_checkpoints_a_killed_iteration_reruns_from_its_first_step_and_saves_no_checkpoint(
        nano_model, tmp_path, monkeypatch):
    """rl.step_checkpoints: false (config/paper_smoke_1gpu.yaml: one GPU's disk holds no 8B scratch checkpoint)."""
    cfg = RLConfig(prompts_per_step=1, rollouts_per_prompt=2, max_turns=1, max_tokens=6, steps_per_iteration=2,
                   lr=1e-3, step_checkpoints=False)
    settings = IterationSettings(cfg=cfg, tasks=(AgentTask("relu", RELU),), init_model=nano_model,
                                 model_out=tmp_path / "iter=0", trajectories=tmp_path / "traj.parquet",
                                 metrics=tmp_path / "metrics.parquet", scratch=tmp_path / "scratch", run="t",
                                 iteration=0, gym={"backend": "local"}, progress=False)
    real_update = rl.update_policy
    updates = []

    def update_then_die(*args, **kw):
        updates.append(len(updates))
        if len(updates) == 2:
            assert not (settings.scratch / "checkpoints").exists()  # step 0 ended without one
            saved = read_table(settings.scratch / "metrics.parquet", "train_metrics").to_pandas()
            assert set(saved.step) == {1}  # but its metrics are in the scratch, for whoever reads a failed job
            raise KeyboardInterrupt("killed during step 1's update")
        return real_update(*args, **kw)

    monkeypatch.setattr(rl, "update_policy", update_then_die)
    with pytest.raises(KeyboardInterrupt):
        rl.run_iteration(settings)
    monkeypatch.setattr(rl, "update_policy", lambda *args, **kw: updates.append(len(updates)) or real_update(*args, **kw))
    result = rl.run_iteration(settings)
    assert result.resumed_steps == 0 and len(updates) == 4  # both steps' updates again
    metrics = read_table(settings.metrics, "train_metrics").to_pandas()
    assert sorted(metrics.loc[metrics.name == "reward_mean", "step"]) == [1, 2]


def test_an_evaluation_only_last_iteration_writes_bf16_and_no_state_and_no_trainer_starts_from_it(nano_model,
                                                                                                     tmp_path):
    """rl.final_checkpoint: evaluation (config/paper_smoke_1gpu.yaml): the last iteration's model in bf16, no optimizer
    state; an fp32 trainer refuses to start from it (lr 1e-6 updates would not survive the round trip)."""
    from kpipe.train.checkpoint import saved_weights_dtype

    cfg = RLConfig(prompts_per_step=1, rollouts_per_prompt=2, max_turns=1, max_tokens=4, lr=1e-3,
                   mixed_precision="no")

    def iteration(init_model: Path, name: str, **kw) -> IterationSettings:
        return IterationSettings(cfg=cfg, tasks=(AgentTask("relu", RELU),), init_model=init_model,
                                 model_out=tmp_path / name, trajectories=tmp_path / f"{name}.parquet",
                                 metrics=tmp_path / f"{name}-metrics.parquet", scratch=tmp_path / f"{name}-scratch",
                                 run="t", gym={"backend": "local"}, progress=False, **kw)

    assert saved_weights_dtype(nano_model) == torch.float32
    rl.run_iteration(iteration(nano_model, "last", model_out_dtype=torch.bfloat16), evaluator=JudgeByText())
    assert saved_weights_dtype(tmp_path / "last") == torch.bfloat16
    assert yaml.safe_load((tmp_path / "last" / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last", "last-metrics.parquet", "last.parquet"]
    with pytest.raises(ValueError, match="holds torch.bfloat16 weights, the trainer torch.float32: it is an evaluation"):
        rl.run_iteration(iteration(tmp_path / "last", "next", iteration=1), evaluator=JudgeByText())


class JudgeByText:
    """A deterministic KernelGym stand-in: each result a function of the candidate's text alone (the
    nano policy writes no kernel, so every answer counts as one: see `answers_are_code`)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[dict]:
        self.calls.append(len(jobs))
        results = []
        for _, candidate in jobs:
            score = int(hashlib.sha256(candidate.encode()).hexdigest()[:4], 16) % 4
            results.append({"status": "pass" if score else "mismatch", "correct": bool(score), "hacked": False,
                            "speedup_eager": 0.5 * score or None, "key": candidate[:8], "feedback": f"score {score}"})
        return results


def iteration_outputs(nano_model: Path, root: Path, async_mode: str) -> tuple[list[dict], dict, JudgeByText]:
    """Rows and metrics of one seeded 2-step iteration in `async_mode`, every answer judged (every
    non-empty answer counts as code)."""
    from kpipe.agent import loop
    from kpipe.llm.extract import Extracted

    cfg = RLConfig(prompts_per_step=2, rollouts_per_prompt=2, max_turns=2, max_tokens=6, generation_batch_size=2,
                   steps_per_iteration=2, lr=1e-3, mrs=True, mixed_precision="no", async_mode=async_mode)
    tasks = [AgentTask("relu-a", RELU), AgentTask("relu-b", RELU.replace("4, 4", "4, 8"))]
    judge, threads = JudgeByText(), torch.get_num_threads()
    torch.set_num_threads(1)  # as `single_torch_thread`, also for the module-scoped run: same float sums
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "extract_code", lambda text: Extracted(text or None, "empty answer"))
        rl.run_iteration(IterationSettings(cfg=cfg, tasks=tuple(tasks), init_model=nano_model,
                                           model_out=root / "model", trajectories=root / "traj.parquet",
                                           metrics=root / "metrics.parquet", scratch=root / "scratch", run="async",
                                           iteration=0, gym={"backend": "local"}, progress=False), evaluator=judge)
    torch.set_num_threads(threads)
    metrics = read_table(root / "metrics.parquet", "train_metrics").to_pandas()
    values = {(r.step, r.name): r.value for r in metrics.itertuples()}
    return read_table(root / "traj.parquet", "trajectories").to_pylist(), values, judge


TIMES = ("gen_s", "eval_s", "rollout_s", "train_s", "step_s", "overlap_s", "log_probs_s", "returns_s", "filters_s",
         "advantages_s", "update_s", "optimizer_s")


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMES} for row in rows]


@pytest.fixture(scope="module")
def sequential_run(nano_model, tmp_path_factory) -> tuple[list[dict], dict, JudgeByText]:
    """The reference: rl.async off."""
    return iteration_outputs(nano_model, tmp_path_factory.mktemp("off"), "off")


def test_overlapping_evaluation_changes_timing_not_results(nano_model, tmp_path, sequential_run):
    """rl.async eval (each turn judged while the engine decodes the next generate batch) and off (a turn
    judged after all of it is generated): the same rows, rewards, advantages and metrics."""
    off_rows, off_metrics, off_judge = sequential_run
    eval_rows, eval_metrics, eval_judge = iteration_outputs(nano_model, tmp_path / "eval", "eval")
    assert len(off_rows) == 2 * 2 * 2 * 2 and all(row["status"] in ("pass", "mismatch") for row in off_rows)
    assert len({row["reward"] for row in off_rows}) > 1 and any(row["advantage"] for row in off_rows)
    assert untimed(eval_rows) == untimed(off_rows)
    assert {k: v for k, v in eval_metrics.items() if k[1] not in TIMES} == {
        k: v for k, v in off_metrics.items() if k[1] not in TIMES}
    assert off_judge.calls and eval_judge.calls  # (the loop's tests show the overlap itself)
    assert all((step, name) in eval_metrics for step in (1, 2) for name in TIMES)


def test_one_step_off_policy_rollouts_are_generated_during_the_update(nano_model, tmp_path, sequential_run):
    """rl.async off_policy_1: step 2 trains on rollouts generated while step 1 updated, by the policy before
    that update (one step stale, `policy_lag`); step 1's rollouts are those of the on-policy run."""
    off_rows = sequential_run[0]
    rows, metrics, _ = iteration_outputs(nano_model, tmp_path / "ahead", "off_policy_1")
    assert [metrics[(step, "policy_lag")] for step in (1, 2)] == [0.0, 1.0]
    assert untimed(rows[:8]) == untimed(off_rows[:8])
    assert len(rows) == 16 and {row["iteration"] for row in rows} == {0}
    assert sorted(rl_batch.row_key(row) for row in rows[8:]) == sorted(rl_batch.row_key(row) for row in off_rows[8:])
    for row in rows:
        assert len(row["response_logprobs"]) == len(row["response_token_ids"]) and row["return_to_go"] is not None
        assert row["kept"] == (row["rejected_by"] is None)
    assert metrics[(2, "rows")] == 8 and (2, "mismatch_abs_log_w") in metrics
    assert 0.0 <= metrics[(2, "mrs_would_keep")] <= 1.0  # logged whether or not MRS filters


def test_a_sleeping_vllm_engine_frees_the_update_and_wakes_around_the_next_push(nano_model, tmp_path, monkeypatch):
    """rl.vllm_sleep (issue 63): the engine sleeps once a step's rollouts are done (the update gets its memory),
    wakes for its weights before the next step's push and for its KV cache after it; push_s and sleep_wake_s
    are the step's phases. kpipe's engine class with a recording LLM; HF generation decodes."""
    import types

    from kpipe.agent import loop
    from kpipe.llm.extract import Extracted
    from kpipe.llm.vllm_engine import VLLMEngine

    events: list[str] = []

    class RecordingLLM:
        model_config = types.SimpleNamespace(dtype=torch.float32)

        def collective_rpc(self, method, args=()):
            events.append("push")

        def reset_prefix_cache(self):
            events.append("reset")

        def sleep(self, level):
            events.append(f"sleep {level}")

        def wake_up(self, tags):
            events.append(f"wake {tags[0]}")

    def colocated(cfg, model, tokenizer, model_dir, name, progress, processes=1):
        hf = rollouts.make_engine(dataclasses.replace(cfg, engine="hf"), model, tokenizer, model_dir, name, progress)
        engine = VLLMEngine.__new__(VLLMEngine)
        engine.llm, engine.asleep, engine.model = RecordingLLM(), set(), name

        def generate(requests, on_result=None):
            events.append("generate")
            return hf.generate(requests, on_result)

        engine.generate, engine.prompt_tokens = generate, hf.prompt_tokens
        return engine

    monkeypatch.setattr(rl, "make_engine", colocated)
    monkeypatch.setattr(loop, "extract_code", lambda text: Extracted(text or None, "empty answer"))
    cfg = RLConfig(engine="vllm", vllm_sleep=True, prompts_per_step=2, rollouts_per_prompt=2, max_turns=1,
                   max_tokens=4, generation_batch_size=4, steps_per_iteration=2, lr=1e-3, mixed_precision="no")
    rl.run_iteration(IterationSettings(cfg=cfg, tasks=(AgentTask("relu", RELU),), init_model=nano_model,
                                       model_out=tmp_path / "model", trajectories=tmp_path / "traj.parquet",
                                       metrics=tmp_path / "metrics.parquet", scratch=tmp_path / "scratch",
                                       gym={"backend": "local"}, progress=False), evaluator=JudgeByText())
    steps = [event for i, event in enumerate(events) if event != "generate" or events[i - 1:i] != ["generate"]]
    assert steps == ["generate", "sleep 2", "wake weights", "push", "reset", "wake kv_cache", "generate", "sleep 2"]
    metrics = read_table(tmp_path / "metrics.parquet", "train_metrics").to_pandas()
    names = {step: set(metrics[metrics.step == step].name) for step in (1, 2)}
    assert "sleep_wake_s" in names[1] and "push_s" not in names[1]  # the first step's engine loaded the model
    assert {"sleep_wake_s", "push_s"} <= names[2]


def test_scratch_of_another_restart_key_is_cleared_and_the_log_names_the_changed_part(tmp_path, caplog):
    scratch = tmp_path / "scratch"
    key = {"settings": "s", "code": "a", "libraries": "l"}
    assert not rl.prepare_scratch(scratch, key)
    (scratch / "rollouts-0000.parquet").write_text("partial work")
    assert rl.prepare_scratch(scratch, key) and (scratch / "rollouts-0000.parquet").exists()
    assert not rl.prepare_scratch(scratch, {**key, "code": "b"}) and not (scratch / "rollouts-0000.parquet").exists()
    assert "not resuming the partial work in" in caplog.text and ": code changed;" in caplog.text


def test_the_iteration_key_covers_code_weights_and_libraries(nano_model, tmp_path, monkeypatch):
    """Partial work is resumed only under the same code, input weights and library versions."""
    cfg, tasks = RLConfig(), [AgentTask("relu", RELU)]
    key = rl.iteration_key(cfg, "r", 0, tasks, "{}", nano_model, None, None)
    assert key == rl.iteration_key(cfg, "r", 0, tasks, "{}", nano_model, None, None)
    copied = tmp_path / "copy"
    shutil.copytree(nano_model, copied)  # a copy (new modification times) is the same model
    assert rl.iteration_key(cfg, "r", 0, tasks, "{}", copied, None, None) == key
    weights = copied / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"x")
    assert rl.key_changes(key, rl.iteration_key(cfg, "r", 0, tasks, "{}", copied, None, None)) == "weights changed"
    monkeypatch.setattr(rl, "code_version", lambda *parts: "edited")
    monkeypatch.setattr(rl, "library_versions", lambda: {"torch": "0.0"})
    assert rl.key_changes(key, rl.iteration_key(cfg, "r", 0, tasks, "{}", nano_model, None, None)) == \
        "code, libraries changed"


# ----------------------------------------------------------------------------- several processes


def test_micro_batch_weights_normalise_by_the_global_mini_batch():
    """Two processes' micro-batches, each weighted by its share of the mini-batch counted over both
    processes, add up to the loss of the whole mini-batch in one piece, in every aggregation mode."""
    lengths = [3, 5, 2, 4]  # response tokens of the mini-batch's four rows
    losses = torch.arange(20, dtype=torch.float64).reshape(4, 5) / 7
    mask = rl_batch.response_mask(lengths, 5)
    micro_batches = [[0], [1], [2, 3]]  # process 0 holds rows 0 and 1 (one each), process 1 rows 2 and 3
    for agg in AGG_MODES:
        whole = algos.aggregate_loss(losses, mask, agg)
        mini_units = rl_update.loss_units(agg, lengths)
        pieces = sum(algos.aggregate_loss(losses[m], mask[m], agg)
                     * rl_update.micro_batch_weight(agg, [lengths[i] for i in m], mini_units) for m in micro_batches)
        assert float(pieces) == pytest.approx(float(whole)), agg
    # by hand: token-mean shares 3/14, 5/14, 6/14 of 14 tokens; sequence shares 1/4, 1/4, 2/4
    assert [rl_update.micro_batch_weight("token-mean", [lengths[i] for i in m], 14) for m in micro_batches] == [
        pytest.approx(3 / 14), pytest.approx(5 / 14), pytest.approx(6 / 14)]
    assert rl_update.micro_batch_weight("seq-mean-token-sum", [2, 4], rl_update.loss_units("seq-mean-token-sum", lengths)) == 0.5


def test_prompts_must_split_evenly_over_processes_whatever_the_engine():
    rl.check_processes(RLConfig(), 4, 2)
    with pytest.raises(ValueError, match="3 prompts per step cannot be split evenly over 2 processes"):
        rl.check_processes(RLConfig(), 3, 2)
    rl.check_processes(RLConfig(engine="vllm"), 3, 1)
    rl.check_processes(RLConfig(engine="vllm"), 4, 2)  # one engine per process (external_launcher)
    with pytest.raises(ValueError, match="3 prompts per step cannot be split evenly over 2 processes"):
        rl.check_processes(RLConfig(engine="vllm"), 3, 2)
    tasks = [AgentTask(name, RELU) for name in "abcd"]
    assert [[t.task_id for t in rollouts.process_tasks(tasks, rank, 2)] for rank in (0, 1)] == [["a", "c"], ["b", "d"]]


def queries_file(path: Path, tasks: list[AgentTask]) -> Path:
    rows = [{"query_id": t.task_id, "source": "test", "source_id": t.task_id, "level": 1, "name": t.task_id,
             "reference_src": t.reference_src, "reference_hash": "", "contaminated": False} for t in tasks]
    return write_table(rows, path, "queries")


def test_two_processes_train_as_one_process_on_the_same_rows(nano_model, tmp_path):
    """`kpipe launch --gpus 2`'s command, on a CPU: accelerate runs the two processes as DDP over
    gloo (accelerate has no FSDP on a CPU). Step 0 trains on saved rollouts with hand-set rewards
    (the nano policy writes no kernel); step 1 generates and evaluates fresh ones per process. A
    one-process run on the rows the two processes wrote must reach the same weights and metrics."""
    cfg = RLConfig(prompts_per_step=2, rollouts_per_prompt=3, max_turns=1, max_tokens=6, steps_per_iteration=2,
                   lr=1e-3, loss_agg="token-mean", mini_batches=2, mrs=True, mixed_precision="no")
    tasks = [AgentTask("relu-a", RELU), AgentTask("relu-b", RELU.replace("4, 4", "4, 8"))]
    gym = {"backend": "local"}
    # step 0's rollouts, saved where an interrupted run would have left them
    model, tokenizer = rl.load_policy(nano_model, cfg)
    engine = HFEngine(model.eval(), tokenizer, name="nano", batch_size=8, progress=False)
    seeded = rollouts.rollout_rows(tasks, engine, LocalEvaluator(progress=False), cfg, run="mp", iteration=0,
                             global_step=0, progress=False)
    for row in seeded:
        row["reward"] = {"relu-a": [0.0, 1.0, 2.0], "relu-b": [3.0, 0.5, 0.0]}[row["task_id"]][row["sample"]]
    key = rl.iteration_key(cfg, "mp", 0, tasks, rl.gym_protocol(cfg, None).to_json(), nano_model, None, None)
    scratch = {n: tmp_path / n / "scratch" for n in ("two", "one")}
    for path in scratch.values():
        rl.prepare_scratch(path, key)
        write_table(seeded, path / "rollouts-0000.parquet", "trajectories")

    outputs = {n: {"model_out": tmp_path / n / "model", "trajectories_path": tmp_path / n / "traj.parquet",
                   "metrics_path": tmp_path / n / "metrics.parquet"} for n in ("two", "one")}
    two = outputs["two"]
    # what rule rl_iter's job hands each of its processes: one settings file (kpipe.infra.jobs)
    job_file = write_job_file(tmp_path / "rl.job.json", rl.rl_job, {
        "queries": str(queries_file(tmp_path / "queries.parquet", tasks)), "init_model": str(nano_model),
        "model_out": str(two["model_out"]), "trajectories": str(two["trajectories_path"]),
        "metrics": str(two["metrics_path"]), "scratch": str(scratch["two"]), "run": "mp", "iteration": 0,
        "rl": dataclasses.asdict(cfg), "gym": gym, "state_out": str(tmp_path / "two" / "state")})
    command = accelerate_command(2, [str(job_file)], NodeInfo(main_port=free_port()),
                                 config_dir=REPO / "workflow" / "accelerate", module=JOBS_MODULE)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    ranks = "\n".join(line for line in done.stderr.splitlines() if line.startswith("[rank"))
    assert done.returncode == 0, ranks[-6000:] + done.stderr[-2000:]  # every rank's traceback, not only the last
    assert "on 2 process(es) (DistributedType.MULTI_CPU)" in done.stderr

    rows = read_table(two["trajectories_path"], "trajectories").to_pylist()
    steps = [rows[:len(seeded)], rows[len(seeded):]]
    for step_rows in steps:  # each process's rows exactly once
        assert sorted(rl_batch.row_key(r) for r in step_rows) == sorted(rl_batch.row_key(r) for r in seeded)
    assert not scratch["two"].exists()

    write_table(steps[1], scratch["one"] / "rollouts-0001.parquet", "trajectories")
    one = outputs["one"]
    rl.run_iteration(IterationSettings(cfg=cfg, tasks=tuple(tasks), init_model=nano_model, model_out=one["model_out"],
                                       trajectories=one["trajectories_path"], metrics=one["metrics_path"],
                                       scratch=scratch["one"], run="mp", iteration=0, gym=gym, progress=False))
    one_rows = {rl_batch.row_key(r): r
                for r in read_table(outputs["one"]["trajectories_path"], "trajectories").to_pylist()[:len(seeded)]}
    for row in steps[0]:
        assert row["advantage"] == pytest.approx(one_rows[rl_batch.row_key(row)]["advantage"])
        assert row["kept"] == one_rows[rl_batch.row_key(row)]["kept"]
    assert any(row["advantage"] for row in steps[0])

    from safetensors.torch import load_file

    weights = {n: load_file(outputs[n]["model_out"] / "model.safetensors") for n in ("two", "one")}
    initial = load_file(nano_model / "model.safetensors")
    # Adam's first steps are sign-like: where a gradient is ~1e-8, float noise can move a weight by ~1% of
    # lr, so the runs are compared by how far apart they moved in all (a wrong normalisation: tens of percent)
    moved = sum(float((weights["one"][name] - initial[name]).abs().sum()) for name in initial)
    apart = sum(float((weights["two"][name] - weights["one"][name]).abs().sum()) for name in initial)
    assert moved > 0 and apart < 1e-3 * moved, (apart, moved)

    metrics = {n: read_table(outputs[n]["metrics_path"], "train_metrics").to_pandas() for n in ("two", "one")}
    assert not metrics["two"].duplicated(["step", "name"]).any()
    compared = ["loss", "grad_norm", "entropy", "clip_frac", "approx_kl", "kept_frac", "kept_frac_mrs",
                "trained_rows", "optimizer_steps", "reward_mean", "return_mean", "advantage_abs_mean", "train_ppl",
                "rollout_ppl", "mismatch_abs_log_w", "response_tokens_mean", "rows"]
    two_values, one_values = ({(r.step, r.name): r.value for r in m.itertuples() if r.name in compared}
                              for m in (metrics["two"], metrics["one"]))
    assert set(two_values) == set(one_values) and len(two_values) == 2 * len(compared)
    for key, value in one_values.items():
        assert two_values[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_rl_times_only_the_eager_baseline_that_its_rewards_use():
    cfg = RLConfig(hacking_check=False, use_pr=True)
    protocol = rl.gym_protocol(cfg, {"baseline": "both", "perf_trials": 7})
    assert (protocol.baseline, protocol.perf_trials, protocol.hacking_check, protocol.profile) == ("eager", 7, False, True)
