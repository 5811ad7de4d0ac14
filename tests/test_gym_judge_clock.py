"""Hostile candidates that go after the speedup (issue 62, rows 1-5, 7 and 8): they rewrite the
timings their process holds, forge what it writes for the judge, memoise outputs, compute only the
calls or output positions they expect to be checked, replay a seed that leaked, or claim a third of
what they take. Since kgym-14 the verdict and the reward come only from what the judge observes
itself: its own clock around timing windows on fresh inputs from a secret seed that serves one
candidate once, and every output of every call. Each attack runs for real through ``kpipe gym eval``
and the pool (``kpipe gym eval-batch``, an honest kernel after each); row 7's replay needs a judge
that keeps its reference run between candidates, so it runs where the pool's workers evaluate
(``evaluate(reuse_reference=True)`` in one process).

The reference sleeps 20 ms a call, so every figure is far above the CPU host's noise: an attack
whose true cost is 60 ms a call must read about 1/3 on the judge's clock, whatever it claims.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_attack_runs import DEVICE, FIXTURES, LEGIT, evaluate_each_then_honest, evaluate_fresh, reasons_of

PROTOCOL = {"correct_trials": 2, "perf_trials": 3, "warmup": 0, "baseline": "eager", "timeout_s": 120, "reject_findings": [],
            "device": DEVICE}
# ReLU at 20 ms a call, on 64 x 128 = 8192 elements: more than a window sends whole, so its windows
# are checked at secret positions and by a sketch of every element (kpipe.gym.candidate.trial_data.WindowOutputs)
SLEEPY_REFERENCE = '''
import time

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        time.sleep(0.02)
        return torch.relu(x)


def get_inputs():
    return [torch.randn(64, 128)]


def get_init_inputs():
    return []
'''
KERNEL = "\n" + (FIXTURES / "attack_prelude.py").read_text() + '''

def in_a_window():
    """Whether the judge has revealed a timing window's seed (its file in our scratch)."""
    return any(name.startswith("window-") and not name.startswith("window-ready") for name in os.listdir("."))


def latest_seed():
    names = [name for name in os.listdir(".") if name.startswith("window-") and name[7:].isdigit()]
    return json.load(open(max(names, key=lambda name: int(name[7:])))).get("seed")
'''
KERNEL = KERNEL.replace("import os, sys, time", "import json, os, sys, time", 1)
REWRITE_TIMINGS = '''
import gc


def shrink_every_timing(factor):
    """Every time in this process's memory, divided by `factor` (kgym-13's rows 1 and 8)."""
    for thing in gc.get_objects():
        if isinstance(thing, dict):
            for key, value in list(thing.items()):
                if isinstance(key, str) and "ms" in key and isinstance(value, float):
                    thing[key] = value / factor
                elif isinstance(key, str) and "ms" in key and isinstance(value, list) and all(isinstance(v, float) for v in value):
                    thing[key] = [v / factor for v in value]
'''

ATTACKS = {
    # row 1: takes 3x the reference's time and rewrites every timing it can reach
    "rewrites_its_timings_in_memory": KERNEL + REWRITE_TIMINGS + '''

class ModelNew(nn.Module):
    def forward(self, x):
        time.sleep(0.06)
        if in_a_window():
            shrink_every_timing(1000.0)
        return torch_behind_a_kernel(x)
''',
    # row 2: a zeros kernel; every output the judge is shown is the reference's, computed in its own
    # process from the inputs it saw, with the reports of a clean run
    "forges_the_exchange_from_memory": KERNEL + '''
# the judge's module, by its spec: it runs as __main__ in a fresh interpreter
child = next(m for m in list(sys.modules.values()) if getattr(getattr(m, "__spec__", None), "name", "") == "kpipe.gym.candidate.child")
real_flatten = child.flatten_output
reference = sys.modules["kpipe_reference"].Model()
seen = []


def flatten(output):
    if seen and not launches_take_effect(seen[-1]):  # the ghost replay: look like the kernels matter
        return real_flatten(torch.full_like(output, float("nan")))
    return real_flatten(reference(seen[-1]) if seen else output)


child.flatten_output = flatten
child.patched_names = lambda before: []


class ModelNew(nn.Module):
    def forward(self, x):
        seen.append(x)
        decorative(x)
        return torch.zeros_like(x)
''',
    # row 3: outputs memoised by input content; every timed trial of kgym-13 reused its inputs
    "memoises_outputs_by_input_content": KERNEL + '''
memo = {}


class ModelNew(nn.Module):
    def forward(self, x):
        key = x.cpu().numpy().tobytes()
        if key in memo and launches_take_effect(x):  # not in the ghost replay, which sees the kernels matter
            return memo[key].clone()
        time.sleep(0.06)
        out = torch_behind_a_kernel(x)
        memo[key] = out.clone()
        return out
''',
    # row 4: computes only the first call of each window (kgym-13 checked 3 predictable trials)
    "computes_only_the_checked_calls": KERNEL + '''
calls = {}


class ModelNew(nn.Module):
    def forward(self, x):
        if in_a_window():
            seed = latest_seed()
            calls[seed] = calls.get(seed, 0) + 1
            if calls[seed] > 1:
                decorative(x)
                return torch.zeros_like(x)
        return torch_behind_a_kernel(x)
''',
    # row 5: in a window, computes only the positions the judge samples (drawn from the seed it reads)
    "computes_only_the_sampled_positions": KERNEL + '''
