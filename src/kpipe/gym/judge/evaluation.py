"""One KernelGym evaluation: ``evaluate`` is the protocol's steps in order (the static screen, the
reference's child, the candidate's, what its process did, its correctness, its timing windows, its
own reports, the pass), each a method of ``Evaluation``.

The judgement happens here, in the parent, which never runs candidate code. The verdict and the
reward come only from what the judge observes itself: the outputs it compares and the times on its
own clock (the timing windows, ``judge_windows``). A candidate's process only produces outputs; what
else it reports (launches, patched names, threads, its profile) can only fail it, or, its profile,
inform the feedback and PR.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from kpipe.data.source_text import source_hash
from kpipe.gym.judge.compare import Comparison, Tolerance, compare_norms, compare_outputs
from kpipe.gym.exchange import ANY, TENSOR, ListOf, MalformedFile, OneOf, Record, check, decode
from kpipe.gym.candidate.faults import classify_exit
from kpipe.gym.candidate.trial_data import SKETCH_PATTERNS
from kpipe.gym.judge.feedback import build_feedback, clip, hacked_diagnostic
from kpipe.gym.confine.isolate import ChildRun, Launcher, Windows, fresh_interpreter, run_isolated
from kpipe.gym.confine.lease import LEASE_MAX_WAIT_TIMEOUTS, TimingLease, device_lease, gpu_identity
from kpipe.gym.protocol import HACKING_CHECK_FINDINGS, Protocol
from kpipe.gym.judge.result import STATUSES, EvalResult, eval_key
from kpipe.gym.judge.screen import screen

DIAGNOSTIC_MAX_CHARS = 3000
# timing windows each candidate is judged on, each with a secret seed of its own; the least time
# counts, for the candidate and for the baselines alike (a window is only ever slowed, by the host's
# or the GPU's other work, never sped up, so the least of each side is its undisturbed time)
WINDOWS_PER_CANDIDATE = 2
# a reference run answers a stock of windows, each handed to one candidate and never again; the run
# is repeated when the stock is spent. At most this many windows, whose answers (outputs of every
# call, kpipe.gym.candidate.trial_data.WindowOutputs) hold at most this many bytes
STOCK_MAX_WINDOWS = 32
STOCK_MAX_BYTES = 256 << 20
# a window whose reference calls took less than this on its own clock (too short for the judge's: a
# CPU host's reference of microseconds, whose candidate runs in the interpreter and caps the calls)
# is read as a whole (``candidate_window_ms``): its fixed cost then stays in both times, a speedup is
# pulled toward 1 and never rises above the ratio of the two windows, where subtracting the fixed
# cost left a busy host's milliseconds of noise over calls of microseconds. A GPU's windows take
# about 100 ms of calls (kpipe.gym.candidate.child.WINDOW_TARGET_MS)
WINDOW_MIN_CALLS_MS = 5.0
# a candidate whose least window exceeds the reference's fixed cost by less than this share of it is read
# from the windows' ratio too (``candidate_window_ms``): its calls are then within the fixed cost's own
# noise, and the difference read a load change between the reference's run and the candidate's as the
# candidate's speed (on a 2-core host running two test suites, an honest-speed kernel read 1000x, the
# floor, through the pool). On an H100 the slowest resolved case, L1_40, leaves its calls 10 % of it
WINDOW_RESOLVED_FRACTION = 0.05
# the judge reads a speedup only up to this: a candidate's window shorter than the reference's fixed
# cost (its inputs' draw, the answer's file) left no time for its calls, and the ratio means nothing
MAX_SPEEDUP = 1000.0
# a candidate's files may be at most this many times the reference's answer, plus this many bytes
RESULT_SIZE_FACTOR = 4
RESULT_SIZE_SLACK = 32 << 20
# host memory the kept reference runs may take (their outputs and windows' answers dominate)
REFERENCE_CACHE_BYTES = 2 << 30
# a reused reference run older than this is run again (its baseline timed anew)
REFERENCE_MAX_AGE_S = 1800.0
# where the judging process appends one JSON line per evaluation: the seconds of each phase
# (parent and children), memory, the windows' figures. Instrumentation for benchmarks; children never see it
TRACE_VARIABLE = "KPIPE_GYM_TRACE"
# the statuses a child may report for itself: failures only; any other is the candidate's forgery
CHILD_FAILURES = frozenset(STATUSES) - {"pass", "hacked", "mismatch", "timeout", "format_error", "resource_limit",
                                         "reference_error"}
# reference runs by key: [when it ran, its payload, its bytes, the windows no candidate has had yet], least recently used first
_reference_cache: OrderedDict[str, list[Any]] = OrderedDict()
_reference_cache_lock = threading.Lock()
# what comparing well-formed outputs of odd dtypes or shapes may raise: the candidate's failure, never the judge's
UNCOMPARABLE = (RuntimeError, TypeError, ValueError)

# ----------------------------------------------------------------------------- the files' schemas
# (kpipe.gym.exchange.check): what the judge reads from a child, exactly
DIGEST = OneOf((Record({"full": TENSOR}), Record({"sample": TENSOR, "shape": ListOf(int, 16), "dtype": str})))
WINDOW_DIGEST = OneOf((Record({"full": TENSOR}),
                       Record({"sample": TENSOR, "shape": ListOf(int, 16), "dtype": str,
                               "sketch": ListOf(float, SKETCH_PATTERNS, exactly=SKETCH_PATTERNS)})))
NAMES = ListOf(str)
PROFILE = Record({"kind": str, "pr": OneOf((float, type(None))), "kernels": ListOf(Record({"name": str, "ms": float, "generated": bool}))})
ENVELOPE = {"role": str, "device": str, "device_id": str, "torch_version": str, "triton_version": str, "status": str, "stats": ANY}
FAILURE = Record({**ENVELOPE, "error": str, "traceback": str, "phase": str}, frozenset({"stats"}))


def partial_fields(protocol: Protocol, outputs: Any = DIGEST) -> dict[str, Any]:
    """A candidate's record at the gate: its correctness outputs and its reports."""
    forward = ListOf(outputs, 64)
    return {"outputs": ListOf(forward, exactly=protocol.correct_trials), "eval_outputs": forward, "ghost_outputs": forward,
            "launches": Record({"train": NAMES, "eval": NAMES}), "mutates_inputs": bool, "subclass_outputs": NAMES,
            "patched": NAMES, "hooks_intact": bool, "threads": NAMES}


