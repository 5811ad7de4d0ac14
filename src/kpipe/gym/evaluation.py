"""One KernelGym evaluation: screen, reference child, candidate child, judgement.

The judgement (correctness comparison, hacking verdicts, timing sanity) happens here, in
the parent, which never runs candidate code: the children only produce outputs and times.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import math
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from kpipe.data.source_text import source_hash
from kpipe.gym.compare import Comparison, Tolerance, compare_norms, compare_outputs
from kpipe.gym.faults import classify_exit
from kpipe.gym.feedback import build_feedback, hacked_diagnostic, clip
from kpipe.gym.child import CHALLENGE_MAX_CALLS, CHALLENGE_MIN_CALLS, rechecked
from kpipe.gym.isolate import Challenge, ChildRun, Launcher, fresh_interpreter, run_isolated
from kpipe.gym.lease import LEASE_MAX_WAIT_TIMEOUTS, TimingLease, device_lease, gpu_identity
from kpipe.gym.protocol import Protocol
from kpipe.gym.result import STATUSES, EvalResult, eval_key
from kpipe.gym.screen import screen
from kpipe.gym.timing import PAIRED_CHUNK_TRIALS, interleaving, sample_trials
from kpipe.gym.trial_data import digest_bytes

DIAGNOSTIC_MAX_CHARS = 3000
# a candidate's event time may not exceed what the host clock around the same region saw
EVENT_HOST_SLACK_MS = 0.05
HOST_RECHECK_MIN_RATIO = 0.5  # host-clock speedup must reach half the event-timed one
# the timing challenge's bound (``challenge_reasons``): a candidate's call on the judge's clock may
# take at most this many times its timed trials' median, plus the reference's own harness overhead, plus
# the clock's slack: per call, and per challenge (polling and scheduling jitter, shared by its calls).
# The factor covers what the two answers do beside their calls and does not cancel: on an H200 the
# bank's honest candidates' calls read 1.5-1.8x their own host times on the judge's clock (their
# inputs' allocation in a process whose allocator holds other blocks than the reference's)
CHALLENGE_FACTOR = 3.0
# rounds of the challenge at most, each with its own seed; the judge stops at the first that fits the
# candidate's claim and judges the best that ran. An honest answer's fixed costs (drawing inputs,
# writing outputs, the two processes' polling, and at kgym-12 three waits for the GPU per call)
# differed from the reference's by -44 to +27 ms, and by 60 ms in a tail that judged honest kernels
# timing_inconsistent on an H200; a forger is slow in every round, and pays for all of them
CHALLENGE_MAX_ROUNDS = 3
CHALLENGE_CALL_SLACK_MS = 0.1
CHALLENGE_WALL_SLACK_MS = {"cuda": 10.0, "cpu": 200.0}
# a candidate's result file may be at most this many times the reference's, plus this many bytes
# (its outputs are the same shapes; it adds the ghost replay and the timed samples)
RESULT_SIZE_FACTOR = 4
RESULT_SIZE_SLACK = 32 << 20
# a candidate whose GPU work outlasts its call's end event by more than the reference's does
# (the synchronize's own latency, ~10-30 us) plus this much has work on a stream the call did
# not wait for, and is timed to the device-wide synchronize instead: what it hid counts again
UNJOINED_SLACK_MS = 0.02
UNJOINED_SLACK_FRACTION = 0.05
# back-to-back chunks (kgym-6) the GPU must stay busy after before the candidate is charged by spans
UNJOINED_LATE_CHUNKS = 2
# ... and so is one whose region is shorter than this share of its own kernels' device time
# (profiled without the L2 flush, so an honest region is never shorter): on kernels of a few
# microseconds the synchronize's jitter would hide the excess above
REGION_MIN_KERNEL_FRACTION = 0.8
# host memory the kept reference runs may take (their outputs dominate: ~30 MB for a full-size
# KernelBench task). A count would be wrong both ways: a batch cycling through more tasks than
# the count never hits (10 tasks against 8 entries did not, on the H100), and a few huge
# tasks can hold gigabytes
REFERENCE_CACHE_BYTES = 2 << 30
# a reused reference run older than this is run again (its baseline timed anew)
REFERENCE_MAX_AGE_S = 1800.0
# where the judging process appends one JSON line per evaluation: the seconds of each phase
# (parent and children), memory. Instrumentation for benchmarks; children never see it
TRACE_VARIABLE = "KPIPE_GYM_TRACE"
# the statuses a child may report for itself: failures only; any other is the candidate's forgery
CHILD_FAILURES = frozenset(STATUSES) - {"pass", "hacked", "mismatch", "timeout", "format_error", "resource_limit", "reference_error"}
# what a tampered (well-formed pickle, wrong structure) result file raises while judged
MALFORMED = (KeyError, TypeError, IndexError, ValueError, AttributeError, RuntimeError)
# reference runs by key: (when it ran, its payload, its result file's bytes), least recently used first
_reference_cache: OrderedDict[str, tuple[float, dict[str, Any], int]] = OrderedDict()


class ReferenceFailure(RuntimeError):
    """The reference program itself failed: bad usage, not a bad candidate."""


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def iqr(values: list[float]) -> float:
    """Interquartile range: the spread reported next to every median time."""
    quartiles = torch.quantile(torch.tensor(values, dtype=torch.float64), torch.tensor([0.25, 0.75], dtype=torch.float64))
    return float(quartiles[1] - quartiles[0])


def speedup(reference_ms: float | None, candidate_ms: float | None) -> float | None:
    """speedup = median(reference) / median(candidate)."""
    if reference_ms is None or candidate_ms is None or candidate_ms <= 0:
        return None
    return reference_ms / candidate_ms


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    # is_available() does not create a CUDA context: the parent stays fork-safe
    return torch.cuda.is_available()


def resolve_device(protocol: Protocol) -> str:
    if protocol.device == "cuda" and not cuda_available():
        raise ValueError("protocol.device is 'cuda' but no CUDA device is available")
    if protocol.device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return protocol.device


@functools.lru_cache(maxsize=4)
def device_kind(device: str) -> str:
    """'cpu' or 'cuda:<GPU name>' without initialising CUDA in this process (nvidia-smi)."""
    if device != "cuda":
        return "cpu"
    name, _ = gpu_identity(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0")
    return f"cuda:{name}" if name else "cuda"


def check_reference(reference_src: str) -> None:
    """Bad usage (not a bad candidate): a reference that is not a KernelBench program."""
    if not isinstance(reference_src, str):
        raise TypeError("reference_src must be the program's source text")
    try:
        tree = ast.parse(reference_src)
    except SyntaxError as exc:
        raise ValueError(f"reference does not parse: {exc.msg} (line {exc.lineno})") from None
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    missing = {"Model", "get_inputs", "get_init_inputs"} - names
    if missing:
        raise ValueError(f"reference lacks {', '.join(sorted(missing))} (KernelBench format)")


def run_reference(reference_src: str, protocol: Protocol, device: str, reuse: bool,
                  launch: Launcher = fresh_interpreter, lease: TimingLease | None = None) -> tuple[dict[str, Any], bool]:
    """The reference child's payload, and whether it ran now (False: reused from this
    process's cache). With `lease`, it times its baselines holding the device's timing lease."""
    cache_key = hashlib.sha256(json.dumps([reference_src, protocol.to_json(), device]).encode()).hexdigest()
    if reuse and cache_key in _reference_cache and time.monotonic() - _reference_cache[cache_key][0] < REFERENCE_MAX_AGE_S:
        _reference_cache.move_to_end(cache_key)
        return _reference_cache[cache_key][1], False
    job = {"role": "reference", "reference_src": reference_src, "protocol": protocol.to_dict(), "device": device}
    # the seed no candidate sees before it must answer (kpipe.gym.isolate.Challenge); the reference
    # chooses how many calls, up to this many
    challenge = Challenge(seeds=tuple(secrets.randbits(40) for _ in range(CHALLENGE_MAX_ROUNDS)),  # trial_seed keeps each within 63 bits
                          calls=max(CHALLENGE_MIN_CALLS, min(CHALLENGE_MAX_CALLS, protocol.perf_trials)))
    run = run_isolated(job, protocol.timeout_s, gate=lambda _: True, launch=launch, lease=lease, challenge=challenge)
    if run.payload is None or run.payload.get("status") != "ok":
        why = "timed out" if run.timed_out else (run.payload or {}).get("error") or classify_exit(run.returncode or 0)[1]
        detail = (run.payload or {}).get("traceback", "") or run.stderr
        raise ReferenceFailure(f"the reference program failed ({why}) in phase {run.phase!r}:\n{clip(detail, 2000)}")
    if run.challenge is None or run.challenge_s is None:
        raise ReferenceFailure("the reference program did not answer the timing challenge (kpipe.gym.isolate.Challenge)")
    run.payload["challenge"] = {"rounds": [{**answer, "seed": seed, "wall_s": seconds}
                                           for answer, seed, seconds in zip(run.challenge, challenge.seeds, run.challenge_s)]}
    run.payload["result_bytes"] = run.result_bytes
    run.payload.setdefault("stats", {}).update(wall_s=run.wall_s, lease_wait_s=run.lease_wait_s, setup_s=run.setup_s,
                                               child_s=run.child_s, cleanup_s=run.cleanup_s)
    if reuse:
        _reference_cache[cache_key] = (time.monotonic(), run.payload, run.result_bytes)
        _reference_cache.move_to_end(cache_key)
        while len(_reference_cache) > 1 and sum(entry[2] for entry in _reference_cache.values()) > REFERENCE_CACHE_BYTES:
            _reference_cache.popitem(last=False)
    return run.payload, True


def child_stats(payload: Any, wall_s: float | None) -> dict[str, Any]:
    """A child's self-reported phase seconds and memory (instrumentation, never judged)."""
    stats = payload.get("stats") if isinstance(payload, dict) else None
    out: dict[str, Any] = dict(stats) if isinstance(stats, dict) else {}
    if wall_s is not None:
        out["wall_s"] = wall_s
    return out


