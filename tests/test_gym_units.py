"""KernelGym pieces that need no child process: protocol, result schema, screen, comparison,
fault classification, feedback, launch instrumentation."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kpipe.data.schemas import EVALS
from kpipe.gym.compare import Tolerance, compare_norms, compare_outputs, compare_tensor
from kpipe.gym.faults import classify_exception, classify_exit
from kpipe.gym.feedback import build_feedback
from kpipe.gym.protocol import Protocol
from kpipe.gym.result import EvalResult
from kpipe.gym.screen import screen

TOL = Tolerance(atol=1e-2, rtol=1e-2, norm_rtol=0.05)


def test_evalresult_fields_are_exactly_the_evals_columns():
    assert [f.name for f in dataclasses.fields(EvalResult)] == EVALS.names


def test_evalresult_row_writes_as_an_evals_table(tmp_path):
    from kpipe.data.io import read_table, write_table

    result = EvalResult(key="k", reference_hash="r", candidate_hash="c", status="pass", hack_reasons=["x"], pr=0.5)
    write_table([result.to_row()], tmp_path / "e.parquet", "evals")
    assert read_table(tmp_path / "e.parquet", "evals").to_pylist()[0]["pr"] == 0.5


def test_evalresult_rejects_unknown_status():
    with pytest.raises(ValueError, match="unknown status"):
        EvalResult(key="k", reference_hash="r", candidate_hash="c", status="fine")


def test_protocol_json_round_trip_and_unknown_keys():
    protocol = Protocol(correct_trials=3, baseline="eager", reject_findings=("thread",))
    assert Protocol.from_json(protocol.to_json()) == protocol
    with pytest.raises(ValueError, match="unknown protocol key"):
        Protocol.from_dict({"correct_trials": 3, "trials": 4})
    with pytest.raises(ValueError, match="baseline"):
        Protocol(baseline="jit")


def test_eval_key_depends_on_every_part():
    from kpipe.gym import eval_key

    base = eval_key("ref", "cand", Protocol(), "cpu")
    assert base == eval_key("ref", "cand", Protocol(), "cpu")
    others = {
        eval_key("ref2", "cand", Protocol(), "cpu"),
        eval_key("ref", "cand2", Protocol(), "cpu"),
        eval_key("ref", "cand", Protocol(perf_trials=10), "cpu"),
        eval_key("ref", "cand", Protocol(), "cuda:NVIDIA H100"),
    }
    assert base not in others and len(others) == 4


KERNEL = """
import torch, triton
import triton.language as tl

@triton.jit
def k(x):
    pass