def partial_schema(protocol: Protocol) -> Record:
    return Record(partial_fields(protocol), frozenset({"ghost_outputs"}))


def result_schema(protocol: Protocol) -> Record:
    """A candidate's final result: its record at the gate, its launches in the windows, its profile."""
    fields = {**partial_fields(protocol), **ENVELOPE, "profile": PROFILE, "stopped_at_gate": bool,
              "launches": Record({"train": NAMES, "eval": NAMES, "windows": NAMES}, frozenset({"windows"}))}
    return Record(fields, frozenset({"ghost_outputs", "profile", "stopped_at_gate", "stats"}))


def answer_schema(calls: int) -> Record:
    """A candidate's answer to one timing window: each call's outputs."""
    return Record({"outputs": ListOf(ListOf(WINDOW_DIGEST, 64), exactly=calls)})


class ReferenceFailure(RuntimeError):
    """The reference program itself failed: bad usage, not a bad candidate."""


def speedup(reference_ms: float | None, candidate_ms: float | None) -> float | None:
    """speedup = reference time / candidate time (None without both)."""
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
    """The reference child's payload, with ``windows``: the ``WINDOWS_PER_CANDIDATE`` timing windows
    this candidate is judged on, which no other candidate gets; and whether it ran now (False: reused
    from this process's cache, whose run answered a stock of windows, ``STOCK_MAX_WINDOWS``). With
    `lease`, it answers its windows holding the device's timing lease."""
    cache_key = hashlib.sha256(json.dumps([reference_src, protocol.to_json(), device]).encode()).hexdigest()
    with _reference_cache_lock:
        entry = _reference_cache.get(cache_key) if reuse else None
        if entry is not None and time.monotonic() - entry[0] < REFERENCE_MAX_AGE_S and len(entry[3]) >= WINDOWS_PER_CANDIDATE:
            _reference_cache.move_to_end(cache_key)
            taken, entry[3][:] = entry[3][:WINDOWS_PER_CANDIDATE], entry[3][WINDOWS_PER_CANDIDATE:]
            return {**entry[1], "windows": taken}, False
        _reference_cache.pop(cache_key, None)
    job = {"role": "reference", "reference_src": reference_src, "protocol": protocol.to_dict(), "device": device}
    stock = STOCK_MAX_WINDOWS if reuse else WINDOWS_PER_CANDIDATE

    def enough(answered: int, answered_bytes: int) -> bool:  # whole candidates' windows, within the byte bound
        return answered % WINDOWS_PER_CANDIDATE == 0 and answered_bytes * (answered + WINDOWS_PER_CANDIDATE) / answered > STOCK_MAX_BYTES

    # the seeds never leave the judge until their window: secrets, 40 bits (trial_seed keeps each within 63)
    windows = Windows(seeds=tuple(secrets.randbits(40) for _ in range(stock)), calls=None, enough=enough)
    run = run_isolated(job, protocol.timeout_s, gate=lambda _: True, launch=launch, lease=lease, windows=windows)
    if run.payload is None or run.payload.get("status") != "ok":
        why = "timed out" if run.timed_out else (run.payload or {}).get("error") or classify_exit(run.returncode or 0)[1]
        detail = (run.payload or {}).get("traceback", "") or run.stderr
        raise ReferenceFailure(f"the reference program failed ({why}) in phase {run.phase!r}:\n{clip(detail, 2000)}")
    if run.windows is None or run.window_s is None or len(run.windows) < WINDOWS_PER_CANDIDATE:
        raise ReferenceFailure("the reference program did not answer the judge's timing windows")
    payload = run.payload
    compile_ms = payload.pop("compile_windows_ms", [])
    answered = [{**decode(data), "seed": seed, "wall_s": seconds, "span": span, "bytes": len(data),
                 "compile_calls_ms": compile_ms[index] if index < len(compile_ms) else None}
                for index, (data, seed, seconds, span) in enumerate(zip(run.windows, windows.seeds, run.window_s, run.window_spans))]
    answered = answered[:len(answered) - len(answered) % WINDOWS_PER_CANDIDATE]
    least_fixed_ms = min(window["wall_s"] * 1e3 - float(window["calls_ms"]) for window in answered)
    for window in answered:  # the run's undisturbed fixed cost, for every candidate its stock serves
        window["run_fixed_ms"] = least_fixed_ms
    payload["result_bytes"] = run.result_bytes
    payload.setdefault("stats", {}).update(wall_s=run.wall_s, lease_wait_s=run.lease_wait_s, setup_s=run.setup_s,
                                           child_s=run.child_s, cleanup_s=run.cleanup_s, windows=len(answered))
    if reuse:
        with _reference_cache_lock:
            _reference_cache[cache_key] = [time.monotonic(), payload, run.result_bytes + sum(w["bytes"] for w in answered),
                                           answered[WINDOWS_PER_CANDIDATE:]]
            while len(_reference_cache) > 1 and sum(kept[2] for kept in _reference_cache.values()) > REFERENCE_CACHE_BYTES:
                _reference_cache.popitem(last=False)
    return {**payload, "windows": answered[:WINDOWS_PER_CANDIDATE]}, True


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
    """The gate's hacking reasons: the hacking check's (a Triton kernel ran in each mode, the ghost
    replay; off with `hacking_check=False`), then the integrity checks, always on."""
    reasons = []
    for mode in ("train", "eval") if protocol.hacking_check else ():
        if not candidate["launches"].get(mode):
            reasons.append(f"no_triton_launch: no Triton kernel ran in {mode}() mode")
    if correct and protocol.hacking_check and protocol.ghost_replay:
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


