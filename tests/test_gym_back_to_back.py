"""kgym-6's back-to-back paired timing (kpipe.gym.timing.time_back_to_back) and how the judge
reads it (kpipe.gym.evaluation): on a fake GPU timeline, so the order of calls, events and
synchronizes is checked without CUDA (checks/gpu/gym.py checks it on a GPU)."""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from kpipe.gym import timing
from kpipe.gym.evaluation import candidate_times, drift_corrected, median, paired_chunks
from kpipe.gym.protocol import Protocol
from kpipe.gym.timing import chunk_sizes, interleaving, paired_runs, time_forward


class TimelineClocks:
    """CUDA-shaped clocks over a simulated GPU: a call or a flush moves the GPU's clock, an event
    reads it when recorded, and a synchronize adds its latency (0.02 ms) plus whatever work was
    left running on another stream."""

    cuda = True
    LATENCY_MS = 0.02

    def __init__(self) -> None:
        self.gpu_ms = 0.0
        self.host_s = 0.0
        self.left_running_ms = 0.0
        self.synchronizes = 0

    def perf_counter(self) -> float:
        self.host_s += 0.001
        return self.host_s

    def synchronize(self) -> None:
        self.synchronizes += 1
        self.gpu_ms += self.left_running_ms + self.LATENCY_MS
        self.left_running_ms = 0.0

    sync = synchronize

    def event(self, enable_timing: bool) -> list[float]:
        return [float("nan")]

    def record(self, event: list[float]) -> None:
        event[0] = self.gpu_ms

    def event_synchronize(self, event: list[float]) -> None:
        pass

    def elapsed_time(self, start: list[float], end: list[float]) -> float:
        return end[0] - start[0]


def programs(clocks: TimelineClocks, calls: list[str], candidate_ms: float = 1.0, left_running_ms: float = 0.0) -> tuple[Any, Any, Any]:
    def candidate(x: torch.Tensor) -> torch.Tensor:
        calls.append("candidate")
        clocks.gpu_ms += candidate_ms
        clocks.left_running_ms += left_running_ms  # a side stream the call never joins
        return x * 2

    def reference(x: torch.Tensor) -> torch.Tensor:
        calls.append("reference")
        clocks.gpu_ms += 1.5
        return x

    def flush() -> None:
        clocks.gpu_ms += 0.1

    return candidate, reference, flush


def test_chunk_sizes_are_fixed_or_drawn_and_end_at_every_sampled_trial():
    assert chunk_sizes(25, 10) == [10, 10, 5]
    for seed in range(20):
        sizes = chunk_sizes(100, 10, random.Random(seed), {7, 63, 99})
        assert sum(sizes) == 100 and all(1 <= size <= 15 for size in sizes)
        ends = {sum(sizes[: k + 1]) - 1 for k in range(len(sizes))}
        assert {7, 63, 99} <= ends
    drawn = {tuple(chunk_sizes(100, 10, random.Random(seed))) for seed in range(20)}
    assert len(drawn) > 1  # where a chunk ends differs between timings
    order = interleaving(30, 10, [12, 8, 10])  # 12 -> 4 due, 20 -> 7, 30 -> 10
    assert order == [True] * 12 + [False] * 4 + [True] * 8 + [False] * 3 + [True] * 10 + [False] * 3
    assert paired_runs(30, 10, [12, 8, 10]) == [(True, 12), (False, 4), (True, 8), (False, 3), (True, 10), (False, 3)]
    # a chunk with no reference trial due after it (9 * 10 / 20 rounds to 4, as 8 did) stays a chunk of its own
    assert paired_runs(20, 10, [8, 1, 7, 4]) == [(True, 8), (False, 4), (True, 1), (True, 7), (False, 4), (True, 4), (False, 2)]


