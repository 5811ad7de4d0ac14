"""config/paper_smoke.yaml: the paper's run with every stage once or twice (issue 54). It must plan, reach every
stage, and change only the counts it names, so that its run times the paper's real architecture and lengths."""

from pathlib import Path

import pytest
import torch
import yaml
from test_config import leaves
from test_workflow import job_counts, snakemake

from kpipe.infra.config import deep_merge

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "config" / "paper.yaml"
SMOKE = ROOT / "config" / "paper_smoke.yaml"


def merged_as_snakemake_does(*paths: Path) -> dict:
    """Later --configfile files update earlier ones recursively (mappings merge, other values replace)."""
    merged: dict = {}
    for path in paths:
        merged = deep_merge(merged, yaml.safe_load(path.read_text()))
    return merged


@pytest.fixture(scope="module")
def smoke_plan(workflow_copy: Path) -> dict[str, int]:
    return job_counts(snakemake(workflow_copy, "-n", "--configfile", "config/paper.yaml", "config/paper_smoke.yaml"))


def test_every_stage_runs_once_or_twice(smoke_plan):
    for stage in ("distill", "sft", "rl_validate", "select_checkpoint", "tables", "figures", "build_db"):
        assert 1 <= smoke_plan[stage] <= 2, stage
    assert smoke_plan["rl_iter"] == 2  # two RL iterations of the one run drkernel, weights pushed between them
    assert smoke_plan["eval"] == 3  # the RL policy on each KernelBench level
    assert smoke_plan["stts"] == 9  # the RL policy: 3 strategies x 3 levels


def test_the_rl_policy_is_what_eval_and_stts_run():
    smoke = merged_as_snakemake_does(PAPER, SMOKE)
    assert smoke["eval"]["models"] == smoke["stts"]["models"] == ["drkernel-rl"]
    assert smoke["distill"]["teacher"] == "offline"


def test_only_the_keys_the_overlay_names_change():
    paper = leaves(yaml.safe_load(PAPER.read_text()))
    overlay = leaves(yaml.safe_load(SMOKE.read_text()))
    smoke = leaves(merged_as_snakemake_does(PAPER, SMOKE))
    changed = {key for key in paper if smoke.get(key, "absent") != paper[key]}
    assert changed <= set(overlay)
    assert set(smoke) == set(paper) | set(overlay)


def test_the_paper_architecture_lengths_engines_and_parallelism_stay():
    """What the smoke run exists to measure: none of it may be cut."""
    overlay = leaves(yaml.safe_load(SMOKE.read_text()))
    kept_words = ("base_model", "tokens", "turns", "engine", "gpus", "async", "gradient_checkpointing", "sampling",
                  "protocol", "levels", "micro_batch", "lr")
    assert not [key for key in overlay if any(word in key for word in kept_words) and not key.startswith("policy.")]


def test_the_policy_is_qwen3_8b_built_offline():
    """The hub's weights cannot be downloaded on compute nodes: the overlay builds Qwen3-8B-Base's architecture
    from its config (random weights), the same shapes as the paper's model."""
    from transformers import AutoModelForCausalLM

    from kpipe.train.tiny_model import tiny_config

    smoke = merged_as_snakemake_does(PAPER, SMOKE)
    assert smoke["policy"]["base_model"] == "tiny" and smoke["policy"]["tiny"]["size"] == "qwen3-8b"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3-8b", 259, 258, 256))
    assert 8.1e9 < model.num_parameters() < 8.3e9  # Qwen3-8B-Base: 8.19B


ONE_GPU = ROOT / "config" / "paper_smoke_1gpu.yaml"


def test_the_one_gpu_overlay_runs_issue_63s_step_at_the_papers_shapes():
    """Two steps of 1 prompt x 4 rollouts x 3 turns x 8,192 tokens in a 32K context (the second pushes the weights into
    vLLM), TRLOO + MRS (PRS would drop a random policy's every row), vLLM and KernelGym in the loop, on one GPU;
    besides GPUs, counts and `run`, it changes only what the disk holds (the last iteration's export, no scratch
    checkpoint)."""
    overlay = leaves(yaml.safe_load(ONE_GPU.read_text()))
    assert set(overlay) == {"run", "sft.gpus", "rl.gpus", "rl.iterations", "rl.steps_per_iteration", "rl.step_checkpoints",
                            "rl.prompts_per_step", "rl.rollouts_per_prompt", "rl.final_checkpoint", "rl.runs.drkernel.ablation"}
    rl = merged_as_snakemake_does(PAPER, SMOKE, ONE_GPU)["rl"]
    assert (rl["prompts_per_step"], rl["rollouts_per_prompt"], rl["max_turns"], rl["max_tokens"],
            rl["max_context_tokens"]) == (1, 4, 3, 8192, 32768)
    assert rl["iterations"] == rl["gpus"] == 1 and rl["steps_per_iteration"] == 2 and not rl["step_checkpoints"]
    assert rl["final_checkpoint"] == "evaluation"
    assert rl["runs"] == {"drkernel": {"ablation": "mrs"}} and rl["engine"] == "vllm" and rl["vllm_sleep"]


def test_the_one_gpu_overlay_plans_one_rl_iteration(workflow_copy: Path):
    counts = job_counts(snakemake(workflow_copy, "-n", "--configfile", "config/paper.yaml", "config/paper_smoke.yaml",
                                  "config/paper_smoke_1gpu.yaml"))
    assert counts["tiny_model"] == counts["sft"] == counts["rl_iter"] == counts["rl_validate"] == 1
