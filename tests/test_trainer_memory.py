"""The 8B trainer's pieces in the RL loop and SFT (issue 63): log-probs through the LM head in chunks
(`logprob_chunk_tokens`) give the logits path's values and gradients, and the offloaded optimizer
(`optimizer_offload`) trains as AdamW, its state carried from one iteration to the next."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from kpipe.agent.loop import AgentTask
from kpipe.train import rl, rl_batch, rl_update
from kpipe.train.checkpoint import load_training_state, save_training_state
from kpipe.train.trainer_memory import (
    ACTIVATION_RESERVE_BYTES,
    PLANS,
    OffloadedAdamW,
    parameter_count,
    prepare_model_and_optimizer,
    resolve_memory_plan,
)
from kpipe.train.rl_config import IterationSettings, RLConfig
from test_rl import RELU  # the one ReLU reference of the RL tests

pytestmark = pytest.mark.usefixtures("single_torch_thread")



@pytest.fixture(scope="module")
def nano_model(tmp_path_factory) -> Path:
    """The default config's policy: tied embeddings, so the chunked head's gradient reaches the embedding too."""
    from kpipe.train.tiny_model import build_tiny_model, policy_corpus

    return build_tiny_model(tmp_path_factory.mktemp("nano") / "model", seed=0, size="nano", corpus=policy_corpus(),
                            vocab_size=4000)


def fp32_policy(nano_model: Path):
    """The policy as the trainer holds it (fp32: the logits path's statistics are fp32 whatever the model)."""
    model, tokenizer = rl.load_policy(nano_model, RLConfig())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    return model, tokenizer


SAMPLES = [rl_batch.TokenSample(list(range(40, 40 + n)), list(range(60, 60 + m))) for n, m in [(5, 3), (9, 7), (4, 1)]]


def test_chunked_log_probs_equal_the_models_own(nano_model):
    model, tokenizer = fp32_policy(nano_model)
    whole, chunked = (rl_update.policy_log_probs(model, SAMPLES, 0.7, 10_000, tokenizer.pad_token_id,
                                                 torch.device("cpu"), chunk_tokens=chunk) for chunk in (0, 4))
    for a, b in zip(whole, chunked, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=2e-6)


class RecordingOptimizer:
    """Stands in for AdamW: keeps the gradient of the step it is asked to take."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = [p.grad.clone() for p in self.model.parameters()]

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def test_the_chunked_update_has_the_logits_paths_loss_entropy_and_gradients(nano_model):
    from accelerate import Accelerator

    model, tokenizer = fp32_policy(nano_model)
    items = [rl_batch.TrainItem(("t", i, 1), sample, advantage, torch.full((len(sample.response_ids),), -5.0))
             for i, (sample, advantage) in enumerate(zip(SAMPLES, [1.0, -0.5, 0.25]))]
    results = []
    for chunk in (0, 5):
        optimizer = RecordingOptimizer(model)
        cfg = RLConfig(grad_clip=1e9, temperature=0.7, logprob_chunk_tokens=chunk)
        stats = rl_update.ppo_clip_steps(Accelerator(cpu=True), model, optimizer, items, cfg, tokenizer.pad_token_id,
                                         torch.Generator().manual_seed(0))
        results.append((stats, optimizer.grads))
    (whole_stats, whole_grads), (chunked_stats, chunked_grads) = results
    assert chunked_stats.keys() == whole_stats.keys()
    for name, value in whole_stats.items():  # loss, clip fractions, approx KL, grad norm, entropy
        if name.endswith("_s"):  # seconds (optimizer_s): a timing, not a value of the update
            continue
        assert chunked_stats[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert whole_stats["entropy"] > 0
    for whole, chunked in zip(whole_grads, chunked_grads, strict=True):
        assert torch.allclose(whole, chunked, rtol=1e-4, atol=1e-7)
    assert any(grad.abs().max() > 0 for grad in whole_grads)


def test_a_head_whose_logits_are_not_a_plain_matmul_is_refused(nano_model):
    model, tokenizer = fp32_policy(nano_model)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        rl_update.policy_log_probs(model, SAMPLES, 1.0, 10_000, tokenizer.pad_token_id, torch.device("cpu"),
                                   chunk_tokens=4)


def test_the_memory_plan_is_the_setting_or_what_fits(nano_model):
    assert [resolve_memory_plan(s, nano_model, 1, None).name for s in ("off", "fp32", "bf16")] == ["gpu", "fp32", "bf16"]
    assert resolve_memory_plan("auto", nano_model, 1, None).name == "gpu"  # no GPU: nothing to offload to
    params = parameter_count(nano_model)
    assert params == sum(p.numel() for p in rl.load_policy(nano_model, RLConfig())[0].parameters())
    fits = {per_param: resolve_memory_plan("auto", nano_model, 1, ACTIVATION_RESERVE_BYTES + params * per_param).name
            for per_param in (16, 8, 4)}
    assert fits == {16: "gpu", 8: "fp32", 4: "bf16"}
    with pytest.raises(ValueError, match="optimizer_offload"):
        RLConfig(optimizer_offload="cpu")


def test_a_state_of_the_other_optimizer_is_refused_by_name(nano_model, tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = rl.load_policy(nano_model, RLConfig())[0]
    _, adamw = prepare_model_and_optimizer(accelerator, model, PLANS["gpu"], 1e-3, (0.9, 0.999), 0.01)
    save_training_state(accelerator, adamw, tmp_path / "adamw")
    _, offloaded = prepare_model_and_optimizer(Accelerator(cpu=True), model, PLANS["fp32"], 1e-3, (0.9, 0.999), 0.01)
    assert isinstance(offloaded, OffloadedAdamW)
    with pytest.raises(ValueError, match="written by torch.optim.AdamW, this run uses an offloaded optimizer"):
        load_training_state(accelerator, offloaded, tmp_path / "adamw")


class JudgeByText:
    """A deterministic KernelGym stand-in: each result a function of the candidate's text alone."""

    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[dict]:
        results = []
        for _, candidate in jobs:
            score = int(hashlib.sha256(candidate.encode()).hexdigest()[:4], 16) % 4
            results.append({"status": "pass" if score else "mismatch", "correct": bool(score), "hacked": False,
                            "speedup_eager": 0.5 * score or None, "key": candidate[:8], "feedback": f"score {score}"})
        return results


def two_iterations(nano_model: Path, root: Path, offload: str) -> dict[str, torch.Tensor]:
    """The weights after RL iterations 0 and 1 of one run, the second starting from the first's model and
    optimizer state (as rule rl_iter chains them)."""
    from safetensors.torch import load_file

    from kpipe.agent import loop
    from kpipe.llm.extract import Extracted

    cfg = RLConfig(prompts_per_step=1, rollouts_per_prompt=2, max_turns=1, max_tokens=5, generation_batch_size=2,
                   lr=1e-3, mixed_precision="no", optimizer_offload=offload)
    init_model = nano_model
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "extract_code", lambda text: Extracted(text or None, "empty answer"))
        for iteration in (0, 1):
            out = root / f"iter={iteration}"
            rl.run_iteration(IterationSettings(
                cfg=cfg, tasks=(AgentTask("relu", RELU),), init_model=init_model, model_out=out / "model",
                trajectories=out / "traj.parquet", metrics=out / "metrics.parquet", scratch=out / "scratch",
                run="offload", iteration=iteration, gym={"backend": "local"}, progress=False,
                init_state=root / f"iter={iteration - 1}" / "state" if iteration else None, state_out=out / "state"),
                evaluator=JudgeByText())
            init_model = out / "model"
    assert (root / "iter=1" / "state" / "offloaded_adamw-0.pt").exists() == (offload != "off")
    return {name: tensor for path in sorted((root / "iter=1" / "model").glob("*.safetensors")) for name, tensor in load_file(path).items()}