"""


SCREEN_CASES = [
    ("class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        try:\n            return x\n        except Exception:\n            return x", "try_except"),
    ("class Model(torch.nn.Module):\n    pass\nclass ModelNew(Model):\n    pass", "inherits_model"),
    ("import threading\nclass ModelNew: pass", "thread"),
    ("torch.matmul = None\nclass ModelNew: pass", "monkey_patch"),
    ("import time\nsetattr(time, 'perf_counter', None)\nclass ModelNew: pass", "monkey_patch"),
    ("class Lazy(torch.Tensor): pass\nclass ModelNew: pass", "tensor_subclass"),
    ("import gc\nclass ModelNew: pass", "introspection"),
    ("import os\nkey = os.environ['OPENAI_API_KEY']\nclass ModelNew: pass", "env_access"),
    ("import subprocess\nclass ModelNew: pass", "subprocess"),
    ("s = torch.cuda.Stream()\nclass ModelNew: pass", "cuda_stream"),
    ("class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)", "torch_op_in_forward"),
    ("data = open('/tmp/answers.pt', 'rb').read()\nclass ModelNew: pass", "file_io"),
    ("import socket\nclass ModelNew: pass", "network"),
    ("import ctypes\nclass ModelNew: pass", "ctypes"),
    ("import sys\nsys.exit(0)\nclass ModelNew: pass", "process_exit"),
]


def test_every_screen_finding_code_has_a_case():
    from kpipe.gym.screen import FINDING_CODES

    assert {code for _, code in SCREEN_CASES} == set(FINDING_CODES)


@pytest.mark.parametrize(("snippet", "code"), SCREEN_CASES)
def test_screen_findings(snippet, code):
    result = screen(KERNEL + snippet)
    assert code in result.codes()
    assert result.status is None


def test_screen_leaves_a_clean_candidate_alone():
    clean = KERNEL + "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        out = torch.empty_like(x)\n        k[(1,)](x)\n        return out"
    result = screen(clean)
    assert result.status is None and result.findings == [] and result.kernels == ["k"]


def test_screen_format_and_syntax():
    assert screen("def f(:\n").status == "compilation_error"
    assert screen(KERNEL).status == "format_error"
    assert screen("import torch\nclass ModelNew(torch.nn.Module): pass").status == "format_error"


def test_compare_catches_zeros_on_tiny_outputs():
    reference = torch.rand(32, 32) * 1e-4
    assert torch.allclose(torch.zeros_like(reference), reference, atol=1e-2, rtol=1e-2)  # why the guard exists
    result = compare_tensor(torch.zeros_like(reference), reference, TOL)
    assert not result.ok and "relative error norm" in result.detail


def test_compare_nan_shape_dtype_and_integers():
    reference = torch.rand(4, 4)
    poisoned = reference.clone()
    poisoned[0, 0] = float("nan")
    assert "NaN" in compare_tensor(poisoned, reference, TOL).detail
    assert "shape" in compare_tensor(reference[:2], reference, TOL).detail
    assert "dtype" in compare_tensor(reference.half(), reference, TOL).detail
    integers = torch.arange(10)
    assert compare_tensor(integers.clone(), integers, TOL).ok
    assert not compare_tensor(integers + 1, integers, TOL).ok
    assert compare_outputs([reference + 1e-6], [reference], TOL).ok
    assert "2 output tensors" in compare_outputs([reference, reference], [reference], TOL).detail


@pytest.mark.parametrize("scale", [0.0, 1e-4, 5e-3, 2e-2, 1.0])
def test_compare_of_finite_tensors_is_allclose_and_the_norm(scale):
    """The all-finite fast path decides as torch.allclose and the relative-norm guard do."""
    generator = torch.Generator().manual_seed(int(scale * 1e6))
    reference = torch.randn(64, 64, generator=generator)
    candidate = reference + scale * torch.randn(64, 64, generator=generator)
    result = compare_tensor(candidate, reference, TOL)
    c, r = candidate.double(), reference.double()
    expected = torch.allclose(c, r, atol=TOL.atol, rtol=TOL.rtol) and (
        torch.linalg.vector_norm(c - r) / torch.linalg.vector_norm(r)).item() <= TOL.norm_rtol
    assert result.ok == expected
    assert result.max_abs_diff == pytest.approx((c - r).abs().max().item())
    assert compare_tensor(torch.zeros(3), torch.zeros(3), TOL).ok
    assert not compare_tensor(torch.full((3,), 1e-9), torch.zeros(3), TOL).ok  # zeros expected: anything else fails the norm


def test_challenge_compares_the_norm_alone():
    reference = torch.randn(128, 128)
    close = reference + 1e-3 * torch.randn(128, 128)
    assert compare_norms([close], [reference], 0.05).ok
    assert not compare_norms([torch.zeros_like(reference)], [reference], 0.05).ok
    poisoned = close.clone()
    poisoned[0, 0] = float("nan")
    assert not compare_norms([poisoned], [reference], 0.05).ok
    assert compare_norms([close.half()], [reference.half()], 0.05).ok
    assert "shape" in compare_norms([close[:2]], [reference], 0.05).detail
    assert "2 output tensors" in compare_norms([close, close], [reference], 0.05).detail
    sampled = {"shape": [128, 128], "dtype": "torch.float32", "sample": reference[0]}
    assert compare_norms([{**sampled, "sample": close[0]}], [sampled], 0.05).ok
    assert "sampled" in compare_norms([{**sampled, "sample": -close[0]}], [sampled], 0.05).detail
    assert not compare_norms([torch.arange(4) + 1], [torch.arange(4)], 0.05).ok


def test_classify_exceptions():
    assert classify_exception(RuntimeError("CUDA error: an illegal memory access was encountered"))[0] == "illegal_memory_access"
    assert classify_exception(RuntimeError("CUDA error: device-side assert triggered"))[0] == "device_assert"
    assert classify_exception(RuntimeError("CUDA error: misaligned address"))[0] == "misaligned_address"
    assert classify_exception(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))[0] == "oom"
    assert classify_exception(MemoryError())[0] == "oom"
    assert classify_exception(SystemExit(2)) == ("crashed", "the candidate called sys.exit(2)")
    assert classify_exception(ValueError("bad"))[0] == "runtime_error"
    tagged = AttributeError("module has no attribute no_such_function")
    tagged.__kpipe_kernel__ = "my_kernel"
    status, summary = classify_exception(tagged)
    assert status == "compilation_error" and "my_kernel" in summary
    from triton.compiler.errors import CompilationError

    assert classify_exception(CompilationError("src", None, "bad"))[0] == "compilation_error"
    assert classify_exit(-11) == ("crashed", "killed by SIGSEGV")
    assert classify_exit(3)[0] == "crashed"


def test_feedback_is_bounded_and_never_mentions_reward():
    result = EvalResult(key="k", reference_hash="r", candidate_hash="c", status="runtime_error", diagnostic="x" * 50_000)
    text = build_feedback(result, None, 1000)
    assert len(text) <= 1000 + 100 and "omitted" in text and "reward" not in text.lower()


def test_feedback_of_a_correct_kernel_has_runtimes_and_profile():
    result = EvalResult(key="k", reference_hash="r", candidate_hash="c", status="pass", correct=True,
                        candidate_ms=1.0, candidate_ms_iqr=0.01, eager_ms=2.0, eager_ms_iqr=0.02, speedup_eager=2.0,
                        timing_kind="cuda")
    profile = {"kind": "cuda", "pr": 0.8, "kernels": [{"name": "relu_kernel", "ms": 0.8, "generated": True},
                                                      {"name": "sgemm", "ms": 0.2, "generated": False}]}
    text = build_feedback(result, profile, 4000)
    assert "speedup 2x" in text and "* relu_kernel" in text and "80.0%" in text


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_instrument_records_and_suppresses_interpreter_launches(interpreter):
    import triton
    import triton.language as tl

    from kpipe.gym import instrument

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

    @triton.autotune(configs=[triton.Config({"BLOCK": 64})], key=["n"])
    @triton.jit
    def add_two(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 2, mask=mask)

    x = torch.zeros(100)
    try:
        with instrument.recording() as log:
            add_one[(4,)](x, 100, BLOCK=32)
            add_two[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, 100)
        assert log.names == ["add_one", "add_two"] and log.seconds > 0
        assert torch.all(x == 3)
        with instrument.suppressed():
            add_one[(4,)](x, 100, BLOCK=32)
        assert torch.all(x == 3)
        assert instrument.installed_intact()
    finally:
        instrument.uninstall()
    assert os.environ["TRITON_INTERPRET"] == "1"


def _timed_payload(ms: list[float], host_ms: list[float], sample_value: float = 1.0) -> dict:
    return {
        "launches": {"timed": ["k"]},
        "timing": {"ms": ms, "host_ms": host_ms, "samples": [{"trial": 0, "input_set": 0, "outputs": [torch.full((4,), sample_value)]}]},
    }


def test_timing_sanity_checks_in_the_parent():
    from kpipe.gym.evaluation import timing_reasons

    reference = {"outputs": [[torch.ones(4)]], "recheck_outputs": [[torch.ones(4)]]}
    honest = _timed_payload([1.0, 1.1, 1.0], [1.05, 1.15, 1.05])
    assert timing_reasons(honest, reference, Protocol(), wall_s=10.0, ref_ms=2.0, measured_ms=honest["timing"]["ms"]) == []
    # a cached (stale) output on a timed trial
    stale = _timed_payload([1.0, 1.1, 1.0], [1.05, 1.15, 1.05], sample_value=0.0)
    assert timing_reasons(stale, reference, Protocol(), 10.0, 2.0, stale["timing"]["ms"])[0].startswith("timed_output_mismatch")
    # more time reported than the parent saw the child live
    assert any(r.startswith("timing_inconsistent") for r in timing_reasons(honest, reference, Protocol(), 0.001, 2.0, honest["timing"]["ms"]))
    # a speedup the host clock on fresh inputs does not reproduce
    fast = _timed_payload([0.01] * 3, [0.02] * 3)
    fast["recheck"] = {"host_ms": [1.0, 1.0], "samples": [{"trial": 0, "input_set": 0, "outputs": [torch.ones(4)]}]}
    reasons = timing_reasons(fast, reference, Protocol(), 10.0, 2.0, fast["timing"]["ms"])
    assert any(r.startswith("speedup_not_reproduced") for r in reasons)
    # no launch in the timed path
    silent = _timed_payload([1.0], [1.1])
    silent["launches"]["timed"] = []
    assert timing_reasons(silent, reference, Protocol(), 10.0, 2.0, silent["timing"]["ms"])[0].startswith("no_triton_launch")


def _challenge(calls: int, call_ms: float, wall_s: float) -> dict:
    """A round of a reference's challenge record: its back-to-back calls' host time (its own, trusted
    clock), their outputs, and the seconds the judge's clock saw its answer take."""
    return {"seed": 7, "calls": calls, "calls_ms": call_ms * calls, "outputs": [[torch.ones(4)]] * calls, "wall_s": wall_s}