def test_paired_trials_run_back_to_back_within_chunks_of_random_length():
    """kgym-6: the host synchronises once per chunk (not per trial); each chunk starts with one
    untimed call of its program; every sampled trial ends its chunk, its output read after the
    synchronize; the tails, spans and gaps come from the same events."""
    clocks = TimelineClocks()
    calls: list[str] = []
    candidate, reference, flush = programs(clocks, calls)
    hooked: list[int] = []

    @contextmanager
    def on_call() -> Iterator[None]:
        hooked.append(len(calls))
        yield

    inputs = [[torch.ones(2)], [torch.zeros(2)]]
    sample = {4, 19, 99}
    timed = time_forward(candidate, inputs, 100, 2, clocks, None, sample, lambda outs: [o.tolist() for o in outs],  # type: ignore[arg-type]
                         on_call, reference=reference, reference_trials=50, flush=flush, back_to_back=True)
    order = timed["order"]
    assert order.count(True) == 100 and order.count(False) == 50
    assert timed["ms"] == pytest.approx([1.0] * 100) and timed["reference_ms"] == pytest.approx([1.5] * 50)
    runs = paired_runs(100, 50, timed["chunk_sizes"])
    candidate_chunks, reference_chunks = [n for who, n in runs if who], [n for who, n in runs if not who]
    assert len(timed["tails_ms"]) == len(timed["spans_ms"]) == len(candidate_chunks)
    assert len(timed["reference_tails_ms"]) == len(reference_chunks)
    assert timed["tails_ms"] == pytest.approx([TimelineClocks.LATENCY_MS] * len(candidate_chunks))
    assert timed["gaps_ms"] == pytest.approx([0.1] * (100 - len(candidate_chunks)))  # the next trial's flush
    assert timed["spans_ms"] == pytest.approx([n * 1.0 + (n - 1) * 0.1 + TimelineClocks.LATENCY_MS for n in candidate_chunks])
    # warm-up: 2 synchronised calls of each program; then one synchronize opening each chunk and one closing it
    assert clocks.synchronizes == 2 * 2 + 2 * (len(candidate_chunks) + len(reference_chunks))
    timed_calls = calls[4:]
    expected: list[str] = []
    for who, count in runs:
        expected += ["candidate" if who else "reference"] * (count + 1)
    assert timed_calls == expected
    assert len(hooked) == 2 + 100 + len(candidate_chunks)  # the hook sees the candidate's calls only
    ends = {sum(candidate_chunks[: k + 1]) - 1 for k in range(len(candidate_chunks))}
    assert sample <= ends
    assert [s["trial"] for s in timed["samples"]] == sorted(sample)
    for s in timed["samples"]:  # trial t after 2 warm-up calls read input set (t + 2) % 2
        assert s["input_set"] == (s["trial"] + 2) % 2 and s["outputs"] == [[2.0, 2.0] if s["input_set"] == 0 else [0.0, 0.0]]
    assert candidate_times(timed, {}, Protocol()) == (timed["ms"], "")


def test_a_sampled_trial_in_a_chunk_with_no_reference_after_it_is_still_checked(monkeypatch: pytest.MonkeyPatch):
    """Trial 8 ends a chunk of its own with no reference trial due after it: it is still a chunk
    (synchronize, untimed call, the trial, synchronize), so its output is read before the next call."""
    monkeypatch.setattr(timing, "chunk_sizes", lambda trials, chunk, rng, ends: [8, 1, 7, 4])
    clocks = TimelineClocks()
    calls: list[str] = []
    candidate, reference, flush = programs(clocks, calls)
    timed = time_forward(candidate, [[torch.ones(2)], [torch.zeros(2)]], 20, 0, clocks, None, {8}, lambda outs: [o.tolist() for o in outs],  # type: ignore[arg-type]
                         reference=reference, reference_trials=10, flush=flush, back_to_back=True)
    assert [s["trial"] for s in timed["samples"]] == [8] and timed["samples"][0]["outputs"] == [[2.0, 2.0]]  # input set 8 % 2
    assert len(timed["tails_ms"]) == len(timed["spans_ms"]) == 4 and timed["chunk_sizes"] == [8, 1, 7, 4]
    assert calls == ["candidate"] * 9 + ["reference"] * 5 + ["candidate"] * 2 + ["candidate"] * 8 + ["reference"] * 5 \
        + ["candidate"] * 5 + ["reference"] * 3