def host_rss_mb() -> float | None:
    """Resident memory of this (judging) process."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def write_trace(record: dict[str, Any]) -> None:
    path = os.environ.get(TRACE_VARIABLE)
    if not path:
        return
    try:
        with open(path, "a") as handle:
            handle.write(json.dumps(record, default=str) + "\n")
    except (OSError, ValueError, TypeError):  # instrumentation never fails an evaluation
        pass


def tolerance(protocol: Protocol) -> Tolerance:
    return Tolerance(protocol.atol, protocol.rtol, protocol.norm_rtol)


def correctness(candidate: dict[str, Any], reference: dict[str, Any], protocol: Protocol) -> Comparison:
    """Every correctness trial, then the eval-mode run, against the reference's outputs."""
    tol = tolerance(protocol)
    pairs = [(f"trial {k}", c, r) for k, (c, r) in enumerate(zip(candidate["outputs"], reference["outputs"]))]
    pairs.append(("eval() mode", candidate["eval_outputs"], reference["eval_outputs"]))
    worst = Comparison(True, "", 0.0, 0.0)
    for where, c, r in pairs:
        result = compare_outputs(c, r, tol)
        if not result.ok:
            return Comparison(False, f"{where}: {result.detail}", result.max_abs_diff, result.mean_abs_diff)
        if (result.max_abs_diff or 0.0) >= (worst.max_abs_diff or 0.0):
            worst = result
    return worst


# KernelBench's own check: allclose at atol = rtol = 1e-2 on every correctness trial, nothing more
KERNELBENCH_TOLERANCE = Tolerance(1e-2, 1e-2, float("inf"))