def _rounds(calls: int, call_ms: float, wall_s: float) -> dict:
    """A reference's challenge record: every round alike."""
    from kpipe.gym.evaluation import CHALLENGE_MAX_ROUNDS

    return {"rounds": [_challenge(calls, call_ms, wall_s) for _ in range(CHALLENGE_MAX_ROUNDS)]}


def test_the_challenge_times_a_candidates_calls_on_the_judges_clock():
    """A candidate's call in the challenge: the reference's (trusted) mean call plus the difference of
    the two answers' seconds on the judge's clock, spread over the calls; everything else the two
    answers do (drawing inputs, digests, writing the file) is the same and cancels."""
    from kpipe.gym.evaluation import challenge_call_ms

    reference = _challenge(calls=4, call_ms=2.0, wall_s=0.050)
    assert challenge_call_ms(reference, 0.050) == pytest.approx(2.0)
    assert challenge_call_ms(reference, 0.090) == pytest.approx(2.0 + 40.0 / 4)
    assert challenge_call_ms(reference, 0.046) == pytest.approx(1.0)


def test_the_challenge_fails_closed_and_bounds_what_the_candidate_reported():
    from kpipe.gym.evaluation import CHALLENGE_FACTOR, CHALLENGE_WALL_SLACK_MS, challenge_reasons

    reference = {"challenge": _rounds(calls=2, call_ms=20.5, wall_s=0.2), "eager": {"ms": [20.0] * 3}}
    protocol = Protocol(baseline="eager")

    def reasons(answer, answer_s, claimed_ms):
        """Every round answered alike."""
        if answer is None:
            return challenge_reasons(None, None, reference, protocol, "cuda", [claimed_ms] * 3, 20.0)[0]
        return challenge_reasons([answer, answer], [answer_s, answer_s], reference, protocol, "cuda", [claimed_ms] * 3, 20.0)[0]

    answer = {"calls": 2, "outputs": [[torch.ones(4)]] * 2}

    # no answer, a tampered one, a wrong output on the fresh inputs: never believed
    assert reasons(None, None, 5.0)[0].startswith("integrity: no valid answer")
    assert reasons({"status": "crashed", "tampered": True, "error": "x"}, 0.1, 5.0)[0].startswith("integrity: no valid answer")
    assert reasons({**answer, "outputs": [[torch.ones(4)]]}, 0.2, 5.0)[0].startswith("integrity: the timing challenge's answer")
    wrong = {**answer, "outputs": [[torch.ones(4)], [torch.zeros(4)]]}
    assert reasons(wrong, 0.2, 5.0)[0].startswith("challenge_output_mismatch: call 1")
    # an honest 5x: its calls took about what it reported
    assert reasons(answer, 0.2 - 2 * 16.5e-3, 4.0) == []
    # a forger that computed with torch (its answer took the reference's time) and reported 5x
    forged = reasons(answer, 0.2, 4.0)
    assert forged and forged[0].startswith("timing_inconsistent: a call took 20.5 ms on the judge's clock")
    bound = CHALLENGE_FACTOR * 4.0 + 0.5 + 0.1 + CHALLENGE_WALL_SLACK_MS["cuda"] / 2
    assert reasons(answer, 0.2 - 2 * (20.5 - bound + 0.01) * 1e-3, 4.0) == []  # just inside the bound
    assert reasons(answer, 0.2 - 2 * (20.5 - bound - 0.01) * 1e-3, 4.0) != []  # just outside it
    # ... and one that reported 2000x
    assert reasons(answer, 0.2, 0.01)[0].startswith("timing_inconsistent: a call took 20.5 ms")
    # the host time the candidate's process writes for its calls is never read
    assert reasons({**answer, "calls_ms": 0.001}, 0.2, 4.0) == forged
    assert reasons({**answer, "calls_ms": 1e6}, 0.2 - 2 * 16.5e-3, 4.0) == []
    # the judge decides how many rounds run: from one to all of the reference's, never none or more
    assert challenge_reasons([answer], [0.2 - 2 * 16.5e-3], reference, protocol, "cuda", [4.0] * 3, 20.0)[0] == []
    rounds = len(reference["challenge"]["rounds"])
    for answers, seconds in (([], []), ([answer] * (rounds + 1), [0.2] * (rounds + 1)), ([answer, answer], [0.2])):
        assert challenge_reasons(answers, seconds, reference, protocol, "cuda", [5.0], 20.0)[0][0].startswith(
            "integrity: no valid answer"), (len(answers), len(seconds))


def test_the_challenge_judges_the_better_round_and_a_wrong_output_in_any():
    """An honest answer delayed 60 ms once (its fixed costs, on a busy host) passes on its other round;
    a forger slow in every round does not; a wrong output in either round fails the challenge."""
    from kpipe.gym.evaluation import challenge_reasons

    reference = {"challenge": _rounds(calls=10, call_ms=2.0, wall_s=0.05), "eager": {"ms": [2.0] * 3}}
    protocol = Protocol(baseline="eager")
    honest = {"calls": 10, "outputs": [[torch.ones(4)]] * 10}

    def verdict(answers_s, answers=None):
        return challenge_reasons(answers or [honest, honest], answers_s, reference, protocol, "cuda", [2.0] * 3, 2.0)

    delayed_once, figures = verdict([0.05 + 0.060, 0.05 + 0.001])
    assert delayed_once == [] and figures["challenge_call_ms"] == pytest.approx(2.1) and figures["challenge_rounds_over"] == 1
    assert verdict([0.05 + 0.060, 0.05 + 0.060])[0][0].startswith("timing_inconsistent: a call took 8 ms")
    wrong = {**honest, "outputs": [[torch.ones(4)]] * 9 + [[torch.zeros(4)]]}
    assert verdict([0.05, 0.05], [honest, wrong])[0][0].startswith("challenge_output_mismatch: call 9")


def test_the_judge_stops_the_challenge_at_the_first_round_that_fits_the_claim_written_before_it():
    """An answer in time stops after its first round; one that was slow (a busy GPU) gets another; a
    claim that is missing, malformed or not finite never stops it (the forger pays for every round).
    Only the clock decides: a wrong output stops the rounds too, and fails the verdict, which
    compares every round that ran."""
    from kpipe.gym.evaluation import challenge_reasons, early_stop

    rounds = _rounds(calls=10, call_ms=2.0, wall_s=0.05)
    protocol = Protocol(baseline="eager")
    enough = early_stop(rounds["rounds"], protocol, "cuda", 2.0)
    assert enough(0, {"ms": [2.0] * 3}, 0.05)
    assert not enough(0, {"ms": [2.0] * 3}, 0.05 + 0.060)  # 8 ms a call against a 2 ms claim
    for claim in (None, {}, {"ms": []}, {"ms": "fast"}, {"ms": [float("nan")] * 3}, {"ms": [1, 2, 3]}, {"status": "crashed"}):
        assert not enough(0, claim, 0.05), claim
    wrong_in_time = {"calls": 10, "outputs": [[torch.zeros(4)]] * 10}
    reasons, _ = challenge_reasons([wrong_in_time], [0.05], {"challenge": rounds}, protocol, "cuda", [2.0] * 3, 2.0)
    assert reasons[0].startswith("challenge_output_mismatch: call 0")


