"""Issue 55: the Kevin preset's response lengths (16K, 22K from step 30: Kevin §4.4) and two gradient steps per
batch (§3.3), as the run's RL settings, and its KernelBench split (config/kevin.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kpipe.agent.loop import Sampling
from kpipe.train import rollouts
from kpipe.train.rl_config import RLConfig

CONFIG = Path(__file__).resolve().parents[1] / "config"


def kevin_run() -> RLConfig:
    return RLConfig.from_dict(yaml.safe_load((CONFIG / "ablations" / "kevin.yaml").read_text())["rl"]["runs"]["kevin"])


def test_kevin_responses_grow_from_16k_to_22k_tokens_at_step_30_and_each_batch_takes_two_steps():
    cfg = kevin_run()
    assert [cfg.max_tokens_at(step) for step in (0, 28, 29, 39)] == [16384, 16384, 22528, 22528]  # 0-based steps
    assert (cfg.ppo_epochs, cfg.mini_batches) == (2, 1)  # 1 on-policy, 1 off-policy
    assert RLConfig().max_tokens_at(299) == 8192  # the paper's: one cap throughout
    with pytest.raises(ValueError, match="extend_at_step >= 1"):
        RLConfig(extend_max_tokens=100, extend_at_step=0)


def test_rollouts_of_a_step_use_that_steps_cap(monkeypatch):
    seen: list[Sampling] = []
    monkeypatch.setattr(rollouts, "run_episodes", lambda *args, sampling, **kwargs: seen.append(sampling) or [])
    for step in (28, 29):
        rollouts.rollout_rows([], engine=None, evaluator=None, cfg=kevin_run(), run="kevin", iteration=2,
                                 global_step=step, progress=False)
    assert [sampling.max_tokens for sampling in seen] == [16384, 22528]


def test_kevin_split_trains_on_180_tasks_and_evaluates_the_20_others_at_16_by_8():
    split = yaml.safe_load((CONFIG / "kevin.yaml").read_text())
    (train,) = split["queries"]["sources"]
    train_ids = {(level, i) for level in (1, 2) for i in train["ids"][f"level_{level}"]}
    eval_ids = {(level, i) for level in (1, 2) for i in split["kernelbench"]["ids"][f"level_{level}"]}
    assert len(train_ids) == 180 and len(eval_ids) == 20 and not train_ids & eval_ids
    assert train_ids | eval_ids == {(level, i) for level in (1, 2) for i in range(1, 101)}
    assert (split["eval"]["samples"], split["eval"]["turns"]) == (16, 8)
    assert (split["eval_budget"]["kernels"], split["eval_budget"]["turns"]) == (128, [1, 4, 8])
