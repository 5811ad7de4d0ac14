"""The RL step's deterministic outputs, recorded once at main 73f9be3 (before the loop became one batch
object) so that a reshaped loop can be checked to train alike (tests/test_rl_golden.py). The recorder
below is kept as it ran there (`python tests/rl_golden.py DIR` at 73f9be3; run_iteration's signature of
then): rerecord only on a change meant to alter training, and say so. Since recorded: `trained_row_tokens`, a
new metric, added to each fixture with every recorded value checked unchanged.

Deterministic here: every KernelGym result comes from `JudgeByText` (a function of the answer's text;
on a CPU real rewards depend on the interpreter's timings), one torch thread, fp32, a seeded nano policy.
Times (gen_s, eval_s, the phases' seconds, ...) are left out: they are the clock's.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "rl_golden"
RELU = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(4, 4)]


def get_init_inputs():
    return []
'''
# the settings each recorded run adds to the shared shape (2 prompts x 2 rollouts x 2 turns, 2 steps)
VARIANTS: dict[str, dict[str, Any]] = {
    "trloo_mrs": {"mrs": True},
    "grpo_filters_kl": {"advantage": "grpo", "regression_filter": True, "zero_variance_filter": True,
                        "kl_coef": 0.1, "gamma": 0.9},
    "buffer_tritonforge": {"buffer": "tritonforge", "advantage": "grpo", "reward": "tritonforge"},
}
ROW_COLUMNS = ("task_id", "sample", "turn", "reward", "return_to_go", "advantage", "kept", "rejected_by",
               "response_token_ids", "response_logprobs", "status")


class JudgeByText:
    """KernelGym's stand-in: each result a function of the candidate's text alone."""

    def evaluate_many(self, jobs: list[tuple[str, str]]) -> list[dict]:
        results = []
        for _, candidate in jobs:
            score = int(hashlib.sha256(candidate.encode()).hexdigest()[:4], 16) % 4
            results.append({"status": "pass" if score else "mismatch", "correct": bool(score), "hacked": False,
                            "speedup_eager": 0.5 * score or None, "key": candidate[:8], "feedback": f"score {score}"})
        return results


def is_time(name: str) -> bool:
    return name.endswith("_s")


def outputs(trajectories: Path, metrics: Path) -> dict[str, Any]:
    """What the fixture keeps of an iteration's outputs: the rows' training columns and the untimed metrics."""
    from kpipe.data.io import read_table

    rows = [{key: row[key] for key in ROW_COLUMNS} for row in read_table(trajectories, "trajectories").to_pylist()]
    table = read_table(metrics, "train_metrics").to_pylist()
    values = {f"{row['step']}:{row['name']}": row["value"] for row in table if not is_time(row["name"])}
    return {"rows": rows, "metrics": values}


def record_run(run_variant: Any, nano_model: Path, root: Path, variant: str) -> dict[str, Any]:
    """One seeded 2-step iteration of `variant`; `run_variant(cfg, tasks, judge, root)` runs it and
    returns its trajectories and metrics paths (how an iteration is started is the code's own)."""
    from kpipe.agent import loop
    from kpipe.agent.loop import AgentTask
    from kpipe.llm.extract import Extracted
    from kpipe.train.rl_config import RLConfig

    cfg = RLConfig(prompts_per_step=2, rollouts_per_prompt=2, max_turns=2, max_tokens=6, generation_batch_size=2,
                   steps_per_iteration=2, lr=1e-3, mixed_precision="no", async_mode="off", **VARIANTS[variant])
    tasks = [AgentTask("relu-a", RELU), AgentTask("relu-b", RELU.replace("4, 4", "4, 8"))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    original = loop.extract_code
    loop.extract_code = lambda text: Extracted(text or None, "empty answer")  # every answer is judged
    try:
        trajectories, metrics = run_variant(cfg, tasks, JudgeByText(), root)
    finally:
        loop.extract_code = original
        torch.set_num_threads(threads)
    return outputs(trajectories, metrics)


def main(out: Path) -> None:
    import tempfile

    from kpipe.train import rl
    from kpipe.train.tiny_model import build_tiny_model, policy_corpus

    def run_at_main(cfg, tasks, judge, root):  # run_iteration's signature at 73f9be3
        rl.run_iteration(cfg, tasks, nano, root / "model", root / "traj.parquet", root / "metrics.parquet",
                         root / "scratch", run="golden", iteration=0, gym={"backend": "local"}, evaluator=judge,
                         progress=False, reference_model=nano)
        return root / "traj.parquet", root / "metrics.parquet"

    with tempfile.TemporaryDirectory() as tmp:
        nano = build_tiny_model(Path(tmp) / "nano", seed=0, size="nano", corpus=policy_corpus(), vocab_size=4000)
        for variant in VARIANTS:
            recorded = record_run(run_at_main, nano, Path(tmp) / variant, variant)
            (out / f"{variant}.json").write_text(json.dumps(recorded, indent=1, sort_keys=True))
            print(variant, len(recorded["rows"]), "rows", len(recorded["metrics"]), "metrics")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURES)
