"""KernelGym pieces that need no child process: protocol, result schema, screen, comparison,
fault classification, feedback, launch instrumentation."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kpipe.data.schemas import EVALS
from kpipe.gym.judge.compare import Tolerance, compare_norms, compare_outputs, compare_tensor
from kpipe.gym.candidate.faults import classify_exception, classify_exit
from kpipe.gym.judge.feedback import build_feedback
from kpipe.gym.protocol import Protocol
from kpipe.gym.judge.result import EvalResult
from kpipe.gym.judge.screen import screen

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
    with pytest.raises(ValueError, match="window_sketch"):
        Protocol(window_sketch="triton")
    assert Protocol.from_json(Protocol(window_sketch="kernel").to_json()).window_sketch == "kernel"


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
    from kpipe.gym.protocol import FINDING_CODES

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
                        candidate_ms=1.0, eager_ms=2.0, speedup_eager=2.0,
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

    from kpipe.gym.candidate import instrument

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


def test_huge_outputs_are_compared_on_a_sample_including_the_tail():
    from kpipe.gym.candidate.trial_data import digest
    from kpipe.gym.judge.compare import compare_output

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
    from kpipe.gym.candidate.child import wait_for_gate

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


def test_the_torch_compile_baseline_is_compiled_before_the_gate_and_timed_on_every_windows_inputs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's compile (seconds) must not run while the reference child holds its GPU's timing
    lease, which stops every other child on that GPU: the compiled baseline's first call comes
    before the gate. After each window's answer (outside the judge's clock) it runs on the same
    inputs, on the same clock and region as the eager calls, a time per window."""
    from kpipe.gym.candidate import child
    from kpipe.gym.exchange import decode
    from kpipe.gym.exchange import WINDOW_ANSWER_FILE, WINDOW_FILE, WINDOW_READY_FILE

    calls: list[str] = []  # the phase each call of the compiled baseline ran in

    def fake_compile(model: torch.nn.Module) -> object:
        def compiled(*args: object) -> object:
            calls.append(phase.marks[-1][0])
            return model(*args)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    gate = tmp_path / "gate"
    gate.write_text("go")
    for index, seed in enumerate((11, 12)):  # the judge's seeds, revealed up front here
        (tmp_path / WINDOW_FILE.format(round=index)).write_text(f'{{"seed": {seed}}}')
    job = {"role": "reference", "reference_src": REFERENCE_SOURCE, "gate_path": str(gate), "gate_wait_s": 5.0,
           "parent_pid": os.getppid(), "window_rounds": 2}
    protocol = Protocol(correct_trials=1, perf_trials=3, warmup=1, baseline="both")
    phase = child.Phase(None)
    result = child.run_reference(job, protocol, "cpu", tmp_path, phase)
    names = [name for name, _ in phase.marks]
    assert names.index("reference torch.compile build") < names.index("reference waiting at the gate")
    assert calls[0] == "reference torch.compile build"
    assert len(result["compile_windows_ms"]) == 2 and "compile_error" not in result
    assert "reference timing windows: the torch.compile baseline" in set(calls)
    for index in range(2):
        assert (tmp_path / WINDOW_READY_FILE.format(round=index)).exists()
        answer = decode((tmp_path / WINDOW_ANSWER_FILE.format(round=index)).read_bytes())
        assert answer["calls"] == 3 and len(answer["outputs"]) == 3 and answer["calls_ms"] > 0

    def failing_compile(model: torch.nn.Module) -> object:
        raise RuntimeError("inductor is missing a compiler")

    monkeypatch.setattr(torch, "compile", failing_compile)
    for leftover in tmp_path.iterdir():
        if leftover.name.startswith("window-") and leftover.name.endswith(".safetensors") or leftover.name.startswith("window-ready"):
            leftover.unlink()
    result = child.run_reference(job, protocol, "cpu", tmp_path, child.Phase(None))
    assert result["compile_error"] == "RuntimeError: inductor is missing a compiler"
    assert result["compile_windows_ms"] == []  # the eager windows are still answered