def kernelbench_correct(candidate: dict[str, Any], reference: dict[str, Any]) -> bool:
    """KernelBench's verdict alone (``EvalResult.kb_correct``): every correctness trial allclose,
    without kpipe's relative-norm and eval()-mode checks."""
    return all(compare_outputs(c, r, KERNELBENCH_TOLERANCE).ok for c, r in zip(candidate["outputs"], reference["outputs"]))


def hack_reasons_before_timing(candidate: dict[str, Any], reference: dict[str, Any], protocol: Protocol, correct: bool) -> list[str]:
    reasons = []
    for mode in ("train", "eval"):
        if not candidate["launches"].get(mode):
            reasons.append(f"no_triton_launch: no Triton kernel ran in {mode}() mode")
    if correct and protocol.ghost_replay:
        if compare_outputs(candidate["ghost_outputs"], reference["outputs"][0], tolerance(protocol)).ok:
            reasons.append("ghost_replay: output still correct with every Triton launch suppressed")
    reasons.extend(integrity_reasons(candidate))
    if candidate.get("subclass_outputs"):
        reasons.append(f"tensor_subclass: forward returned {sorted(set(candidate['subclass_outputs']))}")
    if candidate.get("mutates_inputs") and not reference.get("mutates_inputs"):
        reasons.append("input_mutation: forward wrote into its inputs (the reference does not)")
    return reasons


def integrity_reasons(candidate: dict[str, Any]) -> list[str]:
    reasons = []
    if candidate["patched"]:
        reasons.append(f"monkey_patch: replaced {', '.join(candidate['patched'][:6])}")
    if candidate["hooks_intact"] is not True:
        reasons.append("monkey_patch: replaced KernelGym's launch or thread hooks")
    if candidate["threads"]:
        reasons.append(f"side_thread: started thread(s) {', '.join(candidate['threads'][:4])}")
    return reasons


def missing_evidence(candidate: dict[str, Any], protocol: Protocol, timed: bool, recheck_below: float | None = None) -> list[str]:
    """What the candidate child should have recorded and did not: every check fails closed, so a
    child that leaves out (or reshapes) the evidence of a check is judged by it, not excused.
    `timed`: the final result (after timing), else the partial one at the gate; `recheck_below`:
    the judge's re-check threshold (``recheck_below_ms``)."""
    def has(key: str, kind: type | tuple[type, ...]) -> bool:
        return isinstance(candidate.get(key), kind)

    missing = []
    if not has("outputs", list) or len(candidate["outputs"]) != protocol.correct_trials:
        missing.append(f"outputs of {protocol.correct_trials} correctness trials")
    if not has("eval_outputs", list):
        missing.append("eval() mode outputs")
    if protocol.hacking_check and protocol.ghost_replay and not has("ghost_outputs", list):
        missing.append("ghost replay outputs")
    launches = candidate.get("launches")
    modes = ("train", "eval", "timed") if timed else ("train", "eval")
    if not isinstance(launches, dict) or not all(isinstance(launches.get(mode), list) for mode in modes):
        missing.append("launch records")
    if not has("patched", list) or not has("hooks_intact", bool) or not has("threads", list):
        missing.append("integrity records")
    if not has("mutates_inputs", bool) or not has("subclass_outputs", list):
        missing.append("input and output records")
    if timed:
        timing = candidate.get("timing")
        expected = sample_trials(protocol.timed_output_checks, protocol.perf_trials, protocol.seed)
        if (not isinstance(timing, dict) or not isinstance(timing.get("ms"), list) or len(timing["ms"]) != protocol.perf_trials
                or not isinstance(timing.get("host_ms"), list) or not isinstance(timing.get("samples"), list)
                or {sample.get("trial") for sample in timing["samples"] if isinstance(sample, dict)} != expected):
            missing.append("timed trials and their sampled outputs")
        if not has("calls_without_launch", int):
            missing.append("timed calls without a launch")
        if protocol.profile and not has("profile", dict):
            missing.append("profile")
        recheck = candidate.get("recheck")
        if (isinstance(timing, dict) and isinstance(timing.get("ms"), list) and timing["ms"]
                and rechecked(timing["ms"], recheck_below) and (not isinstance(recheck, dict)
                                                                or not isinstance(recheck.get("host_ms"), list)
                                                                or not isinstance(recheck.get("samples"), list))):
            missing.append("host-clock re-check")
    return missing


def timing_reasons(candidate: dict[str, Any], reference: dict[str, Any], protocol: Protocol, wall_s: float, ref_ms: float | None,
                   measured_ms: list[float]) -> list[str]:
    """Why the timed run, as the candidate's process reported it, cannot be trusted; `measured_ms`:
    the candidate's trials as measured (``candidate_times``, before the drift correction)."""
    reasons = []
    timing = candidate["timing"]
    if not candidate["launches"].get("timed"):
        reasons.append("no_triton_launch: the timed calls launched no Triton kernel")
    elif candidate.get("calls_without_launch"):
        reasons.append(f"no_triton_launch: {candidate['calls_without_launch']} timed call(s) launched no Triton kernel")
    tol = tolerance(protocol)
    for sample in timing["samples"]:
        check = compare_outputs(sample["outputs"], reference["outputs"][sample["input_set"]], tol)
        if not check.ok:
            reasons.append(f"timed_output_mismatch: timed trial {sample['trial']} returned a wrong output ({check.detail})")
            break
    if sum(timing["ms"]) > wall_s * 1e3 or any(ms < 0 for ms in timing["ms"]):
        reasons.append("timing_inconsistent: reported times exceed the wall time observed by the parent")
    if median(timing["ms"]) > median(timing["host_ms"]) + EVENT_HOST_SLACK_MS:
        reasons.append("timing_inconsistent: device time exceeds the host time around it")
    recheck = candidate.get("recheck")
    if recheck is not None and ref_ms is not None:
        for sample in recheck["samples"]:
            if not compare_outputs(sample["outputs"], reference["recheck_outputs"][sample["input_set"]], tol).ok:
                reasons.append("recheck_output_mismatch: wrong output on fresh inputs during the speedup re-check")
                break
        ratio = host_recheck_ratio(median(recheck["host_ms"]), ref_ms, measured_ms, recheck_harness_ms(reference, protocol))
        if ratio is not None and ratio < HOST_RECHECK_MIN_RATIO:
            event_speedup = speedup(ref_ms, median(measured_ms))
            reasons.append(f"speedup_not_reproduced: {event_speedup:.3g}x by events, {event_speedup * ratio:.3g}x by the host clock "
                           "on fresh inputs")
    return reasons