def candidate_max_bytes(reference: dict[str, Any]) -> int:
    """The cap on each file a candidate's process writes for the judge (its result, each window's
    answer): ``RESULT_SIZE_FACTOR`` times the larger of the reference's result file and its window
    answer, plus ``RESULT_SIZE_SLACK``."""
    answer_bytes = max((int(window["bytes"]) for window in reference["windows"]), default=0)
    return RESULT_SIZE_FACTOR * max(int(reference["result_bytes"]), answer_bytes) + RESULT_SIZE_SLACK


def candidate_window_ms(windows: list[dict[str, Any]], candidate_s: list[float]) -> list[float]:
    """The candidate's mean call in each of its timing windows, from the judge's clock: the window less the
    reference's least fixed cost (what one of its windows took on the judge's clock beyond its calls on its
    own clock: drawing the inputs, writing the answer, polling), over the calls: the least over every
    window its run answered (``run_fixed_ms``), where known. Both children draw the same inputs and write
    outputs of the same shapes, so the fixed cost is the same work; a stall only lengthens a window, so the
    least is the one nearest the truth, and a lower fixed cost only reads a candidate slower. (Each window
    against the reference's window of its own seed, kgym-14, let one stalled reference window shorten the
    candidate's time: a candidate 3x slower than the reference read 1000x on a loaded host; the least of the
    candidate's own two windows, kgym-16, read the first candidate of a fresh run fast: a run's first
    windows cost more, 16.9 ms against 12 ms later on an H100.) Where the reference's calls were too short
    for the judge's clock (``WINDOW_MIN_CALLS_MS``), the reference's mean call scaled by the ratio of the
    window to the reference's least instead."""
    calls = int(windows[0]["calls"])
    reference_ms = [float(window["wall_s"]) * 1e3 for window in windows]
    calls_ms = [float(window["calls_ms"]) for window in windows]
    fixed_ms = resolved_fixed_ms(windows, candidate_s)
    if fixed_ms is None:
        reference_call_ms = sum(calls_ms) / len(calls_ms) / calls
        return [reference_call_ms * seconds * 1e3 / min(reference_ms) for seconds in candidate_s]
    return [(seconds * 1e3 - fixed_ms) / calls for seconds in candidate_s]