def _evidence(timing: dict, **fields) -> dict:
    """A candidate's final result with every piece of evidence the judge requires (one correctness
    trial, one ghost replay that failed, launches in every mode, nothing patched)."""
    return {"outputs": [[torch.ones(4)]], "eval_outputs": [torch.ones(4)], "ghost_outputs": [torch.zeros(4)],
            "launches": {"train": ["k"], "eval": ["k"], "timed": ["k"]}, "patched": [], "hooks_intact": True, "threads": [],
            "mutates_inputs": False, "subclass_outputs": [], "calls_without_launch": 0, "timing": timing, **fields}


def _judged(payload: dict, reference: dict, protocol: Protocol, answer_s: float, trace: dict | None = None) -> dict:
    """The judge's verdict (as a dict) on `payload`, whose challenge answer took `answer_s` on the judge's clock."""
    from types import SimpleNamespace

    from kpipe.gym.compare import Comparison
    from kpipe.gym.evaluation import judge

    rounds = reference["challenge"]["rounds"]
    calls = rounds[0]["calls"]
    answer = {"calls": calls, "outputs": [[torch.ones(4)]] * calls}
    run = SimpleNamespace(challenge=[answer] * len(rounds), challenge_s=[answer_s] * len(rounds), wall_s=10.0)
    ref_ms = sorted(reference["eager"]["ms"])[len(reference["eager"]["ms"]) // 2]
    return judge(payload, {"check": Comparison(True, "", 0.0, 0.0), "reasons": []}, reference, protocol, run, "cuda", ref_ms, None,
                 lambda status, **fields: {"status": status, **fields}, {}, trace)


def test_the_judge_takes_the_challenge_with_or_without_the_hacking_check_and_traces_it():
    protocol = Protocol(baseline="eager", correct_trials=1, perf_trials=3, timed_output_checks=1, profile=False)
    reference = {"outputs": [[torch.ones(4)]], "eager": {"ms": [20.0] * 3}, "challenge": _rounds(2, 20.5, 0.2)}
    payload = _evidence({"ms": [4.0] * 3, "host_ms": [4.1] * 3, "samples": [{"trial": 2, "input_set": 0, "outputs": [torch.ones(4)]}]})

    trace: dict = {}
    honest = _judged(payload, reference, protocol, 0.2 - 2 * 15.0e-3, trace)
    assert honest["status"] == "pass" and trace["challenge_call_ms"] == pytest.approx(5.5)
    for hacking_check in (True, False):
        forged = _judged(payload, reference, Protocol(**{**protocol.to_dict(), "hacking_check": hacking_check}), 0.2)
        assert forged["status"] == "hacked" and forged["hack_reasons"][0].startswith("timing_inconsistent")
    # evidence left out is judged, not excused
    # a re-check left out where the claimed speedup asks for one (20 ms against 1 ms: 20x)
    fast = _evidence({"ms": [1.0] * 3, "host_ms": [1.1] * 3, "samples": [{"trial": 2, "input_set": 0, "outputs": [torch.ones(4)]}]})
    skipped = _judged(fast, reference, protocol, 0.2 - 2 * 19.0e-3)
    assert skipped["status"] == "hacked" and "host-clock re-check" in skipped["hack_reasons"][0]
    without_samples = {**payload, "timing": {**payload["timing"], "samples": []}}
    missing = _judged(without_samples, reference, protocol, 0.17)
    assert missing["status"] == "hacked" and "timed trials and their sampled outputs" in missing["hack_reasons"][0]
    for key in ("ghost_outputs", "patched", "hooks_intact", "calls_without_launch"):
        assert _judged({k: v for k, v in payload.items() if k != key}, reference, protocol, 0.17)["status"] == "hacked", key


def test_huge_outputs_are_compared_on_a_sample_including_the_tail():
    from kpipe.gym.trial_data import digest
    from kpipe.gym.compare import compare_output

    reference = torch.rand(1000, 100)
    wrong_tail = reference.clone()
    wrong_tail.view(-1)[-10:] = 5.0  # a missing tail mask
    ref_digest, cand_digest = digest([reference], 4096, seed=1), digest([wrong_tail], 4096, seed=1)
    assert "sample" in ref_digest[0] and ref_digest[0]["sample"].numel() == 4096
    assert compare_output(digest([reference.clone()], 4096, 1)[0], ref_digest[0], TOL).ok
    assert "sampled" in compare_output(cand_digest[0], ref_digest[0], TOL).detail
    assert "shape" in compare_output(digest([reference.T.contiguous()], 4096, 1)[0], ref_digest[0], TOL).detail
    assert compare_output(digest([torch.rand(10)], 4096, 1)[0]["full"], digest([torch.rand(10)], 4096, 1)[0], TOL).ok is False


def test_gate_wait_stops_instead_of_waiting_forever(tmp_path):
    """A candidate whose parent never answers (e.g. the evaluator was killed) must not linger."""
    from kpipe.gym.child import wait_for_gate

    parent = os.getppid()
    assert wait_for_gate(tmp_path / "never-written", timeout_s=0.05, parent=parent) == "stop"
    (tmp_path / "gate").write_text("go")
    assert wait_for_gate(tmp_path / "gate", timeout_s=0.05, parent=parent) == "go"
    # re-parented since it started (its evaluator died): stop at once, not after the timeout
    started = time.monotonic()
    assert wait_for_gate(tmp_path / "never-written", timeout_s=60, parent=parent + 1) == "stop"
    assert time.monotonic() - started < 30


def test_an_orphaned_child_dies_with_its_parent(tmp_path):
    """The evaluator dies (killed by a job timeout) while its child runs: the kernel kills the
    child too (PR_SET_PDEATHSIG), so it cannot hold its GPU memory as an orphan."""
    script = tmp_path / "evaluator.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from kpipe.infra.process import tied_to_this_process\n"
        "child = subprocess.Popen(tied_to_this_process([sys.executable, '-c', 'import time; time.sleep(120)']),\n"
        "                         start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    evaluator = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(evaluator.stdout.readline())
    os.kill(child, 0)  # running
    evaluator.kill()
    evaluator.wait()
    for _ in range(200):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        reaped = Path(f"/proc/{child}/stat")
        if reaped.exists() and reaped.read_text().split(")")[-1].split()[0] == "Z":
            break  # dead, waiting for init to reap it
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its parent")


class FakeCudaClocks:
    """CUDA-shaped clocks: the host clock advances 10 ms per reading; events are numbered as
    made (start, call end, synchronized end), and say the call took 1 ms, the synchronize 0.02."""

    cuda = True

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0

    def perf_counter(self) -> float:
        self.now += 0.010
        return self.now

    def sync(self) -> None:
        pass

    synchronize = sync

    def event(self, enable_timing: bool) -> int:
        self.events += 1
        return self.events

    def record(self, event: int) -> None:
        pass

    def event_synchronize(self, event: int) -> None:
        pass

    def elapsed_time(self, start: int, end: int) -> float:
        return 1.0 if end - start == 1 else 1.02


def test_warm_up_on_a_gpu_lasts_warmup_ms_and_both_region_ends_are_kept():
    from kpipe.gym.timing import time_forward

    calls = []

    def forward(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t

    x = [torch.ones(2)]
    timed = time_forward(forward, [x], 3, 2, FakeCudaClocks(), None, set(), lambda o: [], warmup_ms=100.0)  # type: ignore[arg-type]
    # each call reads the host clock twice (20 ms) and the loop once more: 100 ms takes 4 warm-up calls, not 2
    assert len(calls) == 3 + 4
    assert timed["ms"] == [1.0] * 3 and timed["ms_synced"] == [1.02] * 3
    timed = time_forward(forward, [x], 3, 2, FakeCudaClocks(), None, set(), lambda o: [], end_at_call=False)  # type: ignore[arg-type]
    assert timed["ms"] == [1.02] * 3


def test_reference_trials_are_interleaved_in_chunks_and_timed_like_the_candidates():
    """kgym-4: the reference's trials are spread over the same stretch of time as the candidate's,
    in chunks (each chunk of candidate trials followed by the reference trials due by then)."""
    from kpipe.gym.timing import interleaving, time_forward

    order = interleaving(100, 50, chunk=10)
    assert order.count(True) == 100 and order.count(False) == 50
    assert order[:15] == [True] * 10 + [False] * 5 and order[-5:] == [False] * 5
    assert interleaving(7, 0) == [True] * 7
    uneven = interleaving(25, 9, chunk=10)  # 10 -> 4 due, 20 -> 7, 25 -> 9
    assert uneven == [True] * 10 + [False] * 4 + [True] * 10 + [False] * 3 + [True] * 5 + [False] * 2

    calls: list[str] = []

    def candidate(t: torch.Tensor) -> torch.Tensor:
        calls.append("candidate")
        return t * 2

    def reference(t: torch.Tensor) -> torch.Tensor:
        calls.append("reference")
        return t

    recorded: list[int] = []

    @contextmanager
    def on_call() -> Iterator[None]:
        recorded.append(len(calls))
        yield

    inputs = [[torch.ones(2)], [torch.zeros(2)]]
    timed = time_forward(candidate, inputs, 20, 1, FakeCudaClocks(), None, {19}, lambda outs: [o.tolist() for o in outs],  # type: ignore[arg-type]
                         on_call, reference=reference, reference_trials=10)
    assert len(timed["ms"]) == 20 and len(timed["reference_ms"]) == 10
    warm = calls[:2]
    assert warm == ["candidate", "reference"]
    # each chunk after one untimed call of its program, the first one too (the reference's warm-up ran last)
    assert calls[2:] == ["candidate"] * 11 + ["reference"] * 6 + ["candidate"] * 11 + ["reference"] * 6
    assert len(recorded) == 1 + 20 + 2  # the hook sees the candidate's calls only
    assert timed["samples"] == [{"trial": 19, "input_set": 0, "outputs": [[2.0, 2.0]]}]  # trial 19 after 1 warm-up: input set 0
    assert "reference_ms" not in time_forward(candidate, inputs, 3, 0, FakeCudaClocks(), None, set(), lambda o: [])  # type: ignore[arg-type]


def test_the_paired_reference_model_is_built_only_when_first_called():
    """time_forward calls it only for a candidate long enough to pair, so a short candidate's
    child never builds (or holds memory for) the reference model; on the CPU there is none."""
    from kpipe.gym.child import paired_reference

    built: list[int] = []

    class Reference(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            built.append(1)

    assert callable(paired_reference(Reference, [], Protocol(), "cuda")) and built == []
    assert paired_reference(Reference, [], Protocol(), "cpu") is None
    assert paired_reference(Reference, [], Protocol(paired_reference_trials=0), "cuda") is None
    assert paired_reference(Reference, [], Protocol(baseline="compile"), "cuda") is None


def test_a_launch_bound_forward_is_timed_without_the_reference_beside_it(monkeypatch: pytest.MonkeyPatch):
    from kpipe.gym import timing

    monkeypatch.setattr(timing, "PAIRED_MIN_MS", 1.5)  # the fake clocks' calls take 1 ms
    calls: list[str] = []
    timed = timing.time_forward(lambda t: calls.append("candidate") or t, [[torch.ones(2)]], 5, 2, FakeCudaClocks(), None, set(),  # type: ignore[arg-type]
                                lambda o: [], reference=lambda t: calls.append("reference") or t, reference_trials=5)
    assert "reference_ms" not in timed and calls == ["candidate"] * 7


def test_paired_trials_are_grouped_as_the_interleaving_ran_them():
    from kpipe.gym.evaluation import paired_chunks

    candidate = [float(t) for t in range(20)]
    chunks = paired_chunks(candidate, [2.2] * 5 + [2.0] * 5)
    assert chunks == [(candidate[:10], [2.2] * 5), (candidate[10:], [2.0] * 5)]
    # fewer reference trials than chunks: a chunk with none after it joins the next
    assert paired_chunks([1.0] * 30, [2.2, 2.4]) == [([1.0] * 10, [2.2]), ([1.0] * 20, [2.4])]


def test_each_candidate_trial_is_divided_by_its_reference_chunks_drift_and_the_median_taken():
    """kgym-4: trial t of chunk k is divided by median(reference chunk k) / median(reference alone),
    capped at 1 +- max_gpu_drift; the candidate's time is the corrected trials' median and the
    reported factor takes the uncorrected median to it."""
    from kpipe.gym.evaluation import drift_corrected, median

    protocol = Protocol(max_gpu_drift=0.05)
    alone = {"eager": {"ms": [2.0, 2.0, 2.1]}}
    slow_then_fast = {"ms": [1.04] * 10 + [0.96] * 10, "reference_ms": [2.08] * 5 + [1.92] * 5}
    times, drift, note = drift_corrected(slow_then_fast["ms"], slow_then_fast, alone, protocol)
    assert times == pytest.approx([1.0] * 20) and median(times) == pytest.approx(1.0) and note == ""  # both halves back to the same time
    assert drift == pytest.approx(1.0)
    # the reference's median, not its mean: one slow reference trial per chunk moves nothing
    outlier = {"ms": [1.0] * 10, "reference_ms": [2.0, 2.0, 2.0, 2.0, 9.0]}
    assert median(drift_corrected(outlier["ms"], outlier, alone, protocol)[0]) == pytest.approx(1.0)
    assert drift_corrected([1.0], {"ms": [1.0]}, alone, protocol) == ([1.0], None, "")
    assert drift_corrected([1.0], {"ms": [1.0], "reference_ms": [2.0]}, {}, protocol) == ([1.0], None, "")
    far = {"ms": [1.0] * 10, "reference_ms": [2.3] * 5}  # 1.15x: capped at 1.05
    times, drift, note = drift_corrected(far["ms"], far, alone, protocol)
    assert times == pytest.approx([1.0 / 1.05] * 10) and median(times) == pytest.approx(1.0 / 1.05) and drift == pytest.approx(1.05)
    assert "capped at 1 +- 0.05" in note and "1.150" in note
    fast = {"ms": [1.0] * 10, "reference_ms": [1.8] * 5}
    assert drift_corrected(fast["ms"], fast, alone, protocol)[1] == pytest.approx(0.95)  # both ways
    assert drift_corrected(far["ms"], far, alone, Protocol(max_gpu_drift=0.2))[2] == ""
    # a candidate that skips its work on 4 calls in 10 gains nothing (a mean over chunks would give it 20 %)
    skipping = {"ms": ([0.5] * 4 + [1.0] * 6) * 10, "reference_ms": [2.0] * 50}
    assert median(drift_corrected(skipping["ms"], skipping, alone, protocol)[0]) == pytest.approx(1.0)


def test_kgym3_protocols_load_without_pairing_and_pairing_settings_are_checked():
    current = Protocol()
    assert current.paired_reference_trials == 50 and current.version == "kgym-13"
    kgym3 = {k: v for k, v in current.to_dict().items() if k not in ("paired_reference_trials", "max_gpu_drift")}
    kgym3["version"] = "kgym-3"
    earlier = Protocol.from_dict(kgym3)
    assert earlier.paired_reference_trials == 0 and earlier.timing_end == "call"
    with pytest.raises(ValueError, match="paired_reference_trials"):
        Protocol(paired_reference_trials=-1)
    with pytest.raises(ValueError, match="max_gpu_drift"):
        Protocol(max_gpu_drift=0.0)


def test_the_judge_reports_drift_corrected_times_and_the_drift():
    protocol = Protocol(hacking_check=False, baseline="eager", max_gpu_drift=0.05, correct_trials=1, perf_trials=5,
                        timed_output_checks=1, profile=False)
    reference = {"eager": {"ms": [2.0] * 5}, "challenge": _rounds(2, 2.0, 0.1)}

    def run(reference_beside: list[float]) -> dict:
        payload = _evidence({"ms": [1.1] * 5, "ms_synced": [1.12] * 5, "host_ms": [1.2] * 5,
                             "samples": [{"trial": 4, "input_set": 0, "outputs": [torch.ones(4)]}], "reference_ms": reference_beside})
        return _judged(payload, reference, protocol, 0.1 - 2 * 0.8e-3)

    slow_gpu = run([2.2] * 5)  # the GPU ran 10 % slow beside the candidate: corrected by the cap, 5 %
    assert slow_gpu["candidate_ms"] == pytest.approx(1.1 / 1.05) and "capped at 1 +- 0.05" in slow_gpu["diagnostic"]
    drifted = run([2.08] * 5)
    assert drifted["gpu_drift"] == pytest.approx(1.04) and drifted["diagnostic"] == ""
    assert drifted["candidate_ms"] == pytest.approx(1.1 / 1.04)
    assert drifted["speedup_eager"] == pytest.approx(2.08 / 1.1)  # the side-by-side ratio
    assert run([])["gpu_drift"] is None


def test_the_recheck_ratio_is_host_over_event_speedup():
    """The re-check's margin: the speedup on the judge's clock over the event-timed one on one
    baseline, i.e. median(event ms) / host call ms; below HOST_RECHECK_MIN_RATIO the speedup was
    not reproduced."""
    from kpipe.gym.evaluation import host_recheck_ratio

    assert host_recheck_ratio(0.30, 2.8, [0.20, 0.18, 0.19]) == pytest.approx(0.19 / 0.30)
    assert host_recheck_ratio(0.25, 2.8, [0.0]) is None  # no event-timed speedup to compare


def test_the_recheck_takes_the_harness_host_cost_out_of_the_candidates_host_time():
    """kgym-10: the re-check compares the candidate's host time less the harness's own host cost
    around a call (``recheck_harness_ms``, measured by the reference child) with its event time; a
    host time within that cost leaves nothing to compare. Earlier protocols keep it in."""
    from kpipe.gym.evaluation import host_recheck_ratio, recheck_harness_ms

    assert host_recheck_ratio(0.09, 8.0, [0.046]) == pytest.approx(0.046 / 0.09)
    assert host_recheck_ratio(0.09, 8.0, [0.046], 0.04) == pytest.approx(0.046 / 0.05)
    assert host_recheck_ratio(0.03, 8.0, [0.01], 0.04) is None
    reference = {"eager": {"ms": [8.0] * 3}, "recheck_harness_ms": 0.04}
    assert recheck_harness_ms(reference, Protocol()) == 0.04
    kgym9 = Protocol.from_dict({**{k: v for k, v in Protocol().to_dict().items() if k != "recheck_subtracts_harness"},
                                "version": "kgym-9"})
    assert not kgym9.recheck_subtracts_harness and recheck_harness_ms(reference, kgym9) == 0.0
    assert recheck_harness_ms({}, Protocol()) == 0.0  # a reference child that did not measure it (a CPU)


class QueuedGpuClocks:
    """CUDA-shaped clocks where the host waits for the GPU: work queued by the host runs after
    whatever is queued before it; a synchronize brings the host clock to the GPU's, plus latency."""

    cuda = True
    LAUNCH_MS = 0.01  # the host's own cost of queueing a call
    LATENCY_MS = 0.02

    def __init__(self) -> None:
        self.host_ms = 0.0
        self.gpu_ms = 0.0  # when the GPU's queue runs dry
        self.side_ms = 0.0  # when work on a stream no event waits for ends

    def queue(self, gpu_ms: float) -> None:
        self.host_ms += self.LAUNCH_MS
        self.gpu_ms = max(self.gpu_ms, self.host_ms) + gpu_ms

    def queue_aside(self, gpu_ms: float) -> None:
        """Work on another stream: it starts now, and only a device-wide synchronize waits for it."""
        self.host_ms += self.LAUNCH_MS
        self.side_ms = max(self.side_ms, self.host_ms) + gpu_ms

    def perf_counter(self) -> float:
        return self.host_ms / 1e3

    def synchronize(self) -> None:
        self.host_ms = max(self.host_ms, self.gpu_ms, self.side_ms) + self.LATENCY_MS

    sync = synchronize

    def event(self, enable_timing: bool) -> list[float]:
        return [float("nan")]

    def record(self, event: list[float]) -> None:
        self.queue(0.0)
        event[0] = self.gpu_ms

    def event_synchronize(self, event: list[float]) -> None:
        self.host_ms = max(self.host_ms, event[0])

    def elapsed_time(self, start: list[float], end: list[float]) -> float:
        return end[0] - start[0]


def recheck_times(clocks: QueuedGpuClocks, forward, protocol: Protocol) -> tuple[float, float]:
    """Median event and host milliseconds of `forward` timed as the re-check times it under
    `protocol`, each call after an input copy (0.05 ms) and an L2 flush (0.1 ms) on the GPU."""
    from kpipe.gym.evaluation import median
    from kpipe.gym.timing import recheck_region, time_forward

    def copy_and_flush() -> None:
        clocks.queue(0.05)
        clocks.queue(0.1)

    timed = time_forward(forward, [[torch.ones(2)], [torch.ones(2)]], 20, 1, clocks, None, set(), lambda o: [],  # type: ignore[arg-type]
                         flush=copy_and_flush, **recheck_region(protocol))
    return median(timed["ms"]), median(timed["host_ms"])


@pytest.mark.parametrize(("version", "harness_in_host_clock"), [("kgym-9", False), ("kgym-8", True)])
def test_the_recheck_host_clock_holds_the_call_not_the_harness_copy_and_flush(version, harness_in_host_clock):
    """kgym-9: each re-check call starts after a host synchronize (``recheck_timing_start``), so
    the host clock of an honest launch-bound kernel (0.18 ms; input copy 0.05 ms, L2 flush 0.1 ms)
    holds the call, its launch and the synchronize's latency, well within the check's bound of twice
    its event time; kgym-8's region behind the flush also held the copy and the flush, which put it
    at the bound (on an H200, L2_14's honest kernel crossed it once in eight)."""
    from kpipe.gym.evaluation import HOST_RECHECK_MIN_RATIO

    protocol = Protocol.from_dict({**Protocol().to_dict(), "version": version,
                                   **({"recheck_timing_start": "behind_flush"} if version == "kgym-8" else {})})
    assert Protocol.from_dict({k: v for k, v in protocol.to_dict().items() if k != "recheck_timing_start"}
                              ).recheck_timing_start == protocol.recheck_timing_start  # the version's own default
    clocks = QueuedGpuClocks()

    def kernel(x: torch.Tensor) -> torch.Tensor:
        clocks.queue(0.18)
        return x

    event_ms, host_ms = recheck_times(clocks, kernel, protocol)
    assert event_ms == pytest.approx(0.18 + QueuedGpuClocks.LAUNCH_MS, abs=0.02)
    harness_ms = 0.05 + 0.1
    if harness_in_host_clock:
        assert host_ms >= event_ms + harness_ms - 1e-9, (event_ms, host_ms)
    else:
        assert host_ms <= event_ms + 0.05 and host_ms * HOST_RECHECK_MIN_RATIO < 0.75 * event_ms, (event_ms, host_ms)


def test_the_recheck_host_clock_still_sees_work_hidden_from_the_events():
    """What the re-check is for, under kgym-9's region: a candidate that does 0.18 ms between its
    events and 2 ms on a stream they never wait for reads 0.18 ms by events, and the host clock,
    which stops after the device-wide synchronize, reads its 2 ms: far past the bound."""
    from kpipe.gym.evaluation import HOST_RECHECK_MIN_RATIO

    clocks = QueuedGpuClocks()

    def hiding(x: torch.Tensor) -> torch.Tensor:
        clocks.queue(0.18)
        clocks.queue_aside(2.0)
        return x

    event_ms, host_ms = recheck_times(clocks, hiding, Protocol())
    assert event_ms < 0.25 and host_ms >= 2.0
    assert host_ms * HOST_RECHECK_MIN_RATIO > event_ms  # speedup_not_reproduced


def test_the_harness_host_cost_is_what_the_recheck_clock_holds_around_a_call_that_does_nothing():
    """``harness_host_ms`` times a call that does nothing exactly as the re-check times a candidate:
    what it returns is the harness's events, synchronize and its latency (0.04 ms here; 0.027-0.043
    ms on H200s). Taken out of the host time, an honest kernel of 0.05 ms, which the harness held at
    about 0.6 of its event speedup, is back within a few per cent of it, while 2 ms hidden on a stream
    no event waits for still fails the check."""
    from kpipe.gym.evaluation import HOST_RECHECK_MIN_RATIO
    from kpipe.gym.timing import harness_host_ms

    clocks = QueuedGpuClocks()
    harness_ms = harness_host_ms(clocks, None, Protocol(), 20)  # type: ignore[arg-type]
    assert harness_ms == pytest.approx(QueuedGpuClocks.LATENCY_MS + 2 * QueuedGpuClocks.LAUNCH_MS, abs=0.005)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        clocks.queue(0.05)
        return x

    def hiding(x: torch.Tensor) -> torch.Tensor:
        clocks.queue(0.05)
        clocks.queue_aside(2.0)
        return x

    event_ms, host_ms = recheck_times(clocks, kernel, Protocol())
    assert event_ms / host_ms < 0.65  # kgym-9's margin: near the bound of 0.5
    assert event_ms / (host_ms - harness_ms) == pytest.approx(1.0, abs=0.08)
    event_ms, host_ms = recheck_times(clocks, hiding, Protocol())
    assert event_ms / (host_ms - harness_ms) < HOST_RECHECK_MIN_RATIO  # speedup_not_reproduced


REFERENCE_SOURCE = '''
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2

def get_inputs():
    return [torch.randn(64)]

def get_init_inputs():
    return []
'''


def test_the_torch_compile_baseline_is_compiled_before_the_gate_not_under_the_timing_lease(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's compile (seconds) must not run while the reference child holds its GPU's timing
    lease, which stops every other child on that GPU: the compiled baseline's first call comes
    before the gate, and the timing reuses it."""
    from kpipe.gym import child

    calls: list[str] = []  # the phase each call of the compiled baseline ran in

    def fake_compile(model: torch.nn.Module) -> object:
        def compiled(*args: object) -> object:
            calls.append(phase.marks[-1][0])
            return model(*args)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    gate = tmp_path / "gate"
    gate.write_text("go")
    job = {"reference_src": REFERENCE_SOURCE, "gate_path": str(gate), "gate_wait_s": 5.0, "parent_pid": os.getppid()}
    protocol = Protocol(correct_trials=1, perf_trials=2, warmup=1, baseline="both")
    phase = child.Phase(None)
    result = child.run_reference(job, protocol, "cpu", tmp_path, phase)
    names = [name for name, _ in phase.marks]
    assert names.index("reference torch.compile build") < names.index("reference waiting at the gate")
    assert calls[0] == "reference torch.compile build"
    assert set(calls[1:]) == {"reference torch.compile timing"}
    assert "compile" in result and "compile_error" not in result

    def failing_compile(model: torch.nn.Module) -> object:
        raise RuntimeError("inductor is missing a compiler")

    monkeypatch.setattr(torch, "compile", failing_compile)
    phase = child.Phase(None)
    result = child.run_reference(job, protocol, "cpu", tmp_path, phase)
    assert result["compile_error"] == "RuntimeError: inductor is missing a compiler"
    assert "compile" not in result and "eager" in result  # the eager baseline is still timed


def test_challenge_calls_take_about_the_target_within_the_bounds_and_the_byte_caps():
    from kpipe.gym.child import (CHALLENGE_MAX_ANSWER_BYTES, CHALLENGE_MAX_CALLS, CHALLENGE_MAX_INPUT_BYTES, CHALLENGE_MIN_CALLS,
                                 CHALLENGE_TARGET_MS, challenge_calls)

    small = (1 << 10, 1 << 10)  # a call's input and output bytes
    assert challenge_calls(CHALLENGE_TARGET_MS / 5, 100, *small) == 5
    assert challenge_calls(0.01, 100, *small) == CHALLENGE_MAX_CALLS  # a fast kernel: as many as allowed
    assert challenge_calls(0.01, 3, *small) == 3  # never more than the protocol's timed trials
    assert challenge_calls(1000.0, 100, *small) == CHALLENGE_MIN_CALLS
    assert challenge_calls(None, 100, *small) == CHALLENGE_MAX_CALLS
    assert challenge_calls(0.01, 100, CHALLENGE_MAX_INPUT_BYTES // 10, 1 << 10) == 10  # 10 calls' inputs fill the device's cap
    assert challenge_calls(0.01, 100, 1 << 10, CHALLENGE_MAX_ANSWER_BYTES // 8) == 8  # 8 calls' outputs fill the answer's
    assert challenge_calls(0.01, 100, CHALLENGE_MAX_INPUT_BYTES, 1 << 10) == CHALLENGE_MIN_CALLS
    assert challenge_calls(0.01, 100, 0, 0) == CHALLENGE_MAX_CALLS  # a forward of no tensors


def test_call_outputs_gather_each_calls_own_values_and_digest_them_as_digest_does():
    from kpipe.gym.trial_data import CallOutputs, digest

    reused = torch.zeros(3, 4)  # a kernel that hands back the same buffer every call
    small = CallOutputs(reused, calls=3, max_elements=100, seed=5)
    expected = []
    for call in range(3):
        reused.fill_(call)
        small.put(call, reused)
        expected.append(digest([reused.clone()], max_elements=100, seed=5))
    gathered = small.digests()
    assert len(gathered) == 3 and all(set(got) == {"full"} and torch.equal(got["full"], want[0]["full"])
                                      for got, want in zip(gathered, expected))
    assert [float(d["full"].mean()) for d in gathered] == [0.0, 1.0, 2.0]

    huge = torch.arange(1000, dtype=torch.float32)
    sampled = CallOutputs(huge, calls=2, max_elements=50, seed=5)
    sampled.put(0, huge)
    sampled.put(1, huge * 2)
    want = [digest([huge], max_elements=50, seed=5)[0], digest([huge * 2], max_elements=50, seed=5)[0]]
    for got, wanted in zip(sampled.digests(), want):
        assert torch.equal(got["sample"], wanted["sample"]) and got["shape"] == wanted["shape"] and got["dtype"] == wanted["dtype"]
    with pytest.raises(ValueError, match="call 1 returned"):
        small.put(1, torch.zeros(4))  # copy_ would have broadcast it
    with pytest.raises(ValueError, match="call 1 returned"):
        small.put(1, torch.zeros(3, 4, dtype=torch.float64))


def test_the_challenges_calls_run_back_to_back_and_return_each_calls_outputs():
    from kpipe.gym.child import run_challenge_calls
    from kpipe.gym.timing import Clocks

    protocol = Protocol(device="cpu")
    buffer = torch.zeros(2, 2)

    def forward(x):  # returns a buffer it reuses, and a fresh tensor
        buffer.copy_(x * 2)
        return buffer, x + 1

    input_sets = [[torch.full((2, 2), float(call))] for call in range(4)]
    outputs, calls_ms = run_challenge_calls(forward, input_sets, Clocks("cpu"), None, protocol)
    assert calls_ms > 0 and len(outputs) == 4
    for call, (doubled, plus_one) in enumerate(outputs):
        assert torch.equal(doubled["full"], torch.full((2, 2), 2.0 * call)) and torch.equal(plus_one["full"], torch.full((2, 2), call + 1.0))

    def varying(x):
        return (x,) if float(x[0, 0]) == 0 else (x, x)

    with pytest.raises(ValueError, match="call 1 returned 2 outputs, the first call 1"):
        run_challenge_calls(varying, input_sets, Clocks("cpu"), None, protocol)


def test_a_candidates_files_are_capped_by_the_larger_of_the_references_result_and_challenge_answer():
    from kpipe.gym.evaluation import RESULT_SIZE_FACTOR, RESULT_SIZE_SLACK, candidate_max_bytes

    def reference(result_bytes: int, calls: int, elements: int) -> dict:
        outputs = [[{"full": torch.zeros(elements)}, {"sample": torch.zeros(8), "shape": [1 << 30], "dtype": "torch.float32"}]] * calls
        return {"result_bytes": result_bytes, "challenge": {"rounds": [{"outputs": outputs}, {"outputs": outputs[:1]}]}}

    # 64 calls of 1 MiB outputs: an answer larger than a result of a few trials' outputs
    assert candidate_max_bytes(reference(8 << 20, 64, 1 << 18)) == RESULT_SIZE_FACTOR * (64 * ((1 << 20) + 32)) + RESULT_SIZE_SLACK
    assert candidate_max_bytes(reference(100 << 20, 2, 16)) == RESULT_SIZE_FACTOR * (100 << 20) + RESULT_SIZE_SLACK