def test_window_calls_take_about_the_target_within_the_protocol(monkeypatch: pytest.MonkeyPatch):
    from kpipe.gym.candidate import child
    from kpipe.gym.candidate.timing import Clocks

    def timed_at(call_ms: float) -> None:
        monkeypatch.setattr(child, "run_window_calls", lambda forward, draw, calls, *args, **kwargs: ([], call_ms * calls))

    def inputs() -> list[torch.Tensor]:  # a task's get_inputs
        return [torch.zeros(256)]

    protocol = Protocol(perf_trials=5000)
    timed_at(child.WINDOW_TARGET_MS["cpu"] / 5)
    assert child.window_calls(None, inputs, "cpu", Clocks("cpu"), None, protocol) == 5
    timed_at(0.001)
    assert child.window_calls(None, inputs, "cpu", Clocks("cpu"), None, protocol) == child.WINDOW_MAX_CALLS
    assert child.window_calls(None, inputs, "cpu", Clocks("cpu"), None, Protocol(perf_trials=7)) == 7  # the interpreter's cap
    def huge() -> list[torch.Tensor]:  # 10 calls' inputs fill the draw's bound
        return [torch.empty(0).new_empty((child.WINDOW_MAX_INPUT_BYTES // 4 // 10,))]

    timed_at(child.WINDOW_TARGET_MS["cpu"] / 40)
    assert child.window_calls(None, huge, "cpu", Clocks("cpu"), None, protocol) == 40  # the inputs no longer cap the calls
    timed_at(1e6)
    assert child.window_calls(None, inputs, "cpu", Clocks("cpu"), None, protocol) == child.WINDOW_MIN_CALLS

    def slow_around_fast_calls(forward, draw, calls, *args, **kwargs):  # 1 us calls in 2 ms of window each
        time.sleep(0.002 * calls)
        return [], 0.001 * calls

    monkeypatch.setattr(child, "run_window_calls", slow_around_fast_calls)
    assert child.window_calls(None, inputs, "cpu", Clocks("cpu"), None, protocol) <= child.WINDOW_TARGET_MS["cpu"] / 2


def test_a_windows_inputs_are_drawn_in_chunks_within_the_byte_bound_and_every_call_gets_its_own(monkeypatch: pytest.MonkeyPatch):
    """kgym-15 drew a window's input sets at once under the byte bound, so a task of 268 MB inputs got 4 calls
    a window and the window's fixed cost swamped them (L1_40 read 1000x on an H200, KernelBench 36x)."""
    from kpipe.gym.candidate import child
    from kpipe.gym.candidate.timing import Clocks

    monkeypatch.setattr(child, "WINDOW_MAX_INPUT_BYTES", 3 * 4 * 8)  # three sets of 8 floats
    drawn: list[int] = []
    drawn_at_call: list[int] = []

    def draw(call: int) -> list[torch.Tensor]:
        drawn.append(call)
        return [torch.full((8,), float(call))]

    def forward(x: torch.Tensor) -> torch.Tensor:
        drawn_at_call.append(len(drawn))
        return x * 2

    outputs, _ = child.run_window_calls(forward, draw, 7, Clocks("cpu"), None, seed=1)
    assert drawn == list(range(7))  # one fresh set a call, in order
    assert [float(call[0]["full"][0]) for call in outputs] == [2.0 * call for call in range(7)]
    assert drawn_at_call == [3, 3, 3, 6, 6, 6, 7]  # three sets at a time, just before their calls
    assert child.draw_chunk(draw, 5, 7) and drawn[-2:] == [5, 6]  # never past the window's last call


def test_window_outputs_gather_each_calls_own_values_whole_or_at_secret_positions_with_a_sketch():
    from kpipe.gym.candidate.trial_data import WINDOW_FULL_ELEMENTS, WindowOutputs

    reused = torch.zeros(3, 4)  # a kernel that hands back the same buffer every call
    small = WindowOutputs(reused, calls=3, seed=5)
    for call in range(3):
        reused.fill_(call)
        small.put(call, reused)
    assert [float(d["full"].mean()) for d in small.digests(False)] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="call 1 returned"):
        small.put(1, torch.zeros(4))  # copy_ would have broadcast it
    with pytest.raises(ValueError, match="call 1 returned"):
        small.put(1, torch.zeros(3, 4, dtype=torch.float64))

    huge = torch.randn(64, WINDOW_FULL_ELEMENTS)
    one, other = WindowOutputs(huge, 1, seed=5, tolerance=(1e-2, 1e-2)), WindowOutputs(huge, 1, seed=6, tolerance=(1e-2, 1e-2))
    one.put(0, huge)
    other.put(0, huge)
    (first,), (second,) = one.digests(True), other.digests(False)  # both compute the bound, the reference reports it
    assert first["sample"].numel() == WINDOW_FULL_ELEMENTS and first["shape"] == [64, WINDOW_FULL_ELEMENTS]
    assert not torch.equal(first["sample"], second["sample"])  # the positions follow the secret seed
    assert first["sketch"] != second["sketch"] and first["sketch_variance"] > 0 and "sketch_variance" not in second


@pytest.mark.parametrize("form", ["torch", "kernel"])
@pytest.mark.parametrize("numel", [5_000, (1 << 20) * 3 + 12_345])
def test_the_sketch_is_its_formula_elementwise_in_float64(numel, form):
    """S_p = sum_i s_p(i mod period) x_i |x_i| and V = sum_i ((2|x_i| + t_i) t_i)^2, t_i = atol + rtol |x_i|, as written
    in the docstring, against the power-sum form the CPU computes and the Triton kernel a GPU runs (here under the
    interpreter), a tail shorter than the period included; NaN counts as 0 and infinities as +-3e38 (a reference with
    them has no finite bound)."""
    from kpipe.gym.candidate.sketch_kernel import sketch_by_kernel
    from kpipe.gym.candidate.trial_data import SKETCH_PERIOD, sketch_by_torch, sketch_signs

    sketch = {"torch": sketch_by_torch, "kernel": sketch_by_kernel}[form]
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3 + 0.5
    signs = sketch_signs(min(numel, SKETCH_PERIOD), 11, "cpu")
    got = sketch(x, signs, 1e-2, 2e-2)
    xd = x.double()
    pattern = signs.double()[:, torch.arange(numel) % signs.shape[1]]
    expected_s = pattern @ (xd * xd.abs())
    t = 1e-2 + 2e-2 * xd.abs()
    expected_v = (((2 * xd.abs() + t) * t) ** 2).sum()
    assert torch.allclose(got[:-1].double(), expected_s, rtol=1e-5, atol=1e-3 * float(expected_v.sqrt()))
    assert float(got[-1]) == pytest.approx(float(expected_v), rel=3e-3)  # a CPU BLAS dot sums in float32
    assert float(sketch(x, signs)[-1]) == 0.0  # no tolerance, no bound asked
    x[7], x[8] = float("nan"), float("inf")
    with_nonfinite = sketch(x, signs, 1e-2, 2e-2)
    assert not torch.isfinite(with_nonfinite[-1]) and not torch.isfinite(with_nonfinite[:-1]).all()


def test_the_sketch_kernel_reads_half_precision_and_strided_outputs_as_the_torch_form_reads_them():
    """The kernel reads an output as float32, as the torch form does, whatever its layout; its launches and its
    compiled files carry the name that the windows' launch report and the candidates' seeded compile caches know."""
    from kpipe.gym.candidate.sketch_kernel import KERNEL_NAME, kgym_output_sketch, sketch_by_kernel
    from kpipe.gym.candidate.trial_data import sketch_by_torch, sketch_signs
    from kpipe.gym.confine.compile_caches import JUDGE_KERNEL_NAMES

    assert kgym_output_sketch.fn.__name__ == KERNEL_NAME and KERNEL_NAME in JUDGE_KERNEL_NAMES
    signs = sketch_signs(5_000, 3, "cpu")
    wide = torch.randn(5_000, 2, generator=torch.Generator().manual_seed(3))
    for output in (wide[:, 0], wide[:, 1].to(torch.bfloat16)):  # strided, and half precision
        got, expected = sketch_by_kernel(output, signs, 1e-2, 1e-2), sketch_by_torch(output.contiguous(), signs, 1e-2, 1e-2)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-3)
    rows = torch.zeros(2, signs.shape[0] + 1)  # a window's rows, written in place
    assert sketch_by_kernel(wide[:, 0], signs, 1e-2, 1e-2, out=rows[1]).data_ptr() == rows[1].data_ptr()
    assert torch.equal(rows[1], sketch_by_kernel(wide[:, 0], signs, 1e-2, 1e-2)) and not rows[0].any()


def test_a_forger_of_the_sampled_positions_fails_every_call_under_the_sign_patterns():
    """Zeros beyond the 4,096 sampled positions of a 2^20-element output: under one sign pattern its sketch
    fell within the bound on 17-22 % of calls; each of the 16 patterns must hold, so none of 40 calls passes,
    while the honest output within tolerance passes every one."""
    from kpipe.gym.candidate.trial_data import SKETCH_PATTERNS, WINDOW_FULL_ELEMENTS, WindowOutputs

    assert SKETCH_PATTERNS == 16
    single_pattern_misses = 0
    for seed in range(40):
        reference = torch.relu(torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed)))
        honest = reference + 1e-3 * torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed + 100))

        def window(output: torch.Tensor, reference_side: bool = False) -> dict:
            gathered = WindowOutputs(output, 1, seed=seed, tolerance=(1e-2, 1e-2))
            gathered.put(0, output)
            return gathered.digests(reference_side)[0]

        expected = window(reference, reference_side=True)
        forged = torch.zeros_like(reference)
        positions = WindowOutputs(reference, 1, seed=seed).positions
        forged[positions] = reference[positions]
        assert positions.numel() == WINDOW_FULL_ELEMENTS
        assert compare_norms([window(honest)], [expected], 0.05).ok
        forgery = window(forged)
        assert not compare_norms([forgery], [expected], 0.05).ok
        first_only = ({**forgery, "sketch": forgery["sketch"][:1]}, {**expected, "sketch": expected["sketch"][:1]})
        single_pattern_misses += compare_norms([first_only[0]], [first_only[1]], 0.05).ok
    assert 1 <= single_pattern_misses <= 20  # one pattern alone misses some: the reason for sixteen


