"""The RL step reads in few places: walking its imports from `kpipe.train.rl` through the training
package reaches at most 10 modules (issue 66's 9 and the 8B trainer's memory, issue 63), and the rewards and advantage estimators are registered in one
of them, `kpipe.train.algos`, beside their functions. (Modules of the stages below training, the
agent loop, KernelGym, the data layer, are entered there and not walked: they have their own tests.)"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kpipe"
MAX_MODULES = 10


def train_imports(module: str) -> set[str]:
    """The `kpipe.train` modules `module` imports (function-level imports included)."""
    path = PACKAGE / Path(*module.split(".")[1:]).with_suffix(".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kpipe.train"):
            names = [node.module] if node.module != "kpipe.train" else [f"kpipe.train.{a.name}" for a in node.names]
            found |= {name for name in names if (PACKAGE / Path(*name.split(".")[1:])).with_suffix(".py").exists()}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kpipe.train.")}
    return found


def walk(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(train_imports(module))
    return seen


def test_the_rl_step_walks_at_most_ten_modules():
    modules = walk("kpipe.train.rl")
    assert len(modules) <= MAX_MODULES, sorted(modules)
    assert {"kpipe.train.rl_batch", "kpipe.train.rl_update", "kpipe.train.rollouts", "kpipe.train.algos"} <= modules


def test_rewards_and_estimators_are_registered_in_one_place():
    from kpipe.train import algos
    from kpipe.train.rl_config import RLConfig

    assert set(algos.REWARDS) == {"paper", "released_code", "kevin", "tritonforge"}
    assert {"trloo", "grpo", "rloo_trajectory", "grpo_std", "kevin"} <= set(algos.ADVANTAGES)
    for entry in [*algos.REWARDS.values(), *algos.ADVANTAGES.values()]:
        assert entry.fn.__module__ == "kpipe.train.algos", entry.name
    # the config's choices are the registries'
    for key, registry in (("reward", algos.REWARDS), ("advantage", algos.ADVANTAGES)):
        for name in registry:
            assert getattr(RLConfig.from_dict({key: name}), key) == name


def test_a_registered_reward_is_a_choice_of_the_config_and_scores_turns():
    """What README's "Extending" shows: a new reward is one decorated function."""
    from kpipe.train import algos
    from kpipe.train.rl_config import RLConfig

    @algos.register_reward("correct_only")
    def reward_correct_only(correct, hacked, speedup, pr=None, use_pr=False, speedup_cap=algos.SPEEDUP_CAP):
        return float(algos.earns_reward(correct, hacked))

    try:
        assert RLConfig.from_dict({"reward": "correct_only"}).reward == "correct_only"
        score = algos.turn_reward("correct_only")
        assert score({"correct": True, "hacked": False, "speedup_eager": 9.0}) == 1.0
        assert score({"correct": True, "hacked": True}) == 0.0
    finally:
        del algos.REWARDS["correct_only"]