def host_recheck_ratio(host_call_ms: float, ref_ms: float, measured_ms: list[float], harness_ms: float = 0.0) -> float | None:
    """The speedup on the host clock over the event-timed one (the same baseline `ref_ms`):
    ``median(measured_ms) / (host_call_ms - harness_ms)``, `host_call_ms` being the re-check's median
    host time per call and `harness_ms` the harness's host cost around a call
    (``recheck_harness_ms``); it fails below ``HOST_RECHECK_MIN_RATIO``. None where nothing is left
    to compare: no event speedup, or a host time no longer than the harness's own."""
    event_speedup = speedup(ref_ms, median(measured_ms))
    host_speedup = speedup(ref_ms, host_call_ms - harness_ms)  # None for a host time within the harness's
    if not event_speedup or host_speedup is None:
        return None
    return host_speedup / event_speedup


def recheck_below_ms(ref_ms: float | None, protocol: Protocol) -> float | None:
    """Below this median event time a candidate's speedup is re-checked on the host clock."""
    return ref_ms / protocol.recheck_speedup_above if ref_ms else None


def candidate_max_bytes(reference: dict[str, Any]) -> int:
    """The cap on each file a candidate's process writes for the judge (its result, each challenge
    answer): ``RESULT_SIZE_FACTOR`` times the larger of the reference's result file and its largest
    challenge answer's outputs (up to 64 calls' worth, which a small result can be below), plus
    ``RESULT_SIZE_SLACK``."""
    answer_bytes = max((sum(digest_bytes(call) for call in round_["outputs"]) for round_ in reference["challenge"]["rounds"]), default=0)
    return RESULT_SIZE_FACTOR * max(int(reference["result_bytes"]), answer_bytes) + RESULT_SIZE_SLACK


def challenge_call_ms(reference_challenge: dict[str, Any], candidate_s: float) -> float:
    """A candidate's mean call in the timing challenge, on clocks it cannot write: the reference's
    mean call (timed in its own, trusted process) plus the difference between the two challenges'
    seconds on the judge's clock, spread over the calls. Both challenges draw the same inputs and
    write outputs of the same shapes, so everything but the calls cancels."""
    calls = int(reference_challenge["calls"])
    return mean_call_ms(reference_challenge) + (candidate_s - float(reference_challenge["wall_s"])) * 1e3 / calls


def mean_call_ms(reference_challenge: dict[str, Any]) -> float:
    """The reference's mean call in its challenge, back to back, on its own (trusted) host clock."""
    return float(reference_challenge["calls_ms"]) / int(reference_challenge["calls"])


def challenge_reasons(answers: list[dict[str, Any]] | None, answers_s: list[float] | None, reference: dict[str, Any],
                      protocol: Protocol, device: str, measured_ms: list[float], ref_ms: float | None) -> tuple[list[str], dict[str, Any]]:
    """The verdict of the judge's timing challenge (``kpipe.gym.isolate.Challenge``), always taken:
    no answer or a wrong output on its fresh inputs in any round that ran, or calls slower on the
    judge's clock than the candidate's timed trials allow in every round that ran. Returns the
    reasons and, for the trace, the figures of the round judged (the best one) and how many ran."""
    expected = reference["challenge"]["rounds"]
    # the judge decides how many rounds run (``early_stop``), from one to all of the reference's
    if answers is None or answers_s is None or not 0 < len(answers) == len(answers_s) <= len(expected):
        return ["integrity: no valid answer to the judge's timing challenge (no answer)"], {}
    judged = []
    for answer, answer_s, expected_round in zip(answers, answers_s, expected):
        reasons, figures = challenge_round_reasons(answer, answer_s, expected_round, protocol, device, measured_ms, ref_ms)
        if not figures:  # no valid answer, or a wrong output: the whole challenge fails
            return reasons, figures
        judged.append((reasons, figures))
    reasons, figures = min(judged, key=lambda verdict: (bool(verdict[0]), verdict[1]["challenge_call_ms"]))
    return reasons, {**figures, "challenge_rounds": len(judged), "challenge_rounds_over": sum(1 for round_reasons, _ in judged if round_reasons)}


def early_stop(reference_rounds: list[dict[str, Any]], protocol: Protocol, device: str,
               ref_ms: float | None) -> Callable[[int, dict[str, Any] | None, float], bool]:
    """The judge's ``Challenge.enough``: a round is enough when its time on the judge's clock fits
    the claim the candidate's process wrote before the challenge (its timed trials' median). That
    claim only decides how many rounds run: the verdict (``challenge_reasons``) judges the rounds
    that ran against the final result's claim, so a child that claimed more here than there stopped
    its own second chance. The outputs are not read here: a wrong one in any round fails the whole
    challenge, so another round could not change the verdict, and the child waits for this answer
    while it holds the GPU's timing lease (the verdict decodes and compares each answer once)."""

    def enough(index: int, claim: dict[str, Any] | None, answer_s: float) -> bool:
        ms = (claim or {}).get("ms")
        if not isinstance(ms, list) or not ms or not all(isinstance(value, float) and math.isfinite(value) for value in ms):
            return False
        reasons, _ = challenge_round_timing(answer_s, reference_rounds[index], device, ms, ref_ms)
        return not reasons

    return enough