def test_rl_with_the_offloaded_optimizer_trains_as_adamw_across_iterations(nano_model, tmp_path):
    from safetensors.torch import load_file

    adamw = two_iterations(nano_model, tmp_path / "adamw", "off")
    offloaded = two_iterations(nano_model, tmp_path / "offloaded", "fp32")
    initial = load_file(nano_model / "model.safetensors")
    assert adamw.keys() == offloaded.keys()
    assert any(not torch.equal(adamw[name], initial[name].float()) for name in adamw)  # the policy moved
    for name in adamw:
        assert torch.allclose(offloaded[name], adamw[name], rtol=1e-6, atol=1e-9), name


def test_the_bf16_plan_trains_bf16_weights_and_carries_the_fp32_master_in_the_state(nano_model, tmp_path):
    weights = two_iterations(nano_model, tmp_path, "bf16")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}  # the host's master, not the GPU's bf16
    state = torch.load(tmp_path / "iter=1" / "state" / "offloaded_adamw-0.pt", weights_only=True)
    assert state["master_on_host"] and state["host_state"].shape[0] == 3  # moments and the fp32 master
    assert state["bucket_steps"] == [2] * len(state["bucket_steps"])  # one step an iteration, carried over
    masters = state["host_state"][2]
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])  # the nano model's tied head
    exported = torch.cat([weights[name].flatten() for name in sorted(weights) if name != "lm_head.weight"]).float()
    assert masters.dtype == torch.float32 and masters.numel() == exported.numel()
    assert not torch.equal(masters, masters.bfloat16().float())  # bits below bf16's resolution: a real fp32 master
    assert torch.equal(exported.sort().values, masters.sort().values)  # what the iteration exported is that master
