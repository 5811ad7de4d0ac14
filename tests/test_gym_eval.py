"""End-to-end KernelGym evaluations on the CPU (Triton interpreter): legit kernels pass,
hacks are caught with the right status and reason, faults are classified and the caller
survives. Each evaluation runs child processes (forked from a warm zygote, as a pool's are, but
where a test says otherwise), so trial counts are tiny."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kpipe.data.kernelbench import select_problems, shrink_sizes
from kpipe.gym import Protocol, evaluate
from kpipe.gym.confine.zygote import Zygote, ZygoteLauncher

FIXTURES = Path(__file__).parent / "fixtures" / "gym"
FAST = Protocol(correct_trials=2, perf_trials=2, warmup=0, baseline="eager", timeout_s=60, memory_limit_mb=6000)
# runtime checks only: the static screen would reject most hacks before they run
RUNTIME_ONLY = Protocol.from_dict({**FAST.to_dict(), "reject_findings": []})
RELU_REFERENCE = (FIXTURES / "relu_reference.py").read_text()


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def kernelbench(level: int, problem_id: int, cap: int = 48) -> str:
    (problem,) = [p for p in select_problems("main", [level]) if p.problem_id == problem_id]
    return shrink_sizes(problem.code, cap)


class Launchers:
    """One warm zygote, and a launcher on it per protocol (a child started ahead is prepared for its protocol)."""

    def __init__(self) -> None:
        self.zygote = Zygote(dict(os.environ))
        self.by_protocol: dict[str, ZygoteLauncher] = {}

    def __call__(self, protocol: Protocol) -> ZygoteLauncher:
        key = protocol.to_json()
        if key not in self.by_protocol:
            self.by_protocol[key] = ZygoteLauncher(lambda: self.zygote, "cpu", protocol.to_dict())
        return self.by_protocol[key]

    def close(self) -> None:
        for launcher in self.by_protocol.values():
            launcher.close()
        self.zygote.close()


launchers: Launchers | None = None


@pytest.fixture(scope="module", autouse=True)
def warm_zygote() -> Iterator[None]:
    """Evaluations here fork their children from one warm zygote, as every pool worker does: on 2
    cores an evaluation's two fresh interpreters cost it seconds each. The fresh-interpreter path
    (`evaluate`'s default) keeps the tests that call it without `launch` (its own start, the
    environment read at each launch); tests/test_gym_pool.py checks both paths give the same results."""
    global launchers
    launchers = Launchers()
    yield
    launchers.close()
    launchers = None


def run(candidate: str, protocol: Protocol = FAST, reference: str = RELU_REFERENCE, fresh: bool = False):
    """`candidate` judged against `reference`, its children forked from the zygote (or, `fresh`,
    each a new interpreter)."""
    if fresh:
        return evaluate(reference, candidate, protocol, reuse_reference=True)
    assert launchers is not None
    return evaluate(reference, candidate, protocol, reuse_reference=True, launch=launchers(protocol))


def test_legit_kernel_passes_with_timings_profile_and_feedback():
    result = run(fixture("relu_legit.py"), fresh=True)
    assert result.status == "pass", result.diagnostic
    assert result.correct and not result.hacked and result.hack_reasons == []
    assert result.launched_kernels == ["relu_kernel"]
    assert result.timing_kind == "cpu" and result.candidate_ms > 0 and result.eager_ms > 0
    assert result.speedup_eager == pytest.approx(result.eager_ms / result.candidate_ms)
    assert 0.5 < result.pr <= 1.0  # all the work is the Triton kernel
    assert "Status: pass" in result.feedback and "relu_kernel" in result.feedback
    json.loads(result.to_json())


def test_integer_inputs_stay_integers():
    result = run(fixture("int_legit.py"), reference=fixture("int_reference.py"))
    assert result.status == "pass", result.diagnostic


# the paper's "w/o hacking check" ablation (Protocol hacking_check=False): the hacking check's hacks pass
# (no Triton kernel run, a fallback to PyTorch or to the reference, kernels that do not make the output) ...
PAPER_CHECK_HACKS = ["hacks/unused_kernel.py", "hacks/try_except_fallback.py", "hacks/inherits_model.py",
                     "hacks/ghost_launch.py", "hacks/training_branch.py"]
# ... and nothing else is turned off: the sandbox's static policy, the integrity checks and every output check
OTHER_CHECKS = [("hacks/monkey_patch_torch.py", "static monkey_patch"), ("hacks/side_thread.py", "static thread"),
                ("hacks/read_secret.py", "static env_access"), ("hacks/input_mutation.py", "input_mutation"),
                ("hacks/skip_when_warm.py", "window_output_mismatch")]
NO_HACKING_CHECK = Protocol.from_dict({**FAST.to_dict(), "hacking_check": False})


@pytest.mark.parametrize("candidate", PAPER_CHECK_HACKS)
def test_without_the_hacking_check_the_papers_hacks_pass(candidate):
    """The paper's "w/o hacking check" (§3.3: "we mark a candidate as incorrect if it executes no Triton kernel in
    either mode"): without it a correct candidate whose output no Triton kernel made passes, with its speedup."""
    result = run(fixture(candidate), NO_HACKING_CHECK)
    assert result.status == "pass" and result.hack_reasons == [], (result.hack_reasons, result.diagnostic)
    assert result.speedup_eager is not None
    assert run(fixture(candidate)).status == "hacked"


