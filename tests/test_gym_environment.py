"""What an evaluation child sees of its environment, and what it can leave for others.

- A child's environment is what its launcher's holds of an allowlist, on every path (warm pool
  fork, fresh interpreter): PATH, HOME, LD_LIBRARY_PATH, CUDA_VISIBLE_DEVICES and TRITON_* /
  TORCHINDUCTOR_* settings present; a secret-looking variable, the run's services (KernelGym's,
  the warm starter's) and any other setting of the caller absent; its home and TMPDIR its
  scratch. Checked from inside a real child: the candidate reports ``os.environ`` in its exception. (Before the fix, a forked pool
  child ran with an empty environment: no PATH, so gcc and Inductor's C++ compiler failed.)
- No evaluation can change another's result through the compile caches: a candidate that
  plants junk and slowed-down "compiled" code in every cache directory it can find leaves a
  later legit evaluation's status and the ``torch.compile`` baseline's time unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kpipe.data.kernelbench import select_problems, shrink_sizes
from kpipe.gym import Protocol
from kpipe.gym.bank import solutions_for
from kpipe.gym.confine.compile_caches import CompileCaches, foreign_entries, snapshot
from kpipe.gym.confine.environment import child_environment
from kpipe.gym.judge.evaluation import evaluate
from kpipe.gym.serve.pool import GymPool
from kpipe.gym.confine.sandbox import OPT_OUT_VARIABLE

REFERENCE = shrink_sizes(select_problems("main", [1], {1: [19]})[0].code, 48)
LEGIT = next(s.source for s in solutions_for(1, 19) if s.variant == "legit")
OTHER_REFERENCE = shrink_sizes(select_problems("main", [1], {1: [23]})[0].code, 48)
OTHER_LEGIT = next(s.source for s in solutions_for(1, 23) if s.variant == "legit")
# the environment dump below is a static finding; it must run to be observed
PROTOCOL = Protocol(correct_trials=1, perf_trials=2, warmup=1, baseline="eager", device="cpu", timeout_s=120, reject_findings=())

# a confined candidate can write nowhere but its scratch: it reports what it sees in its exception
ENV_DUMP = '''
import json as _json, os as _os
raise RuntimeError("ENV " + _json.dumps({{k: v for k, v in _os.environ.items() if k in {names!r}}}) + " END")
'''
RUN_SERVICES = {"KPIPE_GYM_RUN": "/tmp/kpipe-test-run", "KPIPE_WARM_START": "kpipe-warm-start-test",
                "KPIPE_WARM_START_TOKEN": "do-not-leak", "KPIPE_GYM_TOKEN": "the-run-service-token", "SLURM_JOB_ID": "42"}
REPORTED = ("PATH", "HOME", "TMPDIR", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "KPIPE_TEST_CALLER_SETTING", "TRITON_PRINT_AUTOTUNING",
            "TORCHINDUCTOR_MAX_AUTOTUNE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MY_SERVICE_API_KEY", "HF_TOKEN",
            *RUN_SERVICES)

CALLER_SETTINGS = {
    "KPIPE_TEST_CALLER_SETTING": "from-the-caller",
    "LD_LIBRARY_PATH": "/opt/kpipe-test/lib",
    "TRITON_PRINT_AUTOTUNING": "1",
    "TORCHINDUCTOR_MAX_AUTOTUNE": "0",
    "TRITON_CACHE_DIR": "/tmp/kpipe-test-shared-triton-cache",  # replaced: caches are per child
    "MY_SERVICE_API_KEY": "do-not-leak",
    "HF_TOKEN": "do-not-leak",
    **RUN_SERVICES,
}


def child_env(run: object) -> dict[str, str]:
    result = run(ENV_DUMP.format(names=REPORTED) + LEGIT)
    assert result.status == "runtime_error" and "ENV " in result.diagnostic, result.diagnostic
    return json.loads(result.diagnostic.split("ENV ", 1)[1].split(" END", 1)[0])


def check_child_env(env: dict[str, str]) -> None:
    for name in ("PATH", "HOME", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "TRITON_PRINT_AUTOTUNING", "TORCHINDUCTOR_MAX_AUTOTUNE"):
        assert name in env, f"{name} missing from the child's environment"
    assert env["LD_LIBRARY_PATH"] == "/opt/kpipe-test/lib"
    for name in ("MY_SERVICE_API_KEY", "HF_TOKEN", "KPIPE_TEST_CALLER_SETTING", *RUN_SERVICES):
        assert name not in env, f"{name} reached the child"
    # the candidate compiles into a private directory, never the caller's shared cache
    assert env["TRITON_CACHE_DIR"] != CALLER_SETTINGS["TRITON_CACHE_DIR"]
    assert "kgym-candidate-" in env["TRITON_CACHE_DIR"] and "kgym-candidate-" in env["TORCHINDUCTOR_CACHE_DIR"]
    # its home and temporary directory are its scratch, the one place it may write
    assert "kgym-candidate-" in env["HOME"] and env["TMPDIR"] == env["HOME"] + "/tmp"


@pytest.fixture
def caller_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in CALLER_SETTINGS.items():
        monkeypatch.setenv(name, value)


def test_a_forked_pool_child_keeps_its_workers_environment_minus_secrets(caller_env: None) -> None:
    with GymPool(PROTOCOL, workers=1, progress=False) as pool:
        env = child_env(lambda candidate: pool.evaluate(REFERENCE, candidate))
    check_child_env(env)
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # the CPU worker's pin, not the caller's GPUs


def test_a_fresh_interpreter_child_keeps_the_environment_minus_secrets(caller_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # a lease's pin (the CPU protocol never uses it)
    env = child_env(lambda candidate: evaluate(REFERENCE, candidate, PROTOCOL))
    check_child_env(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "7"


def test_child_environment_replaces_inherited_cache_locations_and_kernel_overrides() -> None:
    parent = {"PATH": "/bin", "TRITON_CACHE_DIR": "/shared", "TRITON_KERNEL_OVERRIDE": "1", "OPENAI_API_KEY": "x"}
    env = child_environment("cuda", parent, {"TRITON_CACHE_DIR": "/private"})
    assert env["TRITON_CACHE_DIR"] == "/private" and env["PATH"] == "/bin"
    assert "TRITON_KERNEL_OVERRIDE" not in env and "OPENAI_API_KEY" not in env and "TRITON_INTERPRET" not in env
    assert child_environment("cpu", parent, {})["TRITON_INTERPRET"] == "1"


@pytest.mark.parametrize("name, inherited", [
    ("PATH", True), ("LC_ALL", True), ("CUDA_HOME", True), ("TRITON_PTXAS_PATH", True), ("OMP_NUM_THREADS", True),
    ("PYTORCH_CUDA_ALLOC_CONF", True), ("KPIPE_GYM_RUN", False), ("KPIPE_GYM_TOKEN", False), ("KPIPE_WARM_START", False), ("SLURM_JOB_ID", False),
    ("SNAKEMAKE_PROFILE", False), ("OPENAI_BASE_URL", False), ("CUDA_API_TOKEN", False), ("HF_HOME", False),
    ("TRITON_KERNEL_OVERRIDE", False), ("KPIPE_GYM_TRACE", False), ("PYTHONSTARTUP", False), ("LD_PRELOAD", False),
])
def test_the_child_environment_is_an_allowlist(name: str, inherited: bool) -> None:
    assert (name in child_environment("cuda", {name: "value"}, {})) is inherited


# ----------------------------------------------------------------------------- planted artifacts

PLANTER = (Path(__file__).parent / "fixtures" / "gym" / "cache_planter.py").read_text()


@pytest.mark.timeout(900)
def test_planted_cache_entries_change_no_later_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trusted cache's own defence (digests), behind the sandbox: a confined candidate cannot
    reach another directory at all (tests/test_gym_confinement.py), so this planter runs
    unconfined (the named opt-out) to show the cache alone holds."""
    monkeypatch.setenv(OPT_OUT_VARIABLE, "1")
    # the pool's scratch and trusted directories under this test's own temporary directory
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    protocol = Protocol(correct_trials=1, perf_trials=3, warmup=1, baseline="both", device="cpu", timeout_s=300, reject_findings=())
    report = tmp_path / "planted"
    with GymPool(protocol, workers=1, progress=False) as pool:
        before = pool.evaluate(REFERENCE, LEGIT)
        assert before.status == "pass" and before.compile_ms is not None, before.diagnostic
        planted = pool.evaluate(REFERENCE, PLANTER.replace("REPORT_PATH", repr(str(report))) + LEGIT)
        assert planted.status == "pass", planted.diagnostic
        after = pool.evaluate(REFERENCE, LEGIT + "\n# the same kernel under another key\n")
        other = pool.evaluate(OTHER_REFERENCE, OTHER_LEGIT)
    assert int(report.read_text()) > 0, "the planter found no compiled module to tamper with: the test proves nothing"
    assert after.status == "pass" and other.status == "pass", (after.diagnostic, other.diagnostic)
    # the planted sleep adds 250 ms to every compiled call (noise on this CPU is far smaller); a
    # shared, unchecked cache also lets the planted junk break the baseline outright
    assert after.compile_ms is not None, after.diagnostic
    assert after.compile_ms < before.compile_ms + 100, (before.compile_ms, after.compile_ms)
    assert not [line for line in after.diagnostic.splitlines() if "torch.compile baseline failed" in line]


