"""The pure figures of benchmarks/kernelbench_side_by_side.py: a child's phases grouped, and the
seconds outside them measured against the judge's whole child run."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "kernelbench_side_by_side", Path(__file__).resolve().parent.parent / "benchmarks" / "kernelbench_side_by_side.py")
side_by_side = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(side_by_side)


def test_phases_are_grouped_and_outside_is_the_judges_child_seconds_minus_them():
    # the child was stopped 1.5 s inside its first correctness trial while the other worker's child timed:
    # its own wall time (1.3 s) leaves that out, its phases and the judge's 3.0 s keep it
    stats = {"wall_s": 1.3, "phases": [["prepare (lazy torch state, hooks)", 0.1], ["candidate correctness trial 0", 2.0],
                                       ["candidate correctness trial 1", 0.1], ["candidate timing", 0.6]]}
    groups = side_by_side.grouped_phases(stats, child_s=3.0)
    assert groups["correctness"] == pytest.approx(2.1)
    assert groups["prepare"] == pytest.approx(0.1)
    assert groups["timing"] == pytest.approx(0.6)
    assert groups["outside"] == pytest.approx(0.2)


def test_without_the_judges_seconds_nothing_is_called_outside():
    assert "outside" not in side_by_side.grouped_phases({"phases": [["candidate timing", 0.6]]}, child_s=None)
    assert side_by_side.grouped_phases(None, child_s=1.0) == {}


def test_agreement_compares_kernelbench_with_the_median_of_kpipes_repeats_and_skips_failures():
    kb = [{"task": "a", "speedup": 2.0}, {"task": "b", "ref_ms": 1.0, "runtime_ms": 0.5}, {"task": "c"}]
    repeats = [[{"speedup": 2.2}, {"speedup": 1.9}, {"speedup": 1.0}],
               [{"speedup": 1.8}, {}, {"speedup": 1.0}],
               [{"speedup": 2.1}, {"speedup": 2.1}, {}]]
    rows = side_by_side.speedup_agreement(kb, repeats)
    assert [row["task"] for row in rows] == ["a", "b"]  # c: KernelBench failed it
    assert rows[0]["kpipe"] == pytest.approx(2.1) and rows[0]["gap_pct"] == pytest.approx(5.0)
    assert rows[1]["kpipe"] == pytest.approx(2.0) and rows[1]["gap_pct"] == pytest.approx(0.0)  # median of 1.9 and 2.1


def test_a_self_candidate_is_its_reference_under_the_candidates_name_and_passes_the_screen():
    """--self-candidates: each reference as its own candidate, a speedup of 1 by construction (each harness's bias)."""
    from kpipe.gym.judge.screen import screen

    pair = side_by_side.bank_pairs(["L2_76"], shrink=64, self_candidates=True)[0]
    assert pair["candidate"].startswith(pair["reference"]) and "class ModelNew(Model):" in pair["candidate"]
    assert screen(pair["candidate"]).status is None
    assert side_by_side.bank_pairs(["L2_76"], shrink=64)[0]["candidate"] != pair["candidate"]  # the bank's kernel


def test_the_window_table_shows_each_candidates_windows_beside_the_reference_windows_it_was_handed():
    """The reading of the H200 run at kgym-18 (docs/kernelgym.md, Known limits): the fixed cost of the
    reference's windows falls along its stock, and later candidates read slower."""
    pairs = [{"task": "L2_86"}, {"task": "L1_40"}]
    kpipe = {"repeats": [[{"key": "a1"}, {"key": "b1"}], [{"key": "a2"}, {"key": "b2"}]]}
    trace = {"a1": {"window_calls": 24, "window_fixed_ms": [26.0, 24.0], "window_candidate_s": [0.0655, 0.0656],
                    "candidate_ms": 1.973, "eager_ms": 2.7315},
             "a2": {"window_calls": 24, "window_fixed_ms": [18.2, 18.3], "window_candidate_s": [0.0702, 0.0695],
                    "candidate_ms": 2.138, "eager_ms": 2.7308},
             "b1": {"status": "compilation_error"}}  # no windows: no row
    lines = side_by_side.window_table(pairs, kpipe, trace)
    assert lines[2:] == ["| L2_86 | 1 | 24 | 26.0, 24.0 | 65.5, 65.6 | 1.973 | 2.732 |",
                         "| L2_86 | 2 | 24 | 18.2, 18.3 | 70.2, 69.5 | 2.138 | 2.731 |"]