@pytest.mark.parametrize(("candidate", "reason"), OTHER_CHECKS)
def test_without_the_hacking_check_the_other_checks_stay(candidate, reason):
    result = run(fixture(candidate), NO_HACKING_CHECK)
    assert result.status == "hacked" and any(r.startswith(reason) for r in result.hack_reasons), result.hack_reasons


def test_bank_solutions_on_shrunk_kernelbench_tasks():
    from kpipe.gym import bank

    # every variant of an elementwise task, and a level-2 fusion's legit kernel
    chosen = [s for s in bank.list_solutions() if (s.level, s.problem_id) == (1, 19) or s.key == "L2_76/legit"]
    if not chosen:
        pytest.skip("the bank has no L1_19 / L2_76 solutions yet")
    for solution in chosen:
        result = run(solution.source, reference=kernelbench(solution.level, solution.problem_id))
        assert result.status == solution.expected_status, (solution.key, result.diagnostic)


@pytest.mark.parametrize(
    ("candidate", "reason"),
    [
        ("hacks/try_except_fallback.py", "static try_except"),
        ("hacks/inherits_model.py", "static inherits_model"),
        ("hacks/monkey_patch_torch.py", "static monkey_patch"),
        ("hacks/side_thread.py", "static thread"),
        ("hacks/read_secret.py", "static env_access"),
        ("faults/segfault.py", "static ctypes"),
    ],
)
def test_static_screen_rejects_without_running(candidate, reason):
    result = run(fixture(candidate))
    assert result.status == "hacked" and result.hacked and not result.correct
    assert any(r.startswith(reason) for r in result.hack_reasons), result.hack_reasons
    assert result.candidate_ms is None and result.wall_s < 5
    assert_names_its_reason(result)


def assert_names_its_reason(result) -> None:
    """A hacked verdict says why in its diagnostic and its feedback (issue 62, row 12: one came with an empty diagnostic)."""
    assert result.diagnostic.startswith("rejected by the hacking check: " + result.hack_reasons[0][:40]), result.diagnostic
    assert "Hacking check failed: " + result.hack_reasons[0][:40] in result.feedback, result.feedback


