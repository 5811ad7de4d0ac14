"""The RL step trains as it did at main 73f9be3, before the loop became one batch that each phase adds
to: the same rows (rewards, returns, advantages, filters, log-probs) and the same untimed metrics, for
three settings (tests/rl_golden.py says what is deterministic and how the fixtures were recorded)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rl_golden import FIXTURES, VARIANTS, record_run

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def nano_model(tmp_path_factory) -> Path:
    from kpipe.train.tiny_model import build_tiny_model, policy_corpus

    return build_tiny_model(tmp_path_factory.mktemp("nano") / "model", seed=0, size="nano", corpus=policy_corpus(),
                            vocab_size=4000)


def same(recorded, now, where: str) -> None:
    """Equal values; floats to 1e-9 relative (NaN equals NaN)."""
    if isinstance(recorded, float) or isinstance(now, float):
        assert (math.isnan(recorded) and math.isnan(now)) or now == pytest.approx(recorded, rel=1e-9, abs=1e-12), where
    elif isinstance(recorded, list):
        assert isinstance(now, list) and len(now) == len(recorded), where
        for index, (a, b) in enumerate(zip(recorded, now)):
            same(a, b, f"{where}[{index}]")
    elif isinstance(recorded, dict):
        assert set(now) == set(recorded), f"{where}: {sorted(set(now) ^ set(recorded))}"
        for key in recorded:
            same(recorded[key], now[key], f"{where}.{key}")
    else:
        assert now == recorded, where


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_rl_step_trains_as_at_main(nano_model, tmp_path, variant):
    from kpipe.train import rl
    from kpipe.train.rl_config import IterationSettings

    def run_now(cfg, tasks, judge, root):
        settings = IterationSettings(cfg=cfg, tasks=tuple(tasks), init_model=nano_model, model_out=root / "model",
                                     trajectories=root / "traj.parquet", metrics=root / "metrics.parquet",
                                     scratch=root / "scratch", run="golden", iteration=0, gym={"backend": "local"},
                                     progress=False, reference_model=nano_model)
        rl.run_iteration(settings, evaluator=judge)
        return settings.trajectories, settings.metrics

    recorded = json.loads((FIXTURES / f"{variant}.json").read_text())
    now = record_run(run_now, nano_model, tmp_path, variant)
    assert any(row["advantage"] for row in recorded["rows"]) or variant == "buffer_tritonforge"
    same(recorded, json.loads(json.dumps(now)), variant)