def test_a_windows_check_covers_every_element_of_a_huge_output():
    """Positions a candidate can predict let it compute only those: the sketch (a nonlinear
    function of every element under secret signs) fails it, while an output within tolerance passes."""
    from kpipe.gym.candidate.trial_data import WindowOutputs

    reference = torch.randn(256, 4096)

    def window(output: torch.Tensor, reference_side: bool = False) -> dict:
        gathered = WindowOutputs(output, 1, seed=99, tolerance=(1e-2, 1e-2))
        gathered.put(0, output)
        return gathered.digests(reference_side)[0]

    expected = window(reference, reference_side=True)
    assert compare_norms([window(reference + 1e-3 * torch.randn_like(reference))], [expected], 0.05).ok
    positions_only = torch.zeros_like(reference).reshape(-1)
    flat = reference.reshape(-1)
    positions = WindowOutputs(reference, 1, seed=99).positions
    positions_only[positions] = flat[positions]  # exactly the sampled positions computed
    verdict = compare_norms([window(positions_only.reshape(reference.shape))], [expected], 0.05)
    assert not verdict.ok and "sketch" in verdict.detail
    without = {key: value for key, value in window(reference).items() if key != "sketch"}
    assert "no sketch" in compare_norms([without], [expected], 0.05).detail


