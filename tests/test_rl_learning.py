"""Acceptance: the RL machinery learns (docs/rl.md, "The offline learning check").

Setting: a tiny Qwen3 model (the `nano` preset) with a BPE tokenizer trained on the prompt and
the bank's kernels, SFT'd (kpipe.train.sft) on three answers to KernelBench L1 ReLU — one
correct Triton kernel and two buggy ones, one token apart — so that at temperature 1 it writes
a mix of correct, buggy and broken programs. Five RL iterations (TRLOO, 16 rollouts, one turn,
KernelGym judging every program for real) must raise the mean reward of the rollouts, read back
from `train_metrics`, by at least REWARD_MARGIN over iteration 0's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kpipe.agent.loop import AgentTask
from kpipe.data.io import read_table
from kpipe.data.kernelbench import load_problems, shrink_sizes
from kpipe.gym import Protocol
from kpipe.gym.bank import list_solutions
from kpipe.llm.prompts import first_turn_messages
from kpipe.train.rl import run_iteration
from kpipe.train.rl_config import IterationSettings, RLConfig
from kpipe.train.tiny_model import build_tiny_model

ITERATIONS = 5
REWARD_MARGIN = 0.3  # observed: 0.32 -> 0.44, 0.82, 0.89, 0.76 (seeded; docs/rl.md)
PROTOCOL = {"correct_trials": 2, "perf_trials": 3, "warmup": 1, "profile": False, "baseline": "eager"}
KERNEL = '''import torch
import triton
import triton.language as tl


@triton.jit
def k(x, y, n):
    i = tl.arange(0, 4096)
    m = i < n
    tl.store(y + i, tl.maximum(tl.load(x + i, mask=m), 0.0), mask=m)


class ModelNew(torch.nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        k[(1,)](x, y, x.numel())
        return y
'''
ANSWERS = [KERNEL, KERNEL.replace("m = i < n", "m = i < n - 1"), KERNEL.replace("tl.maximum", "tl.minimum")]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def relu_task() -> AgentTask:
    problem = next(p for p in load_problems("main") if (p.level, p.problem_id) == (1, 19))
    return AgentTask("kb-main-L1-19", shrink_sizes(problem.code, 48))


def sft_policy(root: Path, task: AgentTask) -> Path:
    """SFT on the three answers until the model reproduces them (loss ~0.01)."""
    from kpipe.train.sft import SFTConfig, train_sft

    messages = first_turn_messages(task.reference_src)
    responses = [f"```python\n{code}```" for code in ANSWERS]
    corpus = [m["content"] for m in messages] + [s.source for s in list_solutions()] + responses
    base = build_tiny_model(root / "base", seed=0, size="nano", corpus=corpus, vocab_size=800)
    rows = [{"run": "sft", "stage": "coldstart", "iteration": 0, "task_id": task.task_id, "sample": i, "turn": 1,
             "prompt_messages": messages, "response": response, "status": "pass", "correct": True}
            for i, response in enumerate(responses)]
    cfg = SFTConfig(base_model=str(base), run="sft", lr=1e-2, batch_size=3, epochs=120, max_steps=120,
                    max_length=4096, micro_batch_tokens=16384, warmup_ratio=0.0, schedule="constant",
                    weight_decay=0.0, seed=0)
    return train_sft(cfg, rows, root / "sft", root / "sft_metrics.parquet").model_dir


def test_rl_iterations_raise_the_mean_reward(tmp_path):
    from kpipe.gym.serve.cache import ResultCache
    from kpipe.gym.serve.pool import GymPool

    task = relu_task()
    model, state = sft_policy(tmp_path, task), None
    cfg = RLConfig(prompts_per_step=1, rollouts_per_prompt=16, max_turns=1, max_tokens=120, lr=3e-4,
                   micro_batch_tokens=16384)
    metric_files = []
    # the result cache of the DAG's RL jobs (gym.cache): a program written again is judged once
    cache = ResultCache(tmp_path / "gym-cache.sqlite")
    with GymPool(Protocol.from_dict(PROTOCOL), workers=1, reuse_reference=True, cache=cache, progress=False) as pool:
        for iteration in range(ITERATIONS):
            out = tmp_path / f"iter={iteration}"
            metric_files.append(out / "metrics.parquet")
            run_iteration(IterationSettings(cfg=cfg, tasks=(task,), init_model=model, model_out=out / "model",
                                            trajectories=out / "trajectories.parquet", metrics=metric_files[-1],
                                            scratch=out / "scratch", run="learn", iteration=iteration,
                                            init_state=state, state_out=out / "state", gym={"protocol": PROTOCOL},
                                            progress=False), evaluator=pool)
            model, state = out / "model", out / "state"
    metrics = read_table(metric_files, "train_metrics").to_pandas()
    reward = metrics[metrics.name == "reward_mean"].set_index("iteration")["value"]
    assert 0.0 < reward[0] < 0.6, f"iteration 0 should mix correct and wrong kernels: {reward.to_dict()}"
    assert reward[[ITERATIONS - 2, ITERATIONS - 1]].mean() >= reward[0] + REWARD_MARGIN, reward.to_dict()