def challenge_round_reasons(answer: dict[str, Any] | None, answer_s: float, expected: dict[str, Any], protocol: Protocol,
                            device: str, measured_ms: list[float], ref_ms: float | None) -> tuple[list[str], dict[str, Any]]:
    """One round of the challenge: the reasons and figures, none where its answer is missing or
    wrong. The candidate's own host time for its calls (``calls_ms``) is never read."""
    if answer is None or answer.get("status") is not None:
        why = (answer or {}).get("error", "no answer")
        return [f"integrity: no valid answer to the judge's timing challenge ({why})"], {}
    outputs = answer.get("outputs")
    if not isinstance(outputs, list) or len(outputs) != len(expected["outputs"]):
        return [f"integrity: the timing challenge's answer holds no {len(expected['outputs'])} outputs"], {}
    # the relative-norm check alone: the challenge makes a forger compute, and leaves correctness to
    # the trials (an honest kernel at the edge of atol failed one of 16 fresh calls on an H200)
    for call, (c, r) in enumerate(zip(outputs, expected["outputs"])):
        check = compare_norms(c, r, protocol.norm_rtol)
        if not check.ok:
            return [f"challenge_output_mismatch: call {call} on the judge's fresh inputs returned a wrong output ({check.detail})"], {}
    return challenge_round_timing(answer_s, expected, device, measured_ms, ref_ms)


def challenge_round_timing(answer_s: float, expected: dict[str, Any], device: str, measured_ms: list[float],
                           ref_ms: float | None) -> tuple[list[str], dict[str, Any]]:
    """One round's time on the judge's clock against the candidate's claim (its timed trials'
    median): the reasons (``timing_inconsistent`` past the bound) and the figures."""
    judged_ms = challenge_call_ms(expected, answer_s)
    claimed_ms = median(measured_ms)
    slack_ms = CHALLENGE_CALL_SLACK_MS + CHALLENGE_WALL_SLACK_MS[device] / expected["calls"]
    # the reference's back-to-back call over its timed one: what the harness adds to a call (its
    # launch and the flush) that the candidate's timed trials do not count either
    reference_overhead_ms = max(mean_call_ms(expected) - (ref_ms or 0.0), 0.0)
    bound_ms = CHALLENGE_FACTOR * claimed_ms + reference_overhead_ms + slack_ms
    figures = {"challenge_call_ms": judged_ms, "challenge_bound_ms": bound_ms, "challenge_claimed_ms": claimed_ms,
               "challenge_calls": expected["calls"]}
    reasons = []
    if judged_ms > bound_ms:
        reasons.append(f"timing_inconsistent: a call took {judged_ms:.3g} ms on the judge's clock (fresh inputs), "
                       f"against {claimed_ms:.3g} ms reported")
    return reasons, figures


def recheck_harness_ms(reference: dict[str, Any], protocol: Protocol) -> float:
    """The harness's host cost around a re-checked call, as the reference child measured it, where
    the protocol takes it out (kgym-10); 0 otherwise."""
    if not protocol.recheck_subtracts_harness:
        return 0.0
    return float(reference.get("recheck_harness_ms") or 0.0)


def busy_after_call_ms(timing: dict[str, Any]) -> float:
    """How long the GPU stayed busy after the call's end event (medians): the synchronize's
    latency, plus any work on streams the call did not join."""
    return median(timing.get("ms_synced", timing["ms"])) - median(timing["ms"])


def candidate_times(timing: dict[str, Any], reference: dict[str, Any], protocol: Protocol,
                    profile: dict[str, Any] | None = None) -> tuple[list[float], str]:
    """The candidate's per-trial times, and a note when they had to be taken past the call's
    own end event, which work left on a side stream would escape: to the device-wide synchronize
    (kgym-3's region), or, for trials timed back to back (kgym-6), to what their chunk's span
    leaves once the reference's gaps and synchronize latency are taken out (``span_charged``)."""
    if protocol.timing_end != "call" or ("ms_synced" not in timing and "tails_ms" not in timing):
        return timing["ms"], ""
    call_ms = median(timing["ms"])
    slack = max(UNJOINED_SLACK_MS, UNJOINED_SLACK_FRACTION * call_ms)
    kernels_ms = sum(float(k["ms"]) for k in profile["kernels"]) if profile and profile.get("kind") == "cuda" else 0.0
    back_to_back = "tails_ms" in timing
    if back_to_back:
        late = unjoined_chunks(timing, slack)
        why = f"the GPU stayed busy past the last call of {late} of {len(timing['tails_ms'])} chunks" if late >= UNJOINED_LATE_CHUNKS else ""
    else:
        baseline = reference.get("eager") or reference.get("compile")
        excess = busy_after_call_ms(timing) - (busy_after_call_ms(baseline) if baseline else 0.0)
        why = f"the GPU stayed busy {excess:.3g} ms longer after the call returned than after the reference's" if excess > slack else ""
    if not why and call_ms < REGION_MIN_KERNEL_FRACTION * kernels_ms:
        why = f"the call's region ({call_ms:.3g} ms) is shorter than its own kernels' device time ({kernels_ms:.3g} ms)"
    if not why:
        return timing["ms"], ""
    if back_to_back:
        return span_charged(timing), f"timed by its chunks' spans: {why} (work on a stream the call did not wait for)"
    return timing["ms_synced"], f"timed to the device-wide synchronize: {why} (work on a stream the call did not wait for)"