def resolved_fixed_ms(windows: list[dict[str, Any]], candidate_s: list[float]) -> float | None:
    """The reference's least fixed cost of a window (``candidate_window_ms``), or None where the windows'
    difference cannot resolve the candidate's calls: the reference's calls too short for the judge's clock
    (``WINDOW_MIN_CALLS_MS``), or the candidate's least window within ``WINDOW_RESOLVED_FRACTION`` of the
    fixed cost (or below it). Then the windows' ratio reads it: a speedup no larger than theirs."""
    calls_ms = [float(window["calls_ms"]) for window in windows]
    if min(calls_ms) < WINDOW_MIN_CALLS_MS:
        return None
    fixed_ms = min([float(window["wall_s"]) * 1e3 - own for window, own in zip(windows, calls_ms)]
                   + [float(w["run_fixed_ms"]) for w in windows if "run_fixed_ms" in w])
    if min(candidate_s) * 1e3 - fixed_ms < WINDOW_RESOLVED_FRACTION * fixed_ms:
        return None
    return fixed_ms


def judge_windows(run: ChildRun, reference: dict[str, Any], protocol: Protocol) -> tuple[str, str, dict[str, Any]]:
    """The candidate's timing windows: (a status other than pass, or "" when they hold, its
    diagnostic or hacking reason, and the figures). Every call's output is compared with the
    reference's for the same inputs (``compare_norms``: whole, or secret positions and a sketch of
    every element). The candidate's time is the least of its windows' (``candidate_window_ms``); the
    baselines', the least of the same windows' on the reference's clock. The fixed cost of a
    window (what the reference's window took on the judge's clock beyond its calls: drawing the
    inputs, writing the answer, both processes' polling) is in the figures."""
    windows = reference["windows"]
    if run.windows is None or run.window_s is None or len(run.windows) != len(windows):
        return "hacked", "integrity: no answer to the judge's timing windows", {}
    for index, (data, window) in enumerate(zip(run.windows, windows)):
        try:
            answer = decode(data)
            check(answer, answer_schema(int(window["calls"])), f"window {index}'s answer")
        except MalformedFile as exc:
            return "runtime_error", f"malformed answer to a timing window: {exc}", {}
        for call, (candidate_outputs, reference_outputs) in enumerate(zip(answer["outputs"], window["outputs"])):
            try:
                verdict = compare_norms(candidate_outputs, reference_outputs, protocol.norm_rtol)
            except UNCOMPARABLE as exc:
                return "runtime_error", f"window {index}'s answer holds outputs the judge cannot compare ({type(exc).__name__})", {}
            if not verdict.ok:
                return "hacked", (f"window_output_mismatch: call {call} of timing window {index} (fresh secret inputs) "
                                  f"returned a wrong output ({verdict.detail})"), {}
    estimates = candidate_window_ms(windows, list(run.window_s))
    eager = [float(w["calls_ms"]) / int(w["calls"]) for w in windows]
    compiled = [float(w["compile_calls_ms"]) / int(w["calls"]) for w in windows if w.get("compile_calls_ms") is not None]
    figures = {"window_calls": int(windows[0]["calls"]), "window_candidate_ms": estimates, "window_eager_ms": eager,
               "window_compile_ms": compiled, "window_fixed_ms": [float(w["wall_s"]) * 1e3 - float(w["calls_ms"]) for w in windows],
               "window_reference_s": [float(w["wall_s"]) for w in windows], "window_candidate_s": list(run.window_s),
               "eager_ms": min(eager) if protocol.wants_eager else None,
               "compile_ms": min(compiled) if compiled and protocol.wants_compile else None}
    floor = min(eager) / MAX_SPEEDUP
    figures["candidate_ms"] = max(min(estimates), floor)
    figures["note"] = "" if min(estimates) >= floor else (
        f"the candidate's windows were read faster than {MAX_SPEEDUP:g}x the eager baseline; its time is read as "
        f"{floor:.3g} ms")
    return "", "", figures


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
    """Evaluate `candidate_src` (``ModelNew`` + Triton kernels) against `reference_src`: the
    protocol's steps, in order. The first step that decides the result ends the evaluation; every
    result, whichever step gives it, gets its feedback from ``Evaluation.finish``.

    Never raises for a bad candidate (its failure is the result); raises ValueError /
    TypeError / ReferenceFailure for bad usage. `reuse_reference` reuses this process's
    cached reference run (outputs and baseline timings) for an identical reference and
    protocol: cheaper, but the baseline is then not timed close to the candidate. `launch`
    starts each child process (kpipe.gym.serve.pool forks them from a warm zygote). Each child times
    holding `lease` (default: its device's, ``kpipe.gym.confine.lease``), so no two timed regions on
    one device overlap, whoever evaluates there.
    """
    evaluation = Evaluation(reference_src, candidate_src, protocol or Protocol(), lease)  # bad usage raises here
    if (result := evaluation.static_screen()) is not None:  # 1. format and policy findings, before anything runs
        return result
    reference = evaluation.reference_child(reuse_reference, launch)  # 2. the reference's outputs; its windows' fresh secret inputs
    run = evaluation.candidate_child(reference, launch)  # 3. the candidate's outputs, checked at the gate; its windows, on the judge's clock
    if (result := evaluation.process_failure(run)) is not None:  # 4. tampering, limits, timeout, malformed files, a crash
        return result
    if (result := evaluation.correctness_verdict(run)) is not None:  # 5. the gate's verdict: wrong outputs, hacking reasons
        return result
    if (result := evaluation.timing_windows(run, reference)) is not None:  # 6. every window call's output; the times
        return result
    if (result := evaluation.integrity(run)) is not None:  # 7. its own reports, which can only fail it
        return result
    return evaluation.passed(run, reference)  # 8. speedups from the judge's times, PR, feedback


