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


def test_per_task_pools_every_pass_and_keeps_the_lowest_recheck_margin():
    rows = [{"task": "L2_14", "pass": 1, "status": "pass", "candidate_ms": 0.18, "speedup": 15.0, "recheck_host_to_event": 0.7},
            {"task": "L2_14", "pass": 2, "status": "pass", "candidate_ms": 0.20, "speedup": 14.0, "recheck_host_to_event": 0.6},
            {"task": "L1_1", "pass": 2, "status": "pass", "candidate_ms": 4.0, "speedup": 0.68, "recheck_host_to_event": None}]
    figures = gym_scaling.per_task({"tasks": rows})
    assert figures["L2_14"]["runs"] == 2 and figures["L2_14"]["recheck_lowest"] == 0.6 and figures["L2_14"]["rechecked"] == 2
    assert figures["L2_14"]["spread"] == pytest.approx(0.20 / 0.18)
    assert figures["L1_1"]["recheck_lowest"] is None and figures["L1_1"]["rechecked"] == 0