def unjoined_chunks(timing: dict[str, Any], slack: float) -> int:
    """How many back-to-back chunks (kgym-6) the GPU stayed busy after, beyond the reference's
    synchronize latency (median over its chunks, timed beside the candidate) by more than `slack`.
    A chunk's end cannot be foreseen (random lengths), so work left running after a call shows at
    every chunk end it falls on; one late chunk may be the host's, two are the candidate's."""
    latency = median(timing["reference_tails_ms"])
    return sum(tail - latency > slack for tail in timing["tails_ms"])


def span_charged(timing: dict[str, Any]) -> list[float]:
    """Per trial of a back-to-back timing: its chunk's span (first start to the closing
    synchronize) less the reference's median gap between calls (the next trial's input copy and
    flush) and its synchronize latency, shared by the chunk's trials: every piece of work the
    chunk's calls left on the GPU is in the span."""
    gap = median(timing["reference_gaps_ms"] or [0.0])  # none when every reference chunk held one trial
    latency = median(timing["reference_tails_ms"])
    charged: list[float] = []
    for span, size in zip(timing["spans_ms"], timing["chunk_sizes"]):
        charged += [max(span - (size - 1) * gap - latency, 0.0) / size] * size
    return charged


def paired_chunks(candidate_ms: list[float], paired: list[float], order: list[bool] | None = None) -> list[tuple[list[float], list[float]]]:
    """The timed trials as they ran (`order`, the timing's; without it kgym-4's
    ``kpipe.gym.timing.interleaving`` in chunks of ``PAIRED_CHUNK_TRIALS``): per chunk, the
    candidate's trials and the reference trials timed right after them. A chunk followed by no
    reference trial joins the next one (the last, the one before it)."""
    chunks: list[tuple[list[float], list[float]]] = []
    candidate: list[float] = []
    reference: list[float] = []
    c = r = 0
    for is_candidate in order if order is not None else interleaving(len(candidate_ms), len(paired), PAIRED_CHUNK_TRIALS):
        if is_candidate and reference:
            chunks.append((candidate, reference))
            candidate, reference = [], []
        if is_candidate:
            candidate.append(candidate_ms[c])
            c += 1
        else:
            reference.append(paired[r])
            r += 1
    if reference or not chunks:
        chunks.append((candidate, reference))
    else:
        chunks[-1][0].extend(candidate)
    return chunks


def drift_corrected(candidate_ms: list[float], timing: dict[str, Any], reference: dict[str, Any],
                    protocol: Protocol) -> tuple[list[float], float | None, str]:
    """The candidate's trials with the GPU's drift divided out (protocol kgym-4 on; their median is the
    candidate's time), the factor between the uncorrected and corrected medians (``gpu_drift``:
    None when the reference was not timed beside it) and a note when the cap bit.

    Each chunk of trials is divided by the drift the reference chunk timed right after it
    measured: its median over the median of the reference alone, timed the same way (kgym-6:
    back to back, ``eager_back_to_back``). Both programs slow down together when the GPU does,
    in level shifts of tens of trials, so the ratio holds still where each median moves by
    3-10 %. Each drift is capped at 1 +- ``max_gpu_drift``: a candidate that slows the reference
    beside it gains at most that much. Capped, not dropped: a switch between corrected and
    uncorrected would itself be a jump of the cap's size between evaluations. Trials timed back to
    back are then scaled by the reference's own synchronised over back-to-back medians, so
    ``candidate_ms`` stays on the scale of ``eager_ms`` (KernelBench's region) and their ratio is
    the one the two programs showed back to back. The candidate's time stays a median over all its
    trials: a mean over chunks repeated better on the H100 (git show 63b36f8:benchmarks/timing_residual.py) but
    would let a candidate that skips its work on a minority of calls gain, where a median moves
    only when most calls do (and the sampled timed outputs then catch them)."""
    paired, eager = timing.get("reference_ms"), reference.get("eager")
    if not paired or not eager or len(candidate_ms) != len(timing["ms"]):
        return candidate_ms, None, ""
    solo = reference.get("eager_back_to_back", eager) if "tails_ms" in timing else eager
    low, high = 1.0 - protocol.max_gpu_drift, 1.0 + protocol.max_gpu_drift
    solo_ms = median(solo["ms"])
    scale = median(eager["ms"]) / solo_ms
    chunks = paired_chunks(candidate_ms, paired, timing.get("order"))
    drifts = [median(beside) / solo_ms for _, beside in chunks]
    corrected = [ms / min(max(d, low), high) * scale for (trials, _), d in zip(chunks, drifts) for ms in trials]
    note = ""
    if not low <= min(drifts) <= max(drifts) <= high:
        note = (f"GPU drift correction capped at 1 +- {protocol.max_gpu_drift:g}: the reference ran "
                f"{min(drifts):.3f}-{max(drifts):.3f}x its own timing beside the candidate")
    return corrected, median(candidate_ms) / median(corrected), note


def reported_spans(payload: dict[str, Any]) -> list[list[float]]:
    """The child's timed regions as [start, end] pairs; nothing if it wrote something else."""
    try:
        return [[float(start), float(end)] for start, end in payload.get("timed_spans", [])[:8]]
    except MALFORMED:
        return []


def failure_diagnostic(run: ChildRun, payload: dict[str, Any] | None) -> str:
    where = f" (during {run.phase})" if run.phase else ""
    if payload is not None:
        tail = payload.get("traceback", "")
        return clip(f"{payload.get('error', '')}{where}\n{tail}".strip(), DIAGNOSTIC_MAX_CHARS)
    stderr = run.stderr.strip()
    return clip(f"{classify_exit(run.returncode or 0)[1]}{where}\n{stderr[-1500:]}".strip(), DIAGNOSTIC_MAX_CHARS)