def test_window_time_is_the_window_less_the_references_fixed_cost_on_the_judges_clock():
    from kpipe.gym.judge.evaluation import candidate_window_ms

    window = {"calls": 10, "calls_ms": 50.0, "wall_s": 0.070}  # 5 ms calls, 20 ms of fixed cost
    assert candidate_window_ms([window], [0.070, 0.045, 0.120]) == pytest.approx([5.0, 2.5, 10.0])
    # calls of microseconds in a window of milliseconds: the ratio of the windows, never the noise of the difference
    short = {"calls": 5, "calls_ms": 0.1, "wall_s": 0.005}
    assert candidate_window_ms([short], [0.004, 0.065]) == pytest.approx([0.02 * 0.8, 0.02 * 13])


def test_a_stalled_reference_window_does_not_shorten_the_candidates_time():
    """A host that stalls the reference's second window for 48 ms: its fixed cost is read from the least
    of its windows, so a candidate 4x slower than the reference stays 4x slower (against the stalled
    window of the same seed, as kgym-14 read it, it came out below zero: the floor, 1000x)."""
    from kpipe.gym.judge.evaluation import candidate_window_ms

    quiet = {"calls": 4, "calls_ms": 8.0, "wall_s": 0.010}
    stalled = {"calls": 4, "calls_ms": 8.0, "wall_s": 0.058}
    assert candidate_window_ms([quiet, stalled], [0.034, 0.034]) == pytest.approx([8.0, 8.0])
    short_quiet = {"calls": 4, "calls_ms": 0.4, "wall_s": 0.004}
    short_stalled = {"calls": 4, "calls_ms": 0.4, "wall_s": 0.052}
    assert candidate_window_ms([short_quiet, short_stalled], [0.016]) == pytest.approx([0.4])


