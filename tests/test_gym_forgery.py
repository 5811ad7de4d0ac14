"""Hostile candidates that go after the verdict rather than the machine (issue 52, classes 2-4): they
forge the result their process writes, tamper with the judge's helpers in that process, and plant
links, FIFOs and huge files where the judge reads. Each runs for real through ``kpipe gym eval``
(a fresh interpreter per child) and ``kpipe gym eval-batch`` (the pool's zygote), with an honest
kernel after every attack in the batch. None may pass, leak, write outside its scratch or hang.

The runtime checks are what is under test, so the protocol rejects no static finding (the screen is
exactly what a string trick defeats); one attack also runs with the default protocol, whose screen
rejects it before it runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_attack_runs import DEVICE, FIXTURES, evaluate_each_then_honest, evaluate_fresh, reasons_of

PROTOCOL = {"correct_trials": 2, "perf_trials": 3, "warmup": 0, "baseline": "eager", "timeout_s": 120, "reject_findings": [],
            "device": DEVICE}

KERNEL = "\n" + (FIXTURES / "attack_prelude.py").read_text()

# each attack: (name, source); every one would pass, fast, if the judge believed its process
ATTACKS = {
    # class 2: a result written by the candidate's process
    "writes_pass": KERNEL + '''
from kpipe.gym.exchange import encode

with open("result.safetensors", "wb") as handle:
    handle.write(encode({"role": "candidate", "device": "cpu", "device_id": "cpu", "torch_version": "", "triton_version": "",
                         "status": "pass", "error": "", "traceback": "", "phase": ""}))
os._exit(0)


class ModelNew(nn.Module):
    def forward(self, x):
        return decorative(x)
''',
    "forges_the_final_result": KERNEL + '''
class ModelNew(nn.Module):
    def forward(self, x):
        if os.path.exists("gate"):  # past the correctness gate: write the verdict's evidence ourselves, as kgym-13 read it
            ms = [1e-6] * 3
            torch.save({"status": "ok", "launches": {"train": ["copy_kernel"], "eval": ["copy_kernel"], "timed": ["copy_kernel"]},
                        "timing": {"ms": ms, "host_ms": ms, "samples": []}, "calls_without_launch": 0, "patched": [],
                        "hooks_intact": True, "threads": []}, "result.safetensors")
            os._exit(0)
        return torch_behind_a_kernel(x)
''',
    "writes_an_unhashable_status": KERNEL + '''
from kpipe.gym.exchange import encode

with open("result.safetensors", "wb") as handle:
    handle.write(encode({"status": ["pass"], "error": {"deep": [[[]]]}}))
os._exit(0)


class ModelNew(nn.Module):
    def forward(self, x):
        return decorative(x)
''',
    # class 3: the judge's helpers in the candidate's own process
    "rebinds_the_judges_helpers": KERNEL + '''
# the judge's module, by its spec: it runs as __main__ in a fresh interpreter
child = next(m for m in list(sys.modules.values()) if getattr(getattr(m, "__spec__", None), "name", "") == "kpipe.gym.candidate.child")
real_flatten = child.flatten_output
seen = []


def flatten(output):  # the outputs the judge compares: torch's, whatever the kernel wrote
    return real_flatten(torch.relu(seen[-1]) if seen else output)


child.flatten_output = flatten


class ModelNew(nn.Module):
    def forward(self, x):
        seen.append(x)
        return torch.zeros_like(decorative(x))
''',
    "swaps_a_helpers_code": KERNEL + '''
data = sys.modules["kpipe.gym.candidate.trial_data"]
data.fingerprint.__code__ = (lambda inputs: 0.0).__code__  # input mutation goes unseen


class ModelNew(nn.Module):
    def forward(self, x):
        x.copy_(torch.relu(x))
        decorative(x)
        return x
''',
    "reads_the_ghost_replays_switch": KERNEL + '''
instrument = sys.modules["kpipe.gym.candidate.instrument"]


class ModelNew(nn.Module):
    def forward(self, x):
        if getattr(instrument.LOG, "suppress", False):  # the ghost replay: look like the kernels matter
            return torch.full_like(x, float("nan"))
        decorative(x)
        return torch.relu(x)
''',
    # class 4: the scratch directory the judge reads
    "links_its_result_to_a_secret": KERNEL + '''
os.symlink("{target}", "result.safetensors")
os.symlink("{target}", "phase-link")
os.replace("phase-link", "phase")
os._exit(0)


class ModelNew(nn.Module):
    def forward(self, x):
        return decorative(x)
''',
    "plants_the_gate_as_a_link_outside": KERNEL + '''
os.symlink("{victim}", "gate")
os.symlink("{victim}", ".gate.judge")


class ModelNew(nn.Module):
    def forward(self, x):
        decorative(x)
        return torch.relu(x)
''',
    "a_fifo_for_a_result": KERNEL + '''
os.mkfifo("partial.safetensors")
time.sleep(3600)


class ModelNew(nn.Module):
    def forward(self, x):
        return decorative(x)
''',
    "a_huge_result": KERNEL + '''
with open("result.safetensors", "wb") as handle:
    handle.truncate(48 << 20)  # sparse: costs the candidate nothing to write
os._exit(0)


class ModelNew(nn.Module):
    def forward(self, x):
        return decorative(x)
''',
}
SECRET_TEXT = "kpipe-forgery-test-secret-5f1e"
VICTIM_TEXT = "the victim's file"


def attacks(tmp_path: Path) -> dict[str, str]:
    """The attacks, aimed at a secret file and a victim file outside any scratch directory."""
    target, victim = tmp_path / "secret.txt", tmp_path / "victim.txt"
    target.write_text(SECRET_TEXT)
    victim.write_text(VICTIM_TEXT)
    return {name: source.replace("{target}", str(target)).replace("{victim}", str(victim)) for name, source in ATTACKS.items()}


def assert_caught(name: str, result: dict[str, object], tmp_path: Path) -> None:
    text = json.dumps(result, default=str)
    assert result["status"] != "pass", f"{name} passed: {text[:2000]}"
    assert result["status"] != "timeout", f"{name} hung the judge until its timeout"
    assert SECRET_TEXT not in text, f"{name} leaked the secret file's text"
    assert (tmp_path / "victim.txt").read_text() == VICTIM_TEXT, f"{name} wrote outside its scratch"


EXPECTED = {  # the status each attack must end with and what its reasons must say
    "writes_pass": ("hacked", "integrity: the candidate's process wrote the status 'pass'"),
    # a pickle is never read; the judge's own status names why
    "forges_the_final_result": ("runtime_error", "malformed file from the candidate's process: a header of"),
    "writes_an_unhashable_status": ("runtime_error", "malformed file from the candidate's process: the result file: unexpected keys"),
    "rebinds_the_judges_helpers": ("hacked", "monkey_patch: replaced kpipe.gym.candidate.child.flatten_output"),
    "swaps_a_helpers_code": ("hacked", "kpipe.gym.candidate.trial_data.fingerprint.__code__"),
    "reads_the_ghost_replays_switch": ("hacked", "ghost_replay"),
    "links_its_result_to_a_secret": ("hacked", "integrity: tampered result: result.safetensors could not be opened safely"),
    "plants_the_gate_as_a_link_outside": ("hacked", "integrity: .gate.judge was planted"),
    "a_fifo_for_a_result": ("hacked", "integrity: tampered result: partial.safetensors is not a regular file"),
    "a_huge_result": ("hacked", "integrity: tampered result: result.safetensors holds 50331648 bytes, over its cap"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_forgery_fails_through_kpipe_gym_eval(tmp_path: Path, name: str) -> None:
    result = evaluate_fresh(tmp_path, attacks(tmp_path)[name], PROTOCOL)
    assert_caught(name, result, tmp_path)
    status, reason = EXPECTED[name]
    assert result["status"] == status and reason in reasons_of(result) + result["diagnostic"], json.dumps(result, default=str)[:3000]


def test_every_forgery_fails_through_the_pool_and_each_next_honest_kernel_passes(tmp_path: Path) -> None:
    for name, (attacked, honest) in evaluate_each_then_honest(tmp_path, attacks(tmp_path), PROTOCOL).items():
        assert_caught(name, attacked, tmp_path)
        status, reason = EXPECTED[name]
        assert attacked["status"] == status and reason in reasons_of(attacked) + attacked["diagnostic"], \
            f"{name}: {attacked['status']} {reasons_of(attacked)} {attacked['diagnostic'][:300]}"
        assert honest["status"] == "pass", f"the honest kernel after {name}: {honest['status']} {honest['diagnostic']}"


def test_the_default_screen_rejects_reaching_the_judge_before_anything_runs() -> None:
    from kpipe.gym.protocol import Protocol
    from kpipe.gym.judge.screen import screen

    rejected = set(Protocol().reject_findings)
    for name in ("rebinds_the_judges_helpers", "swaps_a_helpers_code", "reads_the_ghost_replays_switch"):
        assert "introspection" in screen(ATTACKS[name]).codes() & rejected, name
    closure = KERNEL + "\nswitch = sys.modules['kpipe.gym.candidate.instrument'].suppressed.__wrapped__.__closure__\n"
    assert "introspection" in screen(closure).codes()