class Evaluation:
    """One evaluation as the judge goes through the protocol's steps (``evaluate``): what it has
    learnt so far, and ``finish``, which makes the result (and its feedback) of whichever step decides."""

    def __init__(self, reference_src: str, candidate_src: str, protocol: Protocol, lease: TimingLease | None) -> None:
        check_reference(reference_src)
        if not isinstance(candidate_src, str):
            raise TypeError("candidate_src must be the program's source text")
        self.started = time.monotonic()
        self.reference_src, self.candidate_src, self.protocol = reference_src, candidate_src, protocol
        self.device = resolve_device(protocol)
        self.kind = device_kind(self.device)
        self.lease = lease or device_lease(self.device, LEASE_MAX_WAIT_TIMEOUTS * protocol.timeout_s)
        self.base: dict[str, Any] = {
            "key": eval_key(reference_src, candidate_src, protocol, self.kind),
            "reference_hash": source_hash(reference_src),
            "candidate_hash": source_hash(candidate_src),
            "timing_kind": "cuda" if self.device == "cuda" else "cpu",
            "device": self.kind,
            "torch_version": str(torch.__version__),
            "triton_version": __import__("triton").__version__,
            "protocol_version": protocol.version,
            "protocol": protocol.to_json(),
        }
        self.trace: dict[str, Any] = {"started_unix": time.time(), "reference": None, "candidate": None}
        self.seeds: list[int] = []  # this candidate's windows' secret seeds
        self.candidate_done: float | None = None
        self.findings: list[str] = []
        self.verdict: dict[str, Any] = {}  # the gate's: the correctness check, hacking reasons, or what was malformed
        self.common: dict[str, Any] = {}  # the fields of every result once the candidate has run
        self.figures: dict[str, Any] = {}  # the timing windows'

    def finish(self, status: str, profile: dict[str, Any] | None = None, **fields: Any) -> EvalResult:
        """The result, with its feedback; the secret seeds kept out of what a model reads."""
        if status == "hacked":  # every hacked verdict names its reason in its diagnostic (and so in its feedback)
            fields["diagnostic"] = hacked_diagnostic(fields.get("hack_reasons", []), fields.get("diagnostic", ""))
        result = EvalResult(status=status, **self.base, **fields)
        result.correct = status == "pass"
        result.hacked = status == "hacked"
        result.wall_s = time.monotonic() - self.started
        if self.candidate_done is not None:  # the judge's work after the child: the verdict's checks
            self.trace["verdict_s"] = time.monotonic() - self.candidate_done
        result.feedback = build_feedback(result, profile, self.protocol.feedback_max_chars)
        result.redact()
        for seed in self.seeds:  # spent, never used again; kept out of what a model reads all the same
            result.diagnostic, result.feedback = (text.replace(str(seed), "<seed>") for text in (result.diagnostic, result.feedback))
            result.hack_reasons = [reason.replace(str(seed), "<seed>") for reason in result.hack_reasons]
        if os.environ.get(TRACE_VARIABLE):
            write_trace({"key": result.key, "candidate_hash": result.candidate_hash, "status": status,
                         "wall_s": result.wall_s, "judge_pid": os.getpid(), "judge_rss_mb": host_rss_mb(), **self.trace})
        return result

    def static_screen(self) -> EvalResult | None:
        """Step 1 (``kpipe.gym.judge.screen``): a format verdict, or a finding the protocol rejects."""
        screened = screen(self.candidate_src)
        self.trace["screen_s"] = time.monotonic() - self.started
        self.findings = screened.findings
        if screened.status is not None:
            return self.finish(screened.status, diagnostic=screened.diagnostic, findings=self.findings)
        rejected = [f for f in self.findings if f.split(":", 1)[0] in self.protocol.reject_findings
                    and (self.protocol.hacking_check or f.split(":", 1)[0] not in HACKING_CHECK_FINDINGS)]
        if rejected:
            return self.finish("hacked", hack_reasons=[f"static {f}" for f in rejected], findings=self.findings)
        return None

    def reference_child(self, reuse: bool, launch: Launcher) -> dict[str, Any]:
        """Step 2 (``run_reference``): the reference's outputs, and the timing windows handed to this
        candidate alone, each drawing fresh inputs from a secret seed."""
        reference_started = time.monotonic()
        reference, reference_ran = run_reference(self.reference_src, self.protocol, self.device, reuse, launch, self.lease)
        self.trace["reference_s"] = time.monotonic() - reference_started
        self.trace["reference_reused"] = not reference_ran
        if reference_ran:
            self.trace["reference"] = child_stats(reference, None)
        self.base.update(device=reference["device"] if self.device == "cpu" else self.kind, torch_version=reference["torch_version"],
                         triton_version=reference["triton_version"])
        self.seeds.extend(int(window["seed"]) for window in reference["windows"])
        return reference

    def gate(self, reference: dict[str, Any], partial: dict[str, Any]) -> bool:
        """The candidate's record at the gate, before any timing: its schema, its correctness trials'
        outputs against the reference's, and the hacking checks; "go" only if all hold."""
        try:
            check(partial, partial_schema(self.protocol), "the record at the gate")
        except MalformedFile as exc:
            self.verdict["malformed"] = str(exc)
            return False
        try:
            check_ = correctness(partial, reference, self.protocol)
            self.verdict["kb_correct"] = kernelbench_correct(partial, reference)
            reasons = hack_reasons_before_timing(partial, reference, self.protocol, check_.ok)
        except UNCOMPARABLE as exc:
            self.verdict["malformed"] = f"outputs the judge cannot compare ({type(exc).__name__}: {str(exc)[:200]})"
            return False
        self.verdict.update(check=check_, reasons=reasons)
        return check_.ok and not reasons

    def candidate_child(self, reference: dict[str, Any], launch: Launcher) -> ChildRun:
        """Step 3 (``kpipe.gym.confine.isolate.run_isolated``): the candidate's child, stopped at the
        ``gate``; past it, the judge reveals each window's seed and clocks the answer."""
        job = {
            "role": "candidate",
            "reference_src": self.reference_src,
            "candidate_src": self.candidate_src,
            "protocol": self.protocol.to_dict(),
            "device": self.device,
        }
        candidate_started = time.monotonic()
        run = run_isolated(job, self.protocol.timeout_s, gate=functools.partial(self.gate, reference), launch=launch, lease=self.lease,
                           windows=Windows(seeds=tuple(window["seed"] for window in reference["windows"]),
                                           calls=int(reference["windows"][0]["calls"])),
                           max_result_bytes=candidate_max_bytes(reference))
        self.candidate_done = time.monotonic()
        trace = self.trace
        # the judge's whole candidate run: setup, the child (its waits included), clean-up
        trace["candidate_run_s"] = self.candidate_done - candidate_started
        trace["candidate"] = child_stats(run.payload, run.wall_s)
        trace["candidate_lease_wait_s"] = run.lease_wait_s
        trace["candidate_peaks"] = run.peaks  # what its limits must leave room for (kpipe.gym.confine.limits)
        trace.update(candidate_setup_s=run.setup_s, candidate_child_s=run.child_s, candidate_cleanup_s=run.cleanup_s,
                     candidate_handed_over_unix=run.handed_over_unix)
        # the judge's own clock: the reference's windows handed to this candidate, then the candidate's
        spans = [list(window["span"]) for window in reference["windows"]]
        self.common = {"findings": self.findings, "timed_spans": spans + run.window_spans, "kb_correct": self.verdict.get("kb_correct")}
        return run

    def process_failure(self, run: ChildRun) -> EvalResult | None:
        """Step 4: what the candidate's process did wrong, whatever it wrote: tampering, a limit, the
        timeout, a file the judge's schemas reject (the judge's status, never the file's), a failure
        it reports or its exit shows, or the gate skipped."""
        payload, verdict, common = run.payload, self.verdict, self.common
        if run.tampered:
            return self.finish("hacked", hack_reasons=[f"integrity: {run.tampered}"], **common)
        if isinstance(payload, dict) and payload.get("tampered"):
            return self.finish("hacked", hack_reasons=[f"integrity: {payload['error']}"], **common)
        if run.limit:  # whatever the child then did or wrote (kpipe.gym.confine.limits)
            return self.finish("resource_limit", diagnostic=clip(f"resource_limit: {run.limit}", DIAGNOSTIC_MAX_CHARS), **common)
        if run.timed_out:
            return self.finish("timeout", diagnostic=f"no result within {self.protocol.timeout_s:g} s (during {run.phase or 'start-up'})",
                               **common)
        malformed = verdict.get("malformed") or (run.partial or {}).get("malformed") and run.partial["error"]
        if payload is not None and not payload.get("malformed"):
            try:
                check(payload, result_schema(self.protocol) if payload.get("status") == "ok" else FAILURE, "the result file")
            except MalformedFile as exc:
                malformed = malformed or str(exc)
        elif payload is not None:
            malformed = malformed or payload["error"]
        if malformed:  # the judge's status, never the file's
            return self.finish("runtime_error", diagnostic=clip(f"malformed file from the candidate's process: {malformed}",
                                                                DIAGNOSTIC_MAX_CHARS), **common)
        if isinstance(payload, dict):  # what the child saw; only a placement record, never a verdict
            common["device_id"] = payload["device_id"][:200]
        if payload is None or payload["status"] != "ok":
            status = payload["status"] if payload else classify_exit(run.returncode or 0)[0]
            if status not in CHILD_FAILURES:  # a status only the judge gives ("pass", ...), written by the candidate
                return self.finish("hacked", hack_reasons=[f"integrity: the candidate's process wrote the status {status[:40]!r}"],
                                   **common)
            if payload is None and run.partial is not None and "check" in verdict and not verdict["check"].ok:
                status = "mismatch"  # it failed correctness, then died when told to stop
            return self.finish(status, diagnostic=failure_diagnostic(run, payload), **common)
        if "check" not in verdict:  # the child skipped the gate: treat as tampering
            return self.finish("hacked", hack_reasons=["integrity: the candidate process bypassed the correctness gate"], **common)
        return None

    def correctness_verdict(self, run: ChildRun) -> EvalResult | None:
        """Step 5: the gate's verdict on a candidate that ran to the end: hacking reasons, then wrong
        outputs. Its kernels' names go into every result from here on."""
        check_: Comparison = self.verdict["check"]
        reasons: list[str] = list(self.verdict["reasons"])
        self.common["launched_kernels"] = sorted(set(run.payload["launches"]["train"]) | set(run.payload["launches"]["eval"]))
        if reasons:
            return self.finish("hacked", hack_reasons=reasons, diagnostic=check_.detail, **self.common)
        if not check_.ok:
            return self.finish("mismatch", diagnostic=check_.detail, **self.common)
        return None

    def timing_windows(self, run: ChildRun, reference: dict[str, Any]) -> EvalResult | None:
        """Step 6 (``judge_windows``), never optional, with or without the hacking check: every call's
        output in the candidate's windows against the reference's, and the times on the judge's clock
        (kept for ``passed``; in the judge's trace record too)."""
        status, why, self.figures = judge_windows(run, reference, self.protocol)
        self.trace.update({key: value for key, value in self.figures.items() if key != "note"})
        if status == "hacked":
            return self.finish("hacked", hack_reasons=[why], **self.common)
        if status:
            return self.finish(status, diagnostic=clip(why, DIAGNOSTIC_MAX_CHARS), **self.common)
        return None

    def integrity(self, run: ChildRun) -> EvalResult | None:
        """Step 7: the candidate's own reports (patched names, hooks, threads, always; with the hacking
        check, launches in its windows), which can only fail it."""
        reasons = integrity_reasons(run.payload)
        if self.protocol.hacking_check and not run.payload["launches"].get("windows"):
            reasons.append("no_triton_launch: the timing windows' calls launched no Triton kernel")
        if reasons:
            return self.finish("hacked", hack_reasons=reasons, **self.common)
        return None

    def passed(self, run: ChildRun, reference: dict[str, Any]) -> EvalResult:
        """Step 8: a pass, its speedups the ratios of the judge's times, its PR the candidate's own
        profile (bounded; it informs the feedback and PR, never the verdict)."""
        figures = self.figures
        profile = run.payload.get("profile")
        pr = profile.get("pr") if profile else None
        notes = [f"torch.compile baseline failed: {reference['compile_error']}"] if reference.get("compile_error") else []
        cand_ms = figures["candidate_ms"]
        return self.finish(
            "pass",
            profile=profile,
            diagnostic="; ".join(notes + ([figures["note"]] if figures["note"] else [])),
            candidate_ms=cand_ms,
            eager_ms=figures["eager_ms"],
            compile_ms=figures["compile_ms"],
            speedup_eager=speedup(figures["eager_ms"], cand_ms),
            speedup_compile=speedup(figures["compile_ms"], cand_ms),
            pr=min(max(float(pr), 0.0), 1.0) if pr is not None else None,  # the candidate's own profile: bounded
            **self.common,
        )