def test_back_to_back_is_for_paired_timing_of_long_forwards_and_the_reference_alone():
    clocks = TimelineClocks()
    calls: list[str] = []
    candidate, reference, flush = programs(clocks, calls, candidate_ms=0.5)  # under PAIRED_MIN_MS: not paired, synchronised per trial
    short = time_forward(candidate, [[torch.ones(2)]], 10, 1, clocks, None, set(), lambda o: [], reference=reference,  # type: ignore[arg-type]
                         reference_trials=5, flush=flush, back_to_back=True)
    assert "tails_ms" not in short and "ms_synced" in short and "reference_ms" not in short
    alone = time_forward(reference, [[torch.ones(2)]], 10, 1, clocks, None, set(), lambda o: [], flush=flush,  # type: ignore[arg-type]
                         back_to_back=True)
    assert "tails_ms" in alone and alone["ms"] == pytest.approx([1.5] * 10) and "reference_ms" not in alone
    cpu = time_forward(lambda x: x, [[torch.ones(2)]], 3, 0, FakeHostClocks(), None, set(), lambda o: [], back_to_back=True)  # type: ignore[arg-type]
    assert "tails_ms" not in cpu


class FakeHostClocks:
    cuda = False

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now

    def sync(self) -> None:
        pass


def test_work_left_running_past_chunk_ends_is_charged_by_the_chunks_spans():
    """A candidate that leaves 0.5 ms of every call on a stream it never joins: each chunk's
    synchronize waits for it, so its tails exceed the reference's and its time becomes its chunks'
    spans less the reference's gaps and latency: all its work."""
    clocks = TimelineClocks()
    calls: list[str] = []
    candidate, reference, flush = programs(clocks, calls, left_running_ms=0.5)
    timed = time_forward(candidate, [[torch.ones(2)]], 40, 1, clocks, None, set(), lambda o: [], reference=reference,  # type: ignore[arg-type]
                         reference_trials=20, flush=flush, back_to_back=True)
    assert median(timed["ms"]) == pytest.approx(1.0)  # the events see only the call
    times, note = candidate_times(timed, {}, Protocol())
    # each chunk's synchronize waited for its calls' leftovers, and its untimed call's: at least 1.5 ms a trial
    assert min(times) >= 1.5 - 1e-9 and "chunks' spans" in note and "stayed busy past the last call" in note
    # one late chunk is the host's (a descheduled synchronize), not the candidate's
    honest = dict(timed, tails_ms=[TimelineClocks.LATENCY_MS] * len(timed["tails_ms"]))
    honest["tails_ms"][0] = 5.0
    assert candidate_times(honest, {}, Protocol()) == (timed["ms"], "")


def test_back_to_back_trials_are_corrected_by_the_reference_timed_the_same_way_and_put_on_the_eager_scale():
    """kgym-6: drift = median(reference chunk) / median(reference alone, back to back); the
    corrected trials are scaled by the reference's synchronised / back-to-back medians, so
    candidate_ms sits on eager_ms's scale and eager_ms / candidate_ms is the back-to-back ratio."""
    order = [True] * 10 + [False] * 5 + [True] * 10 + [False] * 5
    timing = {"ms": [1.90] * 10 + [1.80] * 10, "reference_ms": [2.66] * 5 + [2.52] * 5, "order": order, "tails_ms": [0.02, 0.02]}
    reference = {"eager": {"ms": [2.80] * 5}, "eager_back_to_back": {"ms": [2.66] * 5}}
    times, drift, note = drift_corrected(timing["ms"], timing, reference, Protocol())
    assert note == ""
    assert times[:10] == pytest.approx([1.90 * 2.80 / 2.66] * 10)  # this chunk's reference ran as fast as alone
    assert times[10:] == pytest.approx([1.80 / (2.52 / 2.66) * 2.80 / 2.66] * 10)
    assert 2.80 / median(times) == pytest.approx(2.66 / 1.90)  # the two programs' back-to-back ratio
    assert drift == pytest.approx(median(timing["ms"]) / median(times))
    assert [len(c) for c, _ in paired_chunks(timing["ms"], timing["reference_ms"], order)] == [10, 10]


def test_current_protocol_pairs_back_to_back_and_earlier_protocols_synchronise_every_trial():
    current = Protocol()
    assert current.version == "kgym-13" and current.paired_host_sync == "chunk"
    kgym4 = {k: v for k, v in current.to_dict().items() if k != "paired_host_sync"}
    kgym4["version"] = "kgym-4"
    assert Protocol.from_dict(kgym4).paired_host_sync == "trial"
    with pytest.raises(ValueError, match="paired_host_sync"):
        Protocol(paired_host_sync="never")