def evaluate(
    reference_src: str,
    candidate_src: str,
    protocol: Protocol | None = None,
    *,
    reuse_reference: bool = False,
    launch: Launcher = fresh_interpreter,
    lease: TimingLease | None = None,
) -> EvalResult:
    """Evaluate `candidate_src` (``ModelNew`` + Triton kernels) against `reference_src`.

    Never raises for a bad candidate (its failure is the result); raises ValueError /
    TypeError / ReferenceFailure for bad usage. `reuse_reference` reuses this process's
    cached reference run (outputs and baseline timings) for an identical reference and
    protocol: cheaper, but the baseline is then not timed close to the candidate. `launch`
    starts each child process (kpipe.gym.pool forks them from a warm zygote). Each child times
    holding `lease` (default: its device's, ``kpipe.gym.lease``), so no two timed regions on
    one device overlap, whoever evaluates there.
    """
    protocol = protocol or Protocol()
    check_reference(reference_src)
    if not isinstance(candidate_src, str):
        raise TypeError("candidate_src must be the program's source text")
    started = time.monotonic()
    device = resolve_device(protocol)
    kind = device_kind(device)
    lease = lease or device_lease(device, LEASE_MAX_WAIT_TIMEOUTS * protocol.timeout_s)
    base = {
        "key": eval_key(reference_src, candidate_src, protocol, kind),
        "reference_hash": source_hash(reference_src),
        "candidate_hash": source_hash(candidate_src),
        "timing_kind": "cuda" if device == "cuda" else "cpu",
        "device": kind,
        "torch_version": str(torch.__version__),
        "triton_version": __import__("triton").__version__,
        "protocol_version": protocol.version,
        "protocol": protocol.to_json(),
    }

    trace: dict[str, Any] = {"started_unix": time.time(), "reference": None, "candidate": None}
    candidate_done: float | None = None

    def finish(status: str, profile: dict[str, Any] | None = None, **fields: Any) -> EvalResult:
        if status == "hacked":  # every hacked verdict names its reason in its diagnostic (and so in its feedback)
            fields["diagnostic"] = hacked_diagnostic(fields.get("hack_reasons", []), fields.get("diagnostic", ""))
        result = EvalResult(status=status, **base, **fields)
        result.correct = status == "pass"
        result.hacked = status == "hacked"
        result.wall_s = time.monotonic() - started
        if candidate_done is not None:  # the judge's work after the child: the verdict's checks
            trace["verdict_s"] = time.monotonic() - candidate_done
        result.feedback = build_feedback(result, profile, protocol.feedback_max_chars)
        result.redact()
        if os.environ.get(TRACE_VARIABLE):
            write_trace({"key": result.key, "candidate_hash": result.candidate_hash, "status": status,
                         "wall_s": result.wall_s, "judge_pid": os.getpid(), "judge_rss_mb": host_rss_mb(), **trace})
        return result

    screened = screen(candidate_src)
    trace["screen_s"] = time.monotonic() - started
    findings = screened.findings
    if screened.status is not None:
        return finish(screened.status, diagnostic=screened.diagnostic, findings=findings)
    rejected = [f for f in findings if f.split(":", 1)[0] in protocol.reject_findings]
    if rejected and protocol.hacking_check:
        return finish("hacked", hack_reasons=[f"static {f}" for f in rejected], findings=findings)

    reference_started = time.monotonic()
    reference, reference_ran = run_reference(reference_src, protocol, device, reuse_reference, launch, lease)
    trace["reference_s"] = time.monotonic() - reference_started
    trace["reference_reused"] = not reference_ran
    if reference_ran:
        trace["reference"] = child_stats(reference, None)
    base.update(device=reference["device"] if device == "cpu" else kind, torch_version=reference["torch_version"],
                triton_version=reference["triton_version"])
    spans = list(reference.get("timed_spans", [])) if reference_ran else []
    ref_eager = median(reference["eager"]["ms"]) if "eager" in reference else None
    ref_compile = median(reference["compile"]["ms"]) if "compile" in reference else None
    ref_for_recheck = ref_eager if ref_eager is not None else ref_compile

    verdict: dict[str, Any] = {}

    def gate(partial: dict[str, Any]) -> bool:
        missing = missing_evidence(partial, protocol, timed=False)
        if missing:
            check, reasons = Comparison(False, "no evidence"), [f"integrity: the candidate's process recorded no {', '.join(missing)}"]
        else:
            try:
                check = correctness(partial, reference, protocol)
                verdict["kb_correct"] = kernelbench_correct(partial, reference)
                reasons = hack_reasons_before_timing(partial, reference, protocol, check.ok) if protocol.hacking_check else []
            except MALFORMED as exc:
                check, reasons = Comparison(False, "malformed result"), [f"integrity: malformed candidate result ({type(exc).__name__})"]
        verdict.update(check=check, reasons=reasons)
        return check.ok and not reasons

    job = {
        "role": "candidate",
        "reference_src": reference_src,
        "candidate_src": candidate_src,
        "protocol": protocol.to_dict(),
        "device": device,
        "recheck_below_ms": recheck_below_ms(ref_for_recheck, protocol),
    }
    expected = reference["challenge"]
    candidate_started = time.monotonic()
    run = run_isolated(job, protocol.timeout_s, gate=gate, launch=launch, lease=lease,
                       challenge=Challenge(seeds=tuple(round_["seed"] for round_ in expected["rounds"]),
                                           calls=expected["rounds"][0]["calls"],
                                           enough=early_stop(expected["rounds"], protocol, device, ref_for_recheck)),
                       max_result_bytes=candidate_max_bytes(reference))
    candidate_done = time.monotonic()
    # the judge's whole candidate run: setup, the child (its waits included), clean-up
    trace["candidate_run_s"] = candidate_done - candidate_started
    payload = run.payload
    trace["candidate"] = child_stats(payload, run.wall_s)
    trace["candidate_lease_wait_s"] = run.lease_wait_s
    trace["candidate_peaks"] = run.peaks  # what its limits must leave room for (kpipe.gym.limits)
    trace.update(candidate_setup_s=run.setup_s, candidate_child_s=run.child_s, candidate_cleanup_s=run.cleanup_s,
                 candidate_handed_over_unix=run.handed_over_unix)
    common: dict[str, Any] = {"findings": findings, "timed_spans": spans, "kb_correct": verdict.get("kb_correct")}
    if isinstance(payload, dict):  # what the child saw; only a placement record, never a verdict
        common["device_id"] = str(payload.get("device_id", ""))[:200]
        common["timed_spans"] = spans + reported_spans(payload)
    if run.tampered:
        return finish("hacked", hack_reasons=[f"integrity: {run.tampered}"], **common)
    if isinstance(payload, dict) and payload.get("tampered"):
        return finish("hacked", hack_reasons=[f"integrity: {payload['error']}"], **common)
    if run.limit:  # whatever the child then did or wrote (kpipe.gym.limits)
        return finish("resource_limit", diagnostic=clip(f"resource_limit: {run.limit}", DIAGNOSTIC_MAX_CHARS), **common)
    if run.timed_out:
        return finish("timeout", diagnostic=f"no result within {protocol.timeout_s:g} s (during {run.phase or 'start-up'})", **common)
    if payload is None or payload.get("status") != "ok":
        status = payload.get("status") if payload else classify_exit(run.returncode or 0)[0]
        if status not in CHILD_FAILURES:  # a status only the judge gives ("pass", ...), written by the candidate
            return finish("hacked", hack_reasons=[f"integrity: the candidate's process wrote the status {str(status)[:40]!r}"], **common)
        if payload is None and run.partial is not None and "check" in verdict and not verdict["check"].ok:
            status = "mismatch"  # it failed correctness, then died when told to stop
        return finish(status, diagnostic=failure_diagnostic(run, payload), **common)
    if "check" not in verdict:  # the child skipped the gate: treat as tampering
        return finish("hacked", hack_reasons=["integrity: the candidate process bypassed the correctness gate"], **common)
    try:
        return judge(payload, verdict, reference, protocol, run, device, ref_eager, ref_compile, finish, common, trace)
    except MALFORMED as exc:  # a result file the candidate tampered with
        return finish("hacked", hack_reasons=[f"integrity: malformed candidate result ({type(exc).__name__})"], **common)