def test_the_trusted_cache_is_wiped_when_anything_foreign_appears(tmp_path: Path) -> None:
    caches = CompileCaches(tmp_path / "caches")
    env = caches.for_reference()
    entry = Path(env["TORCHINDUCTOR_CACHE_DIR"]) / "ab" / "output.py"
    entry.parent.mkdir(parents=True)
    entry.write_text("def call(args):\n    return args\n")
    caches.seal()  # a trusted child left it
    assert caches.verify() == [] and entry.exists()
    stat = entry.stat()
    entry.write_text("def call(args):\n    __import__('time').sleep(9)\n")  # tampered...
    os.utime(entry, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ...with its old mtime put back
    assert caches.verify() == ["inductor/ab/output.py"]
    assert not entry.exists() and caches.wipes == 1
    (Path(env["TRITON_CACHE_DIR"])).mkdir(parents=True)
    (Path(env["TRITON_CACHE_DIR"]) / "link").symlink_to("/etc/hostname")
    assert "triton/link" in caches.verify()


def test_a_candidates_private_cache_is_a_copy_of_the_verified_trusted_one(tmp_path: Path) -> None:
    caches = CompileCaches(tmp_path / "caches")
    trusted_triton = Path(caches.for_reference()["TRITON_CACHE_DIR"])
    (trusted_triton / "runtime").mkdir(parents=True)
    (trusted_triton / "runtime" / "cuda_utils.so").write_bytes(b"\x7fELF trusted")
    (trusted_triton / "a_baseline_kernel").mkdir()
    (trusted_triton / "a_baseline_kernel" / "kernel.cubin").write_bytes(b"compiled kernel")
    sketch_entry = trusted_triton / "sketch_key"  # the judge's own kernel, as Triton lays it out
    sketch_entry.mkdir()
    (sketch_entry / "kgym_output_sketch.cubin").write_bytes(b"the sketch")
    (sketch_entry / "__grp__kgym_output_sketch.json").write_text(
        json.dumps({"child_paths": {"kgym_output_sketch.cubin": str(sketch_entry / "kgym_output_sketch.cubin")}}))
    caches.seal()
    private = caches.for_candidate(tmp_path / "scratch")
    assert not (Path(private["TRITON_CACHE_DIR"]) / "a_baseline_kernel").exists()  # host code and the judge's kernels only
    private_sketch = Path(private["TRITON_CACHE_DIR"]) / "sketch_key"
    group = json.loads((private_sketch / "__grp__kgym_output_sketch.json").read_text())
    assert group["child_paths"] == {"kgym_output_sketch.cubin": str(private_sketch / "kgym_output_sketch.cubin")}
    assert (private_sketch / "kgym_output_sketch.cubin").read_bytes() == b"the sketch"  # the copy's own files
    copied = Path(private["TRITON_CACHE_DIR"]) / "runtime" / "cuda_utils.so"
    assert copied.read_bytes() == b"\x7fELF trusted" and not copied.is_symlink()
    copied.write_bytes(b"planted")  # the candidate writes into its copy: the original is untouched
    assert (trusted_triton / "runtime" / "cuda_utils.so").read_bytes() == b"\x7fELF trusted"
    assert foreign_entries(snapshot(trusted_triton), snapshot(trusted_triton)) == []
