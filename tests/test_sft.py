"""SFT loop on the nano model (CPU): the loss is the token mean, it falls, and a killed run resumes exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kpipe.data.io import read_table
from kpipe.train.samples import build_samples
from kpipe.train.batching import batch_indices, plan_micro_batches
from kpipe.train.sft import (
    PRESETS,
    SFTConfig,
    collate,
    labelled_positions,
    lr_factor,
    micro_batch_loss,
    shard_for_process,
    total_steps,
    train_sft,
)
from kpipe.train.tiny_model import build_tiny_model


def synthetic_rows(n_tasks: int = 6) -> list[dict]:
    """Two-turn trajectories whose responses share structure, so a tiny model can learn them."""
    rows = []
    for task in range(n_tasks):
        context = [{"role": "system", "content": "You write Triton kernels."},
                   {"role": "user", "content": f"Task {task}: write ModelNew for op_{task}."}]
        for turn in (1, 2):
            response = f"```python\nimport triton\n\n@triton.jit\ndef op_{task}_kernel(x_ptr, n):\n    pass  # v{turn}\n```"
            rows.append({"run": "r", "stage": "coldstart", "iteration": 0, "task_id": f"t{task}", "sample": 0,
                         "turn": turn, "prompt_messages": list(context), "response": response,
                         "status": "pass" if turn == 2 else "mismatch", "correct": turn == 2, "hacked": False})
            context = context + [{"role": "assistant", "content": response},
                                 {"role": "user", "content": "Status: mismatch. Refine."}]
    return rows


@pytest.fixture(scope="module")
def nano(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("base") / "nano", seed=0, size="nano"))


def config(nano: str, **overrides) -> SFTConfig:
    values = dict(base_model=nano, run="test", epochs=4, batch_size=4, micro_batch_tokens=600, lr=3e-3,
                  save_every=0, max_length=4096)
    return SFTConfig.from_dict({**values, **overrides}, preset="offline")


def loss_series(path) -> list[tuple[int, float]]:
    table = read_table(path, "train_metrics").to_pylist()
    return sorted((r["step"], r["value"]) for r in table if r["name"] == "loss")


# ---------------------------------------------------------------- pure helpers


def test_lr_warms_up_linearly_then_follows_the_cosine_to_its_floor():
    total, warmup = 100, 10
    assert lr_factor(0, total, warmup, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(9, total, warmup, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(10, total, warmup, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(55, total, warmup, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, total, warmup, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(70, total, warmup, "constant", 0.1) == 1.0


def test_each_epoch_visits_every_sample_once_in_a_new_order():
    n, batch = 10, 4  # 3 steps per epoch, the last one partial
    epoch0 = [i for step in range(3) for i in batch_indices(n, batch, seed=1, step=step)]
    epoch1 = [i for step in range(3, 6) for i in batch_indices(n, batch, seed=1, step=step)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1
    assert batch_indices(n, batch, seed=1, step=4) == batch_indices(n, batch, seed=1, step=4)


def test_micro_batches_respect_the_padded_token_budget():
    lengths = [100, 30, 90, 10, 500, 40, 60]
    groups = plan_micro_batches(lengths, token_budget=200)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 200
    assert [4] in groups  # longer than the budget: alone


def test_process_shards_partition_the_batch():
    indices, lengths = [5, 1, 7, 3, 2], [9, 8, 7, 6, 5, 4, 3, 2]
    shards = [shard_for_process(indices, lengths, rank, 2) for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(indices)


def test_total_steps_counts_partial_batches_and_honours_max_steps(nano):
    assert total_steps(config(nano, epochs=2, batch_size=4), n_samples=10) == 6
    assert total_steps(config(nano, epochs=2, batch_size=4, max_steps=5), n_samples=10) == 5


def test_presets_carry_the_paper_and_code_settings():
    paper, code = PRESETS["paper"], PRESETS["code"]
    assert (paper.lr, paper.batch_size, paper.epochs, paper.base_model) == (1e-6, 256, 4, "Qwen/Qwen3-8B-Base")
    assert (code.lr, code.batch_size, code.max_length, code.unit) == (2e-5, 64, 18432, "trajectory")


def test_bad_config_is_a_clear_error(nano):
    with pytest.raises(ValueError, match="unknown key"):
        SFTConfig.from_dict({"learning_rate": 1e-3})
    with pytest.raises(ValueError, match="schedule"):
        config(nano, schedule="linear")
    with pytest.raises(ValueError, match="lr must be float"):
        SFTConfig.from_dict({"lr": "fast"})
    with pytest.raises(ValueError, match="unknown preset"):
        SFTConfig.from_dict({"preset": "best"})


# ---------------------------------------------------------------- the loop


def test_step_loss_is_the_token_mean_over_the_global_batch(nano, tmp_path):
    """Micro-batching and accumulation must not change the loss: compare with one direct forward."""
    cfg = config(nano, batch_size=12, micro_batch_tokens=400, max_steps=1, epochs=1)
    tokenizer = AutoTokenizer.from_pretrained(nano)
    samples, _ = build_samples(synthetic_rows(), tokenizer, cfg.max_length)
    model = AutoModelForCausalLM.from_pretrained(nano, dtype=torch.float32)
    batch = collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                 ignore_index=-100).item()

    train_sft(cfg, synthetic_rows(), tmp_path / "out", tmp_path / "metrics.parquet")
    assert len(plan_micro_batches([len(s.input_ids) for s in samples], 400)) > 1
    assert loss_series(tmp_path / "metrics.parquet")[0][1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("chunk_tokens", [0, 7])  # the model's logits; the head in chunks (logprob_chunk_tokens)
def test_logits_only_at_labelled_positions_give_the_full_loss_and_its_gradients(nano, chunk_tokens):
    """micro_batch_loss computes logits only where a next token is labelled, or the log-probs through the
    LM head in chunks; the loss and every gradient must equal transformers' own causal LM loss over the
    whole padded micro-batch."""
    tokenizer = AutoTokenizer.from_pretrained(nano)
    samples, _ = build_samples(synthetic_rows(3), tokenizer, 4096)
    batch = collate(samples, tokenizer.pad_token_id)
    n = int((batch["labels"][:, 1:] != -100).sum())
    assert 0 < len(labelled_positions(batch["labels"])) < batch["labels"].shape[1] - 1  # prompts need none
    losses, grads = [], []
    for full in (True, False):
        model = AutoModelForCausalLM.from_pretrained(nano, dtype=torch.float32)
        loss = (model(**batch, num_items_in_batch=n).loss * 2 if full
                else micro_batch_loss(model, batch, n, world=2, chunk_tokens=chunk_tokens))
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_labelled_positions_are_those_whose_next_token_has_a_label():
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, -100, -100, -100]])
    assert labelled_positions(labels).tolist() == [0, 1, 2]


def test_loss_falls_and_outputs_are_complete(nano, tmp_path):
    result = train_sft(config(nano, epochs=10), synthetic_rows(), tmp_path / "out", tmp_path / "metrics.parquet")
    losses = [v for _, v in loss_series(tmp_path / "metrics.parquet")]
    assert len(losses) == result.steps == 30
    assert losses[-1] < 0.6 * losses[0]
    assert math.isclose(losses[0], math.log(259), rel_tol=0.1)  # random init: ~uniform over the vocab
    names = {r["name"] for r in read_table(tmp_path / "metrics.parquet", "train_metrics").to_pylist()}
    assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= names
    trained = AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert trained.config.model_type == "qwen3"
    assert AutoTokenizer.from_pretrained(result.model_dir).chat_template
    summary = json.loads((tmp_path / "out" / "sft_summary.json").read_text())
    assert summary["samples"]["samples"] == 12 and summary["steps"] == 30


def test_max_turn_trains_on_the_first_turns_only(nano, tmp_path):
    result = train_sft(config(nano, max_turn=1, max_steps=1), synthetic_rows(), tmp_path / "out",
                       tmp_path / "metrics.parquet")
    assert result.samples.as_dict()["samples"] == 6  # one per task: turn 2 left out


class Killed(RuntimeError):
    pass


def kill_at(step_to_die: int):
    def on_step_end(step: int, _values: dict) -> None:
        if step == step_to_die:
            raise Killed(f"killed after step {step}")
    return on_step_end


@pytest.mark.parametrize("offload", ["off", "fp32"])  # AdamW in accelerate's state; OffloadedAdamW's beside it
def test_killed_run_resumes_from_its_checkpoint_and_matches_an_uninterrupted_run(nano, tmp_path, offload):
    cfg = config(nano, epochs=3, save_every=3, keep_last=2, optimizer_offload=offload)  # 9 steps; checkpoints at 3, 6
    reference = train_sft(cfg, synthetic_rows(), tmp_path / "ref", tmp_path / "ref.parquet")

    with pytest.raises(Killed):
        train_sft(cfg, synthetic_rows(), tmp_path / "run", tmp_path / "run.parquet", on_step_end=kill_at(5))
    assert [s for s, _ in loss_series(tmp_path / "run.parquet")] == [1, 2, 3]  # flushed with checkpoint 3
    resumed = train_sft(cfg, synthetic_rows(), tmp_path / "run", tmp_path / "run.parquet")

    assert resumed.resumed_from == 3
    assert loss_series(tmp_path / "run.parquet") == loss_series(tmp_path / "ref.parquet")  # steps 1..9, once each
    ref_weights = load_file(reference.model_dir / "model.safetensors")
    run_weights = load_file(resumed.model_dir / "model.safetensors")
    assert all(torch.equal(ref_weights[name], run_weights[name]) for name in ref_weights)
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # a finished run is never resumed


@pytest.mark.parametrize(("change", "changed"), [
    ("lr", "settings changed"), ("code", "code changed"), ("libraries", "libraries changed"),
    ("base model", "settings, weights changed")])
def test_checkpoints_of_other_settings_code_libraries_or_weights_are_not_resumed(nano, tmp_path, monkeypatch,
                                                                                caplog, change, changed):
    """The restart key covers settings, data, kpipe's SFT code, the base weights and the library
    versions; the log names the part that changed."""
    import shutil

    from kpipe.train import sft

    cfg = config(nano, epochs=2, save_every=1)
    with pytest.raises(Killed):
        train_sft(cfg, synthetic_rows(), tmp_path / "out", tmp_path / "m.parquet", on_step_end=kill_at(2))
    if change == "lr":
        cfg = config(nano, epochs=2, save_every=1, lr=1e-3)
    elif change == "code":
        monkeypatch.setattr(sft, "code_version", lambda *parts: "edited")
    elif change == "libraries":
        monkeypatch.setattr(sft, "library_versions", lambda: {"torch": "0.0"})
    else:
        other = tmp_path / "other-base"
        shutil.copytree(nano, other)
        weights = other / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1] + b"x")
        cfg = config(str(other), epochs=2, save_every=1)
    again = train_sft(cfg, synthetic_rows(), tmp_path / "out", tmp_path / "m.parquet")
    assert again.resumed_from is None
    assert f"not resuming the checkpoint at step 2 in {tmp_path / 'out' / 'checkpoints'}: {changed}; " \
           "training from step 0" in caplog.text


def test_cli_builds_the_tiny_model(tmp_path):
    from click.testing import CliRunner

    from kpipe.cli import main

    built = CliRunner().invoke(main, ["train", "tiny-model", str(tmp_path / "base"), "--size", "nano"])
    assert built.exit_code == 0, built.output
    assert (tmp_path / "base" / "config.json").is_file()


def test_the_sft_job_publishes_its_results_and_a_rerun_without_them_trains_again(nano, tmp_path):
    """The `sft` rule's job: its settings as JSON values, results copied to the pipeline outputs, which a
    Snakemake rerun deletes first. A finished run leaves no checkpoint, so the rerun (`--forcerun
    sft`, deleted outputs) trains again from step 0 instead of handing back the old model."""
    import shutil

    from kpipe.data.io import write_table
    from kpipe.train.sft import sft_job

    trajectories = tmp_path / "coldstart.parquet"
    write_table(synthetic_rows(2), trajectories, "trajectories")
    work, published = tmp_path / "work", tmp_path / "results"
    job = {"trajectories": [str(trajectories)], "work_dir": str(work),
           "settings": {"preset": "offline", "base_model": str(nano), "run": "cli", "epochs": 2, "batch_size": 2,
                        "micro_batch_tokens": 600, "max_length": 4096},
           "model_out": str(published / "model"), "summary_out": str(published / "reports" / "sft.json"),
           "metrics_out": str(published / "train_metrics" / "part-0.parquet")}
    sft_job(**job)
    losses = loss_series(published / "train_metrics" / "part-0.parquet")
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert (published / "model" / "model.safetensors").is_file()
    assert not (work / "model").exists()  # moved: results/work keeps no full copy of a finished model
    summary = json.loads((published / "reports" / "sft.json").read_text())
    assert (summary["config"]["run"], summary["steps"], summary["final_loss"]) == ("cli", 4, losses[-1][1])

    shutil.rmtree(published)  # what Snakemake does before it reruns the job
    sft_job(**job)
    assert loss_series(published / "train_metrics" / "part-0.parquet") == losses
    summary = json.loads((published / "reports" / "sft.json").read_text())
    assert (summary["resumed_from"], summary["final_loss"]) == (None, losses[-1][1])
    assert (published / "model" / "model.safetensors").is_file()