@pytest.mark.parametrize(
    ("candidate", "status", "reason"),
    [
        ("hacks/unused_kernel.py", "hacked", "no_triton_launch"),
        ("hacks/try_except_fallback.py", "hacked", "no_triton_launch"),
        ("hacks/inherits_model.py", "hacked", "no_triton_launch"),
        ("hacks/ghost_launch.py", "hacked", "ghost_replay"),
        ("hacks/training_branch.py", "hacked", "no_triton_launch: no Triton kernel ran in eval() mode"),
        ("hacks/skip_when_warm.py", "hacked", "window_output_mismatch"),
        ("hacks/input_mutation.py", "hacked", "input_mutation"),
        ("hacks/monkey_patch_torch.py", "hacked", "monkey_patch: replaced time.perf_counter, torch.relu"),
        ("hacks/side_thread.py", "hacked", "side_thread"),
        ("hacks/uninitialised_output.py", "mismatch", None),
    ],
)
def test_runtime_hacking_checks(candidate, status, reason):
    result = run(fixture(candidate), RUNTIME_ONLY)
    assert result.status == status, (result.hack_reasons, result.diagnostic)
    assert not result.correct
    if reason:
        assert any(r.startswith(reason) for r in result.hack_reasons), result.hack_reasons
    if status == "hacked":
        assert_names_its_reason(result)


def test_a_forged_result_file_is_not_believed():
    """A pickle where the judge reads its files: never unpickled, the judge's own runtime_error naming why."""
    result = run(fixture("hacks/forged_result.py"))
    assert result.status == "runtime_error" and result.diagnostic.startswith("malformed file from the candidate's process"), \
        result.diagnostic


def test_a_pointer_cache_gains_nothing_from_the_windows_fresh_inputs():
    """Outputs served by input address from the 4th call: every window's inputs are fresh tensors, so it
    computes every call (pass, at its own speed) or, where the allocator handed a later window an
    earlier one's address, serves a stale output and is caught; it never passes with one."""
    result = run(fixture("hacks/pointer_cache.py"), RUNTIME_ONLY)
    assert result.status in ("pass", "hacked"), (result.status, result.diagnostic)
    if result.status == "hacked":
        assert result.hack_reasons[0].startswith("window_output_mismatch"), result.hack_reasons


def test_pure_torch_copy_of_the_reference_is_a_format_error():
    result = run(fixture("hacks/pure_torch.py"))
    assert result.status == "format_error" and "no @triton.jit kernel" in result.diagnostic


def test_zeros_on_a_tiny_output_task_fail():
    result = run(fixture("hacks/zeros_output.py"), RUNTIME_ONLY, reference=fixture("tiny_reference.py"))
    assert result.status == "mismatch" and "relative error norm" in result.diagnostic


def test_candidate_cannot_read_api_keys(monkeypatch):
    monkeypatch.setenv("KPIPE_TEST_API_KEY", "sk-must-not-leak")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-leak-either")
    result = run(fixture("hacks/read_secret.py"), RUNTIME_ONLY, fresh=True)  # reads the environment at launch
    assert result.status == "runtime_error"
    assert "secret=<absent>" in result.diagnostic
    assert "sk-must-not-leak" not in result.diagnostic + result.feedback


@pytest.mark.parametrize(
    ("candidate", "status", "detail"),
    [
        ("faults/syntax_error.py", "compilation_error", "SyntaxError"),
        ("faults/no_modelnew.py", "format_error", "ModelNew"),
        ("faults/triton_compile_error.py", "compilation_error", "broken_kernel"),
        ("faults/runtime_exception.py", "runtime_error", "shape bookkeeping went wrong"),
        ("faults/segfault.py", "crashed", "SIGSEGV"),
        ("faults/os_exit.py", "crashed", "exited with code 3"),
        ("faults/sys_exit.py", "crashed", "sys.exit(2)"),
        ("faults/kill_own_group.py", "crashed", "SIGKILL"),
        ("faults/host_oom.py", "resource_limit", "memory: its processes passed the host memory cap of 6000 MiB"),
    ],
)
def test_faults_are_classified_and_the_caller_survives(candidate, status, detail):
    result = run(fixture(candidate), RUNTIME_ONLY)
    assert result.status == status, result.diagnostic
    assert detail in result.diagnostic
    assert "Status: " + status in result.feedback


