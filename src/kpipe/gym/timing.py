"""How a child times a forward pass: CUDA events (or host clocks under the interpreter) taken
before any candidate code ran, an L2 flush before every trial, fresh inputs between trials, and a
sample of the timed outputs kept for checking. The region is KernelBench's (start behind the
flush, end right after the call) plus a device-wide synchronize, so work left on side streams is
seen; the options of ``time_forward`` are the protocol's choices and the side-by-side
comparison's A/B (benchmarks/kernelbench_side_by_side.py)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from kpipe.gym.trial_data import clone_inputs, copy_inputs, flatten_output
from kpipe.gym.protocol import Protocol

# candidate trials between two runs of reference trials when both are timed side by side: about
# 30 ms of a 2 ms kernel, inside the tenths of a second the GPU's speed holds steady
PAIRED_CHUNK_TRIALS = 10
# ... and only for a forward of at least this long (its warm-up median): shorter calls are bound by
# the host's launches, which the GPU's drift does not move and the reference's chunks do
# (L2_14's 0.16 ms candidate measured up to 0.24 ms between them on the H100)
PAIRED_MIN_MS = 1.0


class Clocks:
    """References to the timing functions taken before any candidate code ran, so a
    candidate that patches them cannot change what we measure (the patch is also reported)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.perf_counter = time.perf_counter
        self.cuda = device == "cuda"
        if self.cuda:
            self.synchronize = torch.cuda.synchronize
            self.event = torch.cuda.Event
            self.record = torch.cuda.Event.record
            self.event_synchronize = torch.cuda.Event.synchronize
            self.elapsed_time = torch.cuda.Event.elapsed_time

    def sync(self) -> None:
        if self.cuda:
            self.synchronize()


def flush_l2(buffer: torch.Tensor | None) -> None:
    if buffer is not None:
        buffer.zero_()


def flush_l2_kernelbench(device: str = "cuda") -> None:
    """KernelBench's ``clear_l2_cache``: a new 256 MB int64 tensor from the caching allocator,
    filled, freed (compared with ours, a persistent buffer zeroed, in the side-by-side benchmark)."""
    dummy = torch.empty((32, 1024, 1024), dtype=torch.int64, device=device)
    dummy.fill_(42)
    del dummy