def judge(
    payload: dict[str, Any],
    verdict: dict[str, Any],
    reference: dict[str, Any],
    protocol: Protocol,
    run: ChildRun,
    device: str,
    ref_eager: float | None,
    ref_compile: float | None,
    finish: Callable[..., EvalResult],
    common: dict[str, Any],
    trace: dict[str, Any] | None = None,
) -> EvalResult:
    """The verdict on a candidate that ran to the end: gate verdict, evidence, the timing challenge,
    timing checks, speedups. In `trace` (the judge's trace record): how close the candidate came to
    the timing challenge's bounds."""
    ref_for_recheck = ref_eager if ref_eager is not None else ref_compile
    check: Comparison = verdict["check"]
    reasons: list[str] = list(verdict["reasons"])
    launched = sorted(set(payload["launches"].get("train", [])) | set(payload["launches"].get("eval", [])))
    common["launched_kernels"] = launched
    if reasons:
        return finish("hacked", hack_reasons=reasons, diagnostic=check.detail, **common)
    if not check.ok:
        return finish("mismatch", diagnostic=check.detail, **common)

    missing = missing_evidence(payload, protocol, timed=True, recheck_below=recheck_below_ms(ref_for_recheck, protocol))
    if missing:
        return finish("hacked", hack_reasons=[f"integrity: the candidate's process recorded no {', '.join(missing)}"], **common)
    timing = payload["timing"]
    measured_ms, unjoined = candidate_times(timing, reference, protocol, payload.get("profile"))
    candidate_ms, drift, drift_note = drift_corrected(measured_ms, timing, reference, protocol)
    cand_ms = median(candidate_ms)
    # never optional, with or without the hacking check: it bounds what the candidate's process reports
    reasons, figures = challenge_reasons(run.challenge, run.challenge_s, reference, protocol, device, measured_ms, ref_for_recheck)
    if trace is not None:
        trace.update(figures)
        if payload.get("recheck") is not None and ref_for_recheck is not None:
            harness_ms = recheck_harness_ms(reference, protocol)
            trace.update(recheck_host_to_event=host_recheck_ratio(median(payload["recheck"]["host_ms"]), ref_for_recheck, measured_ms,
                                                                  harness_ms),
                         recheck_harness_ms=harness_ms, recheck_host_ms=median(payload["recheck"]["host_ms"]),
                         recheck_event_ms=median(measured_ms))
    if protocol.hacking_check:
        reasons += timing_reasons(payload, reference, protocol, run.wall_s, ref_for_recheck, measured_ms) + integrity_reasons(payload)
    reasons = sorted(set(reasons), key=reasons.index)
    if reasons:
        return finish("hacked", hack_reasons=reasons, **common)
    profile = payload.get("profile")
    notes = [f"torch.compile baseline failed: {reference['compile_error']}"] if reference.get("compile_error") else []
    return finish(
        "pass",
        profile=profile,
        diagnostic="; ".join(notes + [note for note in (unjoined, drift_note) if note]),
        candidate_ms=cand_ms,
        candidate_ms_iqr=iqr(candidate_ms),
        eager_ms=ref_eager,
        eager_ms_iqr=iqr(reference["eager"]["ms"]) if "eager" in reference else None,
        compile_ms=ref_compile,
        compile_ms_iqr=iqr(reference["compile"]["ms"]) if "compile" in reference else None,
        speedup_eager=speedup(ref_eager, cand_ms),
        speedup_compile=speedup(ref_compile, cand_ms),
        pr=profile.get("pr") if profile else None,
        gpu_drift=drift,
        **common,
    )