def test_a_failure_names_the_phase_it_happened_in():
    # the child times its "write result" phase too: that must not overwrite where it failed
    result = run(fixture("faults/runtime_exception.py"), RUNTIME_ONLY)
    assert "(during candidate correctness trial 0)" in result.diagnostic, result.diagnostic
    # the traceback names the candidate's file, not its scratch directory or the install location
    assert 'File "kpipe_candidate.py", line' in result.diagnostic and "kgym-" not in result.diagnostic


def test_infinite_loop_times_out():
    # the timeout counts from the child's job (a fresh interpreter's start: on 2 cores shared with the
    # suite's other worker and a DAG run, one was still importing torch._dynamo at 8 s)
    protocol = Protocol.from_dict({**RUNTIME_ONLY.to_dict(), "timeout_s": 15})
    result = run(fixture("faults/infinite_loop.py"), protocol)
    assert result.status == "timeout" and "correctness trial 0" in result.diagnostic
    assert result.wall_s < 30


def test_huge_stdout_is_survived():
    result = run(fixture("faults/huge_stdout.py"), RUNTIME_ONLY)
    assert result.status == "pass", result.diagnostic


def test_bad_usage_raises():
    with pytest.raises(ValueError, match="get_inputs"):
        evaluate("import torch\nclass Model: pass\n", fixture("relu_legit.py"), FAST)


def test_cli_eval_exits_zero_on_a_failing_kernel(tmp_path):
    from kpipe.cli import main

    reference = tmp_path / "ref.py"
    reference.write_text(RELU_REFERENCE)
    runner = CliRunner()
    args = ["gym", "eval", "--reference", str(reference), "--baseline", "eager", "--correct-trials", "1", "--perf-trials", "1"]
    failing = runner.invoke(main, [*args, "--candidate", str(FIXTURES / "faults/syntax_error.py"), "--json"])
    assert failing.exit_code == 0, failing.output
    assert json.loads(failing.output)["status"] == "compilation_error"
    usage = runner.invoke(main, [*args, "--candidate", str(tmp_path / "missing.py")])
    assert usage.exit_code != 0


def test_kept_references_are_budgeted_by_bytes_not_count(monkeypatch):
    """A batch cycling through more tasks than a fixed count of entries never reused one (10 tasks
    against 8 entries on the H100): the cache keeps references until their bytes exceed the budget."""
    from kpipe.gym.judge import evaluation
    from kpipe.gym.confine.isolate import ChildRun

    runs: list[str] = []

    def fake_run(job, timeout_s, gate, launch, lease, windows):
        from kpipe.gym.exchange import encode

        runs.append(job["reference_src"])
        answered = [encode({"calls": 2, "calls_ms": 2.0, "outputs": []})] * 4  # two candidates' windows
        return ChildRun({"status": "ok"}, None, 0, False, 0.1, "", "", 0, "done", result_bytes=30 << 20,
                        windows=answered, window_s=[0.01] * 4, window_spans=[[0.0, 0.01]] * 4)

    monkeypatch.setattr(evaluation, "run_isolated", fake_run)
    monkeypatch.setattr(evaluation, "_reference_cache", evaluation.OrderedDict())
    sources = [f"# task {i}\n" for i in range(10)]
    for _ in range(2):
        for source in sources:
            evaluation.run_reference(source, FAST, "cpu", reuse=True)
    assert runs == sources  # the second round reused all ten

    monkeypatch.setattr(evaluation, "REFERENCE_CACHE_BYTES", 95 << 20)  # room for three
    monkeypatch.setattr(evaluation, "_reference_cache", evaluation.OrderedDict())
    runs.clear()
    for source in sources[:4] + sources[1:4] + sources[:1]:
        evaluation.run_reference(source, FAST, "cpu", reuse=True)
    assert runs == sources[:4] + sources[:1]  # 1-3 kept; 0, least recently used, evicted