def test_a_candidate_window_the_fixed_cost_cannot_resolve_is_read_from_the_windows_ratio():
    """Two test suites on a 2-core host: the reference's run paid 30 ms of fixed cost a window under load, the
    candidate's window ran in a quiet moment and took 28 ms. The difference was below zero, read as the floor
    (1000x, a pass at the cap for an honest-speed kernel); within 5 % of the fixed cost it is no better resolved.
    The windows' ratio reads them instead: no faster than the reference's window against the candidate's."""
    from kpipe.gym.judge.evaluation import WINDOW_RESOLVED_FRACTION, candidate_window_ms, resolved_fixed_ms

    loaded = [{"calls": 10, "calls_ms": 10.0, "wall_s": 0.040}, {"calls": 10, "calls_ms": 10.0, "wall_s": 0.041}]
    assert resolved_fixed_ms(loaded, [0.028, 0.029]) is None
    assert candidate_window_ms(loaded, [0.028]) == pytest.approx([1.0 * 28 / 40])  # 1.43x, not 1000x
    edge = (30.0 + WINDOW_RESOLVED_FRACTION * 30.0) / 1e3
    assert resolved_fixed_ms(loaded, [edge - 1e-6]) is None and resolved_fixed_ms(loaded, [edge + 1e-6]) == pytest.approx(30.0)
    assert candidate_window_ms(loaded, [0.035]) == pytest.approx([5.0 / 10])  # resolved: the difference


def test_the_first_candidate_of_a_fresh_reference_run_is_read_against_the_runs_least_fixed_cost():
    """On an H100 a fresh reference run's first windows cost 16.9 ms beyond their calls and its later
    ones 12 ms: the first candidate, handed the first two, read 3x too fast against their least alone."""
    from kpipe.gym.judge.evaluation import candidate_window_ms

    first_two = [{"calls": 37, "calls_ms": 101.0, "wall_s": 0.1179, "run_fixed_ms": 12.0},
                 {"calls": 37, "calls_ms": 101.0, "wall_s": 0.1175, "run_fixed_ms": 12.0}]
    assert candidate_window_ms(first_two, [0.0184]) == pytest.approx([(18.4 - 12.0) / 37])
    without = [{key: value for key, value in window.items() if key != "run_fixed_ms"} for window in first_two]
    assert candidate_window_ms(without, [0.0184]) == pytest.approx([(18.4 - 16.5) / 37])


