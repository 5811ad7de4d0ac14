"""Issue 64, item 8: Kevin's models are evaluated as Kevin infers, with earlier reasoning summarised,
while every other model keeps the full history."""

from __future__ import annotations

from pathlib import Path

import yaml

from kpipe.agent.history import FullHistory, KevinSummaries
from kpipe.evaluate.kernelbench import inference_history

CONFIG = Path(__file__).resolve().parents[1] / "config"


def test_kevin_models_infer_with_summarised_history_and_the_others_with_the_full_one():
    models = {entry["name"]: entry for entry in yaml.safe_load((CONFIG / "kevin.yaml").read_text())["models"]}
    assert isinstance(inference_history(models["kevin-sft"]), KevinSummaries)
    assert isinstance(inference_history(models["kevin-rl"]), KevinSummaries)
    assert isinstance(inference_history(models["drkernel-rl"]), FullHistory)
    assert isinstance(inference_history({"name": "m", "kind": "hf"}), FullHistory)
