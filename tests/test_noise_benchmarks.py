"""The timing-noise probes (benchmarks/noise_runs.py, timing_residual.py, pairing_methods.py, window_state.py): their
reports on small synthetic trials, computed here as their GPU runs print them (they also re-read a run's saved
trials with --replay), and the bank pairs they time, loaded on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import noise_runs  # noqa: E402
import pairing_methods  # noqa: E402
import timing_residual  # noqa: E402


def test_the_share_of_five_draws_spreading_beyond_the_bound():
    assert noise_runs.share_spread_beyond([1.0] * 10) == 0.0
    # five drawn without replacement from five of each: all alike in 2 of the 252 draws
    assert noise_runs.share_spread_beyond([1.0, 1.1] * 5) == pytest.approx(1 - 2 / 252, abs=0.01)
    assert noise_runs.share_spread_beyond([1.0] * 4) != noise_runs.share_spread_beyond([1.0] * 4)  # too few: nan


def rows(level: float) -> tuple[list[float], list[float]]:
    candidate = [2.0 * level] * 100
    reference = [2.8 * level] * 50
    return candidate, reference


def test_residual_report_reads_a_steady_gpu_as_no_spread_and_a_shared_drift_as_none_either():
    processes = []
    for p in range(2):
        process = []
        for b in range(2):
            for r in range(2):
                candidate, reference = rows(1.0 + 0.03 * (p + r))  # the GPU drifts; both programs with it
                process.append({"build": b, "retime": r, "hooked": r == 1, "candidate": candidate, "reference": reference})
        processes.append(process)
    table = timing_residual.report({"L2_12": processes})
    judge = next(line for line in table if "| judge |" in line)
    assert judge.startswith("| L2_12 | judge | 1.000 | 1.000 | 1.000 | 1.000 | 0.00% | 0.00 |")


def test_pairing_report_compares_each_method_with_the_two_timed_alone():
    round_ = {"alone": {"candidate": [2.0] * 100, "reference": [3.0] * 100}}
    for method, (_, reference_trials, _) in pairing_methods.METHODS.items():
        round_[method] = {"candidate": [2.0] * 100, "reference": [2.8] * reference_trials}  # beside: 7 % below alone
    table = pairing_methods.report({"L2_12": [round_] * 6})
    assert "| L2_12 | chunks of 10 | 1.400 | 0.00% | 0.00 | 0.933 |" in table
    assert "| L2_12 | the two timed alone | 1.500 | | | |" in table


def test_window_state_report_gives_each_variant_its_spread_and_reads_kgym6_trials_in_the_order_they_ran():
    import window_state

    order = [True] * 7 + [False] * 4 + [True] * 13 + [False] * 6  # kgym-6: chunks of random length
    steady = {"sm_mhz": 1980.0, "mem_mhz": 2619.0, "power_w": 500.0, "gpu_c": 60.0, "mem_c": float("nan")}
    rows = []
    for r in range(6):
        level = 1.0 + 0.02 * (r % 2)  # kgym-4's windows move 2 % against the reference; kgym-6's hold
        rows.append({"round": r, "variant": "kgym-4", "at_s": float(r), "candidate": [2.0 * level] * 20, "reference": [2.8] * 10, **steady})
        rows.append({"round": r, "variant": "kgym-6", "at_s": r + 0.5, "candidate": [2.0] * 7 + [1.9] * 13,
                     "reference": [2.8] * 4 + [2.66] * 6, "order": order, **steady})
    table = window_state.report({"L2_76": [rows]})
    kgym4 = next(line for line in table if "| kgym-4 |" in line)
    kgym6 = next(line for line in table if "| kgym-6 |" in line)
    assert "| 0.99% |" in kgym4
    # each kgym-6 chunk against the reference chunk after it: 2.0 / 2.8 and 1.9 / 2.66 are one ratio
    assert kgym6.startswith("| L2_76 | kgym-6 | 1.400 | 0.00% | 0.00 |")


def test_the_probes_load_each_pair_as_the_child_does_and_its_candidate_computes_the_reference(monkeypatch):
    """What every probe's GPU run times, built here on the CPU (Triton interpreter, sizes capped)."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kpipe.gym.child import TIMING_SETS

    pair = next(noise_runs.loaded_pairs(["L1_19"], device="cpu", shrink=64))
    assert pair.task == "L1_19" and pair.seed == 42  # the protocol's seed
    inputs = pair.input_sets()
    assert len(inputs) == TIMING_SETS and len(pair.input_sets(2)) == 2
    assert not torch.equal(inputs[0][0], inputs[1][0])  # a fresh input set per trial seed
    assert torch.equal(pair.input_sets(1)[0][0], inputs[0][0])  # and the same set for the same seed
    with torch.no_grad():
        torch.testing.assert_close(pair.candidate_model()(*inputs[0]), pair.reference_model()(*inputs[0]))
