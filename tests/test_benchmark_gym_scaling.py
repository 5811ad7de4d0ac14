"""The pure figures of benchmarks/gym_scaling.py: overlapping timed spans, and where the workers'
time went (busy share, the pass's idle tail, late joins, gaps between evaluations)."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("gym_scaling", Path(__file__).resolve().parent.parent / "benchmarks" / "gym_scaling.py")
gym_scaling = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gym_scaling)


def test_overlapping_spans_counts_pairs_on_one_gpu_only():
    rows = [{"device_id": "a", "timed_spans": [[0.0, 1.0]]}, {"device_id": "a", "timed_spans": [[0.5, 2.0]]},
            {"device_id": "b", "timed_spans": [[0.5, 2.0]]}, {"device_id": "a", "timed_spans": [[2.0, 3.0]]}]
    assert gym_scaling.overlapping_spans(rows) == 1


def test_worker_time_is_the_busy_share_and_the_idle_tail_per_judge():
    # two judges over a 10 s window: one busy 8 s finishing at 9, the other busy 4 s finishing at 6
    records = [{"judge_pid": 1, "started_unix": 100.0, "wall_s": 5.0}, {"judge_pid": 1, "started_unix": 106.0, "wall_s": 3.0},
               {"judge_pid": 2, "started_unix": 102.0, "wall_s": 4.0}]
    figures = gym_scaling.worker_time(records, ready_unix=100.0, done_unix=110.0)
    assert figures["busy_share"] == pytest.approx((0.8 + 0.4) / 2)
    assert figures["tail_s_mean"] == pytest.approx((1.0 + 4.0) / 2)
    assert figures["tail_s_max"] == pytest.approx(4.0)
    # judge 2 began 2 s after the pool was ready; judge 1 waited 1 s between its two evaluations
    assert figures["join_s_mean"] == pytest.approx((0.0 + 2.0) / 2)
    assert figures["join_s_max"] == pytest.approx(2.0)
    assert figures["gap_s_mean"] == pytest.approx(1.0)


def test_worker_time_without_records_reports_nothing():
    assert gym_scaling.worker_time([], 0.0, 1.0) == {}


def test_per_task_pools_every_pass_and_keeps_the_highest_fixed_cost_share():
    rows = [{"task": "L2_14", "pass": 1, "status": "pass", "candidate_ms": 0.18, "speedup": 15.0, "window_fixed_share": 0.05},
            {"task": "L2_14", "pass": 2, "status": "pass", "candidate_ms": 0.20, "speedup": 14.0, "window_fixed_share": 0.08},
            {"task": "L1_1", "pass": 2, "status": "pass", "candidate_ms": 4.0, "speedup": 0.68, "window_fixed_share": None}]
    figures = gym_scaling.per_task({"tasks": rows})
    assert figures["L2_14"]["runs"] == 2 and figures["L2_14"]["fixed_share_highest"] == 0.08
    assert figures["L2_14"]["spread"] == pytest.approx(0.20 / 0.18)
    assert figures["L1_1"]["fixed_share_highest"] is None


def judge(pid: int, ends: list[float], wall_s: float = 1.0) -> list[dict[str, float]]:
    return [{"judge_pid": pid, "started_unix": end - wall_s, "wall_s": wall_s} for end in ends]


def test_steady_rate_counts_only_while_every_worker_is_past_its_first_evaluation_and_none_is_dry():
    # judge 1's first evaluation ends at 4 (the last first one), judge 2's last at 10 (the first dry):
    # between them, 5 evaluations end (judge 1 at 6, 8, 10; judge 2 at 7, 10) in 6 s
    by_judge = {1: judge(1, [4.0, 6.0, 8.0, 10.0, 12.0]), 2: judge(2, [2.0, 7.0, 10.0])}
    assert gym_scaling.steady_rate(by_judge) == {"steady_per_min": pytest.approx(60 * 5 / 6)}


def test_steady_rate_is_absent_when_workers_never_overlap_warm():
    assert gym_scaling.steady_rate({1: judge(1, [5.0]), 2: judge(2, [3.0, 4.0])}) == {}


def test_one_pass_seconds_are_the_fixed_seconds_plus_the_evaluations_at_the_steady_rate():
    run = {"seconds": 70.0, "evaluations": 120, "steady_per_min": 120.0}  # 60 s at the rate: 10 s fixed
    assert gym_scaling.one_pass_s(run, 0) == pytest.approx(10.0)
    assert gym_scaling.one_pass_s(run, 240) == pytest.approx(130.0)
    assert gym_scaling.one_pass_s({"seconds": 70.0, "evaluations": 120}, 240) is None


def test_steady_table_gives_the_measured_ratio_at_the_pass_length_and_approaches_the_steady_one():
    one = {"gpus": 1, "per_gpu": 2, "seconds": 250.0, "evaluations": 160, "steady_per_min": 40.0}  # 10 s fixed
    four = {"gpus": 4, "per_gpu": 2, "seconds": 74.0, "evaluations": 160, "steady_per_min": 150.0}  # 10 s fixed
    row = gym_scaling.steady_table([one, four])[-1].strip("|").split("|")
    cells = [cell.strip() for cell in row]
    assert cells[:4] == ["4x2", "150.0", "3.75", "10.0"]
    measured = 250.0 / 74.0
    assert float(cells[4]) == pytest.approx(measured, abs=0.005)
    assert measured < float(cells[5]) < float(cells[6]) < 3.75
    short = {"gpus": 4, "per_gpu": 2, "seconds": 9.0, "evaluations": 4}
    assert "too few" in gym_scaling.steady_table([one, short])[-1]