def time_forward(
    forward: Callable[..., Any],
    input_sets: list[list[Any]],
    trials: int,
    warmup: int,
    clocks: Clocks,
    l2_buffer: torch.Tensor | None,
    sample: set[int],
    keep: Callable[[list[torch.Tensor]], list[dict[str, Any]]],
    on_call: Callable[[], Any] | None = None,
    *,
    start_behind_flush: bool = True,
    end_at_call: bool = True,
    warmup_ms: float = 0.0,
    fresh_inputs: bool = True,
    flush: Callable[[], None] | None = None,
    reference: Callable[..., Any] | None = None,
    reference_trials: int = 0,
    chunk: int = PAIRED_CHUNK_TRIALS,
    switch_calls: bool = True,
    back_to_back: bool = False,
) -> dict[str, Any]:
    """Median-ready per-trial times of `forward`.

    Before every call (outside the timed region) the inputs are refreshed in place from the
    next input set and the L2 cache is flushed. On CUDA the start event is queued behind the
    flush (`start_behind_flush=False`: recorded after a host synchronize, the GPU idle); an
    event right after the call ends the region (``ms``), and a device-wide synchronize followed
    by a second event gives ``ms_synced``, which also covers work the call left running on
    other streams (`end_at_call=False`: ``ms`` is that region too). A host clock brackets the
    whole. Outputs of the `sample` trials are kept for the parent to check. Warm-up runs
    `warmup` calls and, on CUDA, for at least `warmup_ms`: a GPU that idled (a candidate child
    waits for the parent's verdict before it is timed) is back at full clocks.

    With `reference` (and a forward of at least ``PAIRED_MIN_MS``), `reference_trials` calls of
    it are timed the same way, interleaved with the timed trials in chunks (``interleaving``),
    each chunk after one untimed call of its program: the GPU's speed drifts by a few per cent
    over tenths of a second on unlocked clocks, and the two medians taken side by side drift
    alike (``reference_ms``; the judge divides it out, kpipe.gym.evaluation.drift_corrected).

    `back_to_back` (kgym-6, CUDA; for a paired timing only when it pairs): the host synchronises
    only between chunks, so within a chunk each trial's copy and flush run on the GPU right after
    the previous call instead of after the GPU idled while the host woke up and queued them; on the
    H100 that idling set each window's offset (git show 63b36f8:benchmarks/window_state.py). Chunks have random
    lengths (``chunk_sizes``) and each ends after the device-wide synchronize, whose latency after
    the chunk's last call is its ``tails_ms`` (``spans_ms``: first start to that synchronize;
    ``gaps_ms``: between one call's end and the next call's start), so work a call leaves on a
    stream it never joined shows at chunk ends the candidate cannot foresee. A sampled trial ends
    its chunk (its outputs are read after the synchronize). ``order`` is the order the calls ran in.

    `fresh_inputs=False` times the first input set every trial and `flush` replaces the buffer
    zeroing (the side-by-side benchmark's A/B against KernelBench's harness); `chunk` and
    `switch_calls=False` (no untimed call at a switch) are other ways of pairing, compared in
    git show 63b36f8:benchmarks/pairing_methods.py.
    """
    buffers = clone_inputs(input_sets[0])

    def trial(i: int, timed: Callable[..., Any] = forward, hook: Callable[[], Any] | None = on_call) -> tuple[float, float, float, int, Any]:
        which = i % len(input_sets) if fresh_inputs else 0
        if fresh_inputs:
            copy_inputs(buffers, input_sets[which])
        if flush is not None:
            flush()
        else:
            flush_l2(l2_buffer)
        if not start_behind_flush:
            clocks.sync()
        context = hook() if hook else nullcontext()
        with context, torch.no_grad():
            if clocks.cuda:
                start, call_end, synced = (clocks.event(enable_timing=True) for _ in range(3))
                t0 = clocks.perf_counter()
                clocks.record(start)
                output = timed(*buffers)
                clocks.record(call_end)
                clocks.synchronize()
                clocks.record(synced)
                clocks.event_synchronize(synced)
                t1 = clocks.perf_counter()
                return float(clocks.elapsed_time(start, call_end)), float(clocks.elapsed_time(start, synced)), (t1 - t0) * 1e3, which, output
            t0 = clocks.perf_counter()
            output = timed(*buffers)
            t1 = clocks.perf_counter()
            return (t1 - t0) * 1e3, (t1 - t0) * 1e3, (t1 - t0) * 1e3, which, output

    warmed = 0
    warm_ms: list[float] = []
    warm_until = clocks.perf_counter() + (warmup_ms / 1e3 if clocks.cuda else 0.0)
    while warmed < warmup or clocks.perf_counter() < warm_until:
        warm_ms.append(trial(warmed)[0])
        warmed += 1
    paired = reference is not None
    if warm_ms and sorted(warm_ms)[len(warm_ms) // 2] < PAIRED_MIN_MS:
        reference = None
    if reference is not None:
        for w in range(warmup):
            trial(w, reference, None)
    if back_to_back and clocks.cuda and (reference is not None or not paired):
        return time_back_to_back(forward, reference, reference_trials if reference is not None else 0, buffers, input_sets,
                                 trials, warmed, chunk, clocks, sample, keep, on_call, fresh_inputs,
                                 flush if flush is not None else lambda: flush_l2(l2_buffer))
    call_ms: list[float] = []
    synced_ms: list[float] = []
    host_ms: list[float] = []
    samples: list[dict[str, Any]] = []
    reference_call_ms: list[float] = []
    reference_synced_ms: list[float] = []
    t = 0
    previous = reference is None  # after the reference's warm-up the first chunk gets its untimed call too
    for is_candidate in interleaving(trials, reference_trials if reference is not None else 0, chunk):
        if switch_calls and is_candidate != previous:  # an untimed call first: L1_1's reference ran 4 % fast right after a candidate chunk
            trial(0, forward if is_candidate else reference, on_call if is_candidate else None)
            previous = is_candidate
        if not is_candidate:
            call, whole, _, _, output = trial(len(reference_call_ms), reference, None)
            reference_call_ms.append(call)
            reference_synced_ms.append(whole)
            del output
            continue
        call, whole, host, which, output = trial(warmed + t)
        call_ms.append(call)
        synced_ms.append(whole)
        host_ms.append(host)
        if t in sample:
            samples.append({"trial": t, "input_set": which, "outputs": keep(flatten_output(output))})
        del output
        t += 1
    result = {"ms": call_ms if end_at_call else synced_ms, "ms_synced": synced_ms, "host_ms": host_ms, "samples": samples}
    if reference is not None:
        result["reference_ms"] = reference_call_ms if end_at_call else reference_synced_ms
    return result


def time_back_to_back(forward: Callable[..., Any], reference: Callable[..., Any] | None, reference_trials: int, buffers: list[Any],
                      input_sets: list[list[Any]], trials: int, warmed: int, chunk: int, clocks: Clocks, sample: set[int],
                      keep: Callable[[list[torch.Tensor]], list[dict[str, Any]]], on_call: Callable[[], Any] | None,
                      fresh_inputs: bool, flush: Callable[[], None]) -> dict[str, Any]:
    """``time_forward``'s `back_to_back` timing (CUDA): per chunk, a device-wide synchronize, one
    untimed call, then the chunk's calls queued without waiting for the GPU, each between two
    events, and a device-wide synchronize whose event closes the chunk. Only the chunk's last
    output outlives its call (a sampled trial is always last: ``chunk_sizes``' `ends`)."""
    sizes = chunk_sizes(trials, chunk, random.SystemRandom(), sample)
    runs = paired_runs(trials, reference_trials, sizes)
    result: dict[str, Any] = {"ms": [], "host_ms": [], "samples": [], "order": flattened(runs), "chunk_sizes": sizes, "tails_ms": [],
                              "spans_ms": [], "gaps_ms": []}
    if reference is not None:
        result.update(reference_ms=[], reference_tails_ms=[], reference_gaps_ms=[])
    done = {True: 0, False: 0}
    with torch.no_grad():
        for is_candidate, count in runs:
            program, hook = (forward, on_call) if is_candidate else (reference, None)
            first = warmed + done[True] if is_candidate else done[False]
            clocks.synchronize()
            t0 = clocks.perf_counter()  # the host clock brackets the chunk's calls, the untimed one too
            events: list[tuple[Any, Any]] = []
            for index in [first] + list(range(first, first + count)):  # the first call untimed: the GPU idled in the synchronize
                which = index % len(input_sets) if fresh_inputs else 0
                if fresh_inputs:
                    copy_inputs(buffers, input_sets[which])
                flush()
                start, call_end = clocks.event(enable_timing=True), clocks.event(enable_timing=True)
                with hook() if hook else nullcontext():
                    clocks.record(start)
                    output = program(*buffers)
                    clocks.record(call_end)
                events.append((start, call_end))
            clocks.synchronize()
            synced = clocks.event(enable_timing=True)
            clocks.record(synced)
            clocks.event_synchronize(synced)
            host_ms = (clocks.perf_counter() - t0) * 1e3
            timed = events[1:]
            times = [float(clocks.elapsed_time(start, end)) for start, end in timed]
            gaps = [float(clocks.elapsed_time(timed[k][1], timed[k + 1][0])) for k in range(count - 1)]
            tail = float(clocks.elapsed_time(timed[-1][1], synced))
            if is_candidate:
                last = done[True] + count - 1
                if last in sample:
                    result["samples"].append({"trial": last, "input_set": which, "outputs": keep(flatten_output(output))})
                result["ms"] += times
                result["host_ms"] += [host_ms / count] * count
                result["tails_ms"].append(tail)
                result["spans_ms"].append(float(clocks.elapsed_time(timed[0][0], synced)))
                result["gaps_ms"] += gaps
            else:
                result["reference_ms"] += times
                result["reference_tails_ms"].append(tail)
                result["reference_gaps_ms"] += gaps
            del output
            done[is_candidate] += count
    return result


def chunk_sizes(trials: int, chunk: int, rng: random.Random | None = None, ends: set[int] = frozenset()) -> list[int]:
    """How many of `trials` each chunk holds: `chunk` each, or with `rng`, each drawn from
    chunk/2 .. 3*chunk/2 (so where a chunk ends cannot be foreseen), and a chunk also ending at
    every trial in `ends`."""
    sizes: list[int] = []
    done = 0
    while done < trials:
        size = min(rng.randint(max(chunk // 2, 1), chunk + chunk // 2) if rng else chunk, trials - done)
        cut = next((t for t in sorted(ends) if done <= t < done + size), None)
        if cut is not None:
            size = cut - done + 1
        sizes.append(size)
        done += size
    return sizes


def paired_runs(trials: int, reference_trials: int, chunk: list[int] | int = PAIRED_CHUNK_TRIALS) -> list[tuple[bool, int]]:
    """The schedule of timed calls as runs of (is the timed forward, calls): its trials in chunks
    of `chunk` (one size for every chunk, or the list of sizes), each followed by the reference
    trials due by then (their share, rounded; none where none fell due, the next chunk then a run
    of its own), so the two sample the same stretch of time. Most calls follow a call of the same
    program: a launch-bound kernel timed right after a 3 ms GEMM was 20-40 % slower on the H100
    (git show 63b36f8:benchmarks/timing_noise.py); kernels of a millisecond or more, timed in chunks after an
    untimed call, were not (shorter ones are not paired: ``PAIRED_MIN_MS``)."""
    sizes = chunk_sizes(trials, chunk) if isinstance(chunk, int) else chunk
    runs: list[tuple[bool, int]] = []
    done = due_done = 0
    for count in sizes:
        runs.append((True, count))
        done += count
        due = round(reference_trials * done / trials)
        if due > due_done:
            runs.append((False, due - due_done))
        due_done = due
    return runs


def flattened(runs: list[tuple[bool, int]]) -> list[bool]:
    """One entry per call of `runs`, True for the timed forward."""
    return [is_candidate for is_candidate, count in runs for _ in range(count)]


def interleaving(trials: int, reference_trials: int, chunk: list[int] | int = PAIRED_CHUNK_TRIALS) -> list[bool]:
    """The order of timed calls (``paired_runs``, call by call), True for the timed forward."""
    return flattened(paired_runs(trials, reference_trials, chunk))


def sample_trials(count: int, trials: int, seed: int) -> set[int]:
    """Which timed trials have their outputs checked (always the last one)."""
    generator = torch.Generator().manual_seed(seed)
    chosen = {trials - 1}
    if trials > 1 and count > 1:
        chosen.update(torch.randperm(trials - 1, generator=generator)[: count - 1].tolist())
    return chosen


def l2_flush_buffer(protocol: Protocol, device: str) -> torch.Tensor | None:
    if device != "cuda" or protocol.l2_flush_mb <= 0:
        return None
    return torch.empty(protocol.l2_flush_mb * 1024 * 1024 // 4, dtype=torch.int32, device=device)


def timed_region(protocol: Protocol) -> dict[str, bool]:
    """`time_forward`'s region options as the protocol chooses them."""
    return {"start_behind_flush": protocol.timing_start == "behind_flush", "end_at_call": protocol.timing_end == "call",
            "warmup_ms": protocol.warmup_ms}


def harness_host_ms(clocks: Clocks, l2_buffer: torch.Tensor | None, protocol: Protocol, trials: int) -> float:
    """What the re-check's host clock holds beyond the events when the call itself does nothing:
    the harness's events, device-wide synchronize and event wait (median over `trials`, each timed
    as the re-check times a call). Taken by the reference child, never in a candidate's process."""
    timed = time_forward(lambda: None, [[]], trials, 1, clocks, l2_buffer, set(), lambda outputs: [], **recheck_region(protocol))
    return max(statistics.median(timed["host_ms"]) - statistics.median(timed["ms"]), 0.0)


def recheck_region(protocol: Protocol) -> dict[str, bool]:
    """The host-clock re-check's region: the timed one, started where ``recheck_timing_start`` says."""
    return {**timed_region(protocol), "start_behind_flush": protocol.recheck_timing_start == "behind_flush"}