from kpipe.gym.candidate.trial_data import WINDOW_FULL_ELEMENTS


class ModelNew(nn.Module):
    def forward(self, x):
        if not in_a_window():
            return torch_behind_a_kernel(x)
        generator = torch.Generator().manual_seed(latest_seed())
        positions = torch.randint(0, x.numel(), (WINDOW_FULL_ELEMENTS,), generator=generator)
        out = torch.zeros(x.numel())
        out[positions] = torch.relu(x.reshape(-1)[positions])
        decorative(x)
        return out.reshape(x.shape)
''',
    # row 8: computes at the reference's own speed and claims a third of it
    "claims_a_third_of_the_references_speed": KERNEL + REWRITE_TIMINGS + '''
reference = sys.modules["kpipe_reference"].Model()


class ModelNew(nn.Module):
    def forward(self, x):
        if in_a_window():
            shrink_every_timing(3.0)
        if not launches_take_effect(x):
            return torch.full_like(x, float("nan"))
        return reference(x)
''',
}
# what the judge's clock and comparisons make of each: (status, a phrase of its reasons or
# diagnostic, the highest speedup it may read). Each passed at 2.5-734x against kgym-13's judge. The bound is
# twice the speed the attack really has (a third of the reference's, or the reference's own): on a loaded
# 2-core host (`make test` beside `.ci/run`) the windows' ratio read the forger, which runs the reference's
# sleeping forward, at 1.78x, and beside another `make test` once through the pool at 2.02x, failing this bound: its
# kept reference run had been timed under a heavier load (docs/kernelgym.md, Known limits, "A reference run timed
# under another load than its candidates"); a forgery that worked would read 3x (the challenge's old bound) to 734x.
EXPECTED = {
    "rewrites_its_timings_in_memory": ("pass", "", 2 / 3),
    "forges_the_exchange_from_memory": ("pass", "", 2.0),  # the reference's speed, computed on the judge's clock
    "memoises_outputs_by_input_content": ("pass", "", 2 / 3),  # every window's inputs are fresh: no hit
    "computes_only_the_checked_calls": ("hacked", "window_output_mismatch: call 1 of timing window 0", None),
    "computes_only_the_sampled_positions": ("hacked", "its sketch over every element", None),
    "claims_a_third_of_the_references_speed": ("pass", "", 2.0),
}


def assert_judged(name: str, result: dict[str, object]) -> None:
    status, phrase, most = EXPECTED[name]
    text = json.dumps(result, default=str)[:3000]
    assert result["status"] == status and phrase in reasons_of(result) + str(result["diagnostic"]), f"{name}: {text}"
    if most is not None:
        assert result["speedup_eager"] is not None and result["speedup_eager"] < most, f"{name} read {result['speedup_eager']}x: {text}"


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_attack_on_the_speedup_is_judged_by_the_judges_clock_through_kpipe_gym_eval(tmp_path: Path, name: str) -> None:
    assert_judged(name, evaluate_fresh(tmp_path, ATTACKS[name], PROTOCOL, reference=SLEEPY_REFERENCE))


def test_every_attack_on_the_speedup_fails_through_the_pool_and_each_next_honest_kernel_passes(tmp_path: Path) -> None:
    for name, (attacked, honest) in evaluate_each_then_honest(tmp_path, ATTACKS, PROTOCOL, reference=SLEEPY_REFERENCE).items():
        assert_judged(name, attacked)
        assert honest["status"] == "pass", f"the honest kernel after {name}: {honest['status']} {honest['diagnostic']}"


def test_a_leaked_seed_serves_no_later_candidate_of_a_reused_reference_run() -> None:
    """Row 7: one candidate leaks its windows' seeds (here in its own error, in hex: no filter can
    know every encoding), the next replays them, computing fast only for a seed it knows. Each
    window's seed serves one candidate, so the replay never meets its seed and is timed as slow as
    it is; the literal seed never reaches the feedback."""
    import re

    from kpipe.gym import Protocol, evaluate
    from kpipe.gym.judge.evaluation import _reference_cache

    protocol = Protocol.from_dict(PROTOCOL)
    _reference_cache.clear()
    leaker = KERNEL + '''

class ModelNew(nn.Module):
    def forward(self, x):
        if in_a_window():
            raise RuntimeError(f"leaked {latest_seed():x}")
        return torch_behind_a_kernel(x)
'''
    leaked = evaluate(SLEEPY_REFERENCE, leaker, protocol, reuse_reference=True)
    (seed_hex,) = set(re.findall(r"leaked ([0-9a-f]+)", leaked.diagnostic))
    assert leaked.status == "runtime_error" and str(int(seed_hex, 16)) not in leaked.feedback + leaked.diagnostic
    replay = KERNEL + f'''
LEAKED = {{{int(seed_hex, 16)}}}


class ModelNew(nn.Module):
    def forward(self, x):
        if not (in_a_window() and latest_seed() in LEAKED):
            time.sleep(0.06)  # the truth: 3x the reference's time
        return torch_behind_a_kernel(x)
'''
    replayed = evaluate(SLEEPY_REFERENCE, replay, protocol, reuse_reference=True)
    assert replayed.status == "pass" and replayed.speedup_eager is not None and replayed.speedup_eager < 0.5, replayed.to_row()
    honest = evaluate(SLEEPY_REFERENCE, LEGIT, protocol, reuse_reference=True)
    assert honest.status == "pass", honest.diagnostic
    _reference_cache.clear()