def _window(seed: int, calls: int, call_ms: float, wall_s: float, outputs: list | None = None) -> dict:
    """A reference run's window as the judge keeps it: its seed, its calls' time on the reference's
    own clock, the judge's clock around it, and its outputs."""
    return {"seed": seed, "calls": calls, "calls_ms": call_ms * calls, "wall_s": wall_s, "compile_calls_ms": call_ms * calls / 2,
            "outputs": outputs or [[{"full": torch.full((4,), float(call))}] for call in range(calls)], "bytes": 100, "span": [0.0, wall_s]}


def _answers(calls: int, values: list[float] | None = None) -> bytes:
    from kpipe.gym.exchange import encode

    return encode({"outputs": [[{"full": torch.full((4,), float(value))}] for value in (values or range(calls))]})


def test_the_judge_reads_speed_only_from_its_windows_takes_the_least_and_checks_every_call():
    from types import SimpleNamespace

    from kpipe.gym.judge.evaluation import judge_windows

    protocol = Protocol(baseline="both")
    reference = {"windows": [_window(1, 4, 2.0, 0.010), _window(2, 4, 2.5, 0.012)]}
    run = SimpleNamespace(windows=[_answers(4), _answers(4)], window_s=[0.006, 0.009])
    status, why, figures = judge_windows(run, reference, protocol)
    assert status == "" and why == ""
    assert figures["window_candidate_ms"] == pytest.approx([1.0, 1.75])
    assert figures["candidate_ms"] == pytest.approx(1.0) and figures["eager_ms"] == pytest.approx(2.0)
    assert figures["compile_ms"] == pytest.approx(1.0) and figures["window_fixed_ms"] == pytest.approx([2.0, 2.0])
    wrong = SimpleNamespace(windows=[_answers(4), _answers(4, [0, 1, 2, 7])], window_s=[0.006, 0.009])
    status, why, _ = judge_windows(wrong, reference, protocol)
    assert status == "hacked" and why.startswith("window_output_mismatch: call 3 of timing window 1")
    assert judge_windows(SimpleNamespace(windows=None, window_s=None), reference, protocol)[0] == "hacked"
    short = SimpleNamespace(windows=[_answers(4), _answers(3)], window_s=[0.006, 0.009])
    status, why, _ = judge_windows(short, reference, protocol)
    assert status == "runtime_error" and "expected a list of 4 items" in why
    instant = SimpleNamespace(windows=[_answers(4), _answers(4)], window_s=[0.0, 0.0])  # no time at all: the floor
    _, _, figures = judge_windows(instant, reference, protocol)
    assert figures["candidate_ms"] == pytest.approx(2.0 / 1000.0) and "1000x the eager baseline" in figures["note"]
    quick = SimpleNamespace(windows=[_answers(4), _answers(4)], window_s=[0.0019, 0.0019])  # under the fixed cost
    _, _, figures = judge_windows(quick, reference, protocol)
    assert figures["candidate_ms"] == pytest.approx(2.25 * 1.9 / 10.0) and figures["note"] == ""  # the windows' ratio


def test_a_reference_run_serves_each_window_to_one_candidate_and_runs_again_when_they_are_spent(monkeypatch: pytest.MonkeyPatch):
    """With reuse a reference run answers a stock of windows, each with its own secret seed; every
    candidate gets windows no other candidate got, and the run repeats once the stock is spent."""
    from types import SimpleNamespace

    from kpipe.gym.judge import evaluation
    from kpipe.gym.exchange import encode

    runs: list[tuple[int, ...]] = []

    def run_isolated(job, timeout_s, gate, launch, lease, windows):  # type: ignore[no-untyped-def]
        runs.append(windows.seeds)
        answered = [encode({"calls": 2, "calls_ms": 1.0, "outputs": [[torch.ones(2)]] * 2}) for _ in range(6)]
        assert not windows.enough(2, 10) and windows.enough(6, evaluation.STOCK_MAX_BYTES)
        return SimpleNamespace(payload={"status": "ok", "compile_windows_ms": [0.5] * 6}, windows=answered, window_s=[0.01] * 6,
                               window_spans=[[0.0, 0.01]] * 6, result_bytes=10, wall_s=1.0, lease_wait_s=0.0, setup_s=0.0,
                               child_s=1.0, cleanup_s=0.0, phase="", timed_out=False)

    monkeypatch.setattr(evaluation, "run_isolated", run_isolated)
    monkeypatch.setattr(evaluation, "_reference_cache", type(evaluation._reference_cache)())
    seen = []
    for _ in range(4):
        payload, _ = evaluation.run_reference("src", Protocol(), "cpu", True)
        seen += [window["seed"] for window in payload["windows"]]
    assert len(runs) == 2 and len(runs[0]) == evaluation.STOCK_MAX_WINDOWS  # 6 answered: 3 candidates, then a new run
    assert len(set(seen)) == len(seen) == 8 and set(seen[:6]) <= set(runs[0]) and set(seen[6:]) <= set(runs[1])
    assert all(seed.bit_length() <= 40 for seed in seen)
    payload, ran = evaluation.run_reference("src", Protocol(), "cpu", False)
    assert ran and len(runs[-1]) == evaluation.WINDOWS_PER_CANDIDATE  # no reuse: no stock


def test_exchange_files_round_trip_and_malformed_ones_are_refused_with_a_reason():
    import pickle

    from kpipe.gym.exchange import MAX_DEPTH, ListOf, MalformedFile, OneOf, Record, TENSOR, check, decode, encode, parsed

    payload = {"outputs": [[torch.arange(6).reshape(2, 3)], [torch.ones(2, dtype=torch.float16)]], "ok": True, "n": 3, "x": 0.5,
               "none": None, "names": ["a"]}
    back = decode(encode(payload))
    assert torch.equal(back["outputs"][0][0], payload["outputs"][0][0]) and back["outputs"][1][0].dtype == torch.float16
    assert {k: back[k] for k in ("ok", "n", "x", "none", "names")} == {"ok": True, "n": 3, "x": 0.5, "none": None, "names": ["a"]}
    schema = Record({"outputs": ListOf(ListOf(TENSOR)), "ok": bool, "n": int, "x": float, "none": OneOf((float, type(None))),
                     "names": ListOf(str)})
    check(back, schema)
    for bad, why in [({**back, "n": True}, "expected int"), ({**back, "extra": 1}, "unexpected keys"),
                     ({k: v for k, v in back.items() if k != "ok"}, "missing"), ({**back, "names": [["a"]]}, "names[0]"),
                     ({**back, "x": "fast"}, "expected float")]:
        with pytest.raises(MalformedFile, match=re.escape(why)):
            check(bad, schema)
    with pytest.raises(MalformedFile, match="exactly|expected a list of 3"):
        check([1, 2], ListOf(int, exactly=3))
    with pytest.raises(MalformedFile, match="safetensors|header|unreadable"):
        decode(pickle.dumps({"status": "pass"}))  # no pickle is ever read
    import safetensors.torch

    hand_made = safetensors.torch.save({}, metadata={"document": "[" * 3000 + "]" * 3000})  # a candidate's own file
    with pytest.raises(MalformedFile, match="deep"):
        decode(hand_made)
    with pytest.raises(MalformedFile, match="deeper"):
        decode(encode({"data": [[[[[[[[[[[[[[0]]]]]]]]]]]]]]}))  # past MAX_DEPTH
    assert MAX_DEPTH >= 8
    with pytest.raises(MalformedFile, match="unhashable|expected str|none of its forms"):
        parsed(encode({"status": ["pass"]}), Record({"status": str}))
