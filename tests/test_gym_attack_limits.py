"""Hostile candidates that go after the machine's resources (issue 52, class 5): memory past the cap,
a huge file in the scratch directory, a swarm of processes, a thread started with the low-level
thread API. Each runs for real through ``kpipe gym eval`` (a fresh interpreter per child) and
``kpipe gym eval-batch`` (the pool's zygote), with an honest kernel after every attack in the batch,
and must end with the judge's status naming its limit, never ``pass``.

Every attack is bounded by itself (twice the memory cap, 256 MiB, 300 sleeping processes) so that a limit that
failed costs this machine little; the protocol's caps are smaller. The memory and process attacks
run again with the judge's watchdog in place of cgroups (``KPIPE_GYM_NO_CGROUP=1``): where no
cgroup can be made, that is what bounds them. ``checks/gpu/confinement.py`` runs this file on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_attack_runs import DEVICE, LEGIT, evaluate_each_then_honest, evaluate_fresh, reasons_of, resource_attacks

# an honest child's tree holds 0.25-0.7 GiB on the CPU as the watchdog counts it (a forked child's pages
# shared with its sandbox's waiter and init count once each); a CUDA context adds its own
MEMORY_CAP_MB = 2048 if DEVICE == "cpu" else 8192
PROTOCOL = {"correct_trials": 2, "perf_trials": 3, "warmup": 0, "baseline": "eager", "timeout_s": 120, "reject_findings": [],
            "device": DEVICE, "memory_limit_mb": MEMORY_CAP_MB, "file_size_limit_mb": 64, "task_limit": 128}

# each attack is the honest kernel (relu_legit.py) with the attack at its import: only its limit stops it passing
ATTACKS = {name: LEGIT + attack for name, attack in resource_attacks(MEMORY_CAP_MB).items()}
EXPECTED = {  # the status each attack must end with and what its diagnostic or reasons must say
    "allocates_past_the_memory_cap": ("resource_limit", f"memory: its processes passed the host memory cap of {MEMORY_CAP_MB} MiB"),
    "writes_a_huge_file": ("resource_limit", "file size: it wrote past the file size cap of 64 MiB"),
    "ignores_sigxfsz_and_carries_on": ("resource_limit", "file size: it wrote past the file size cap of 64 MiB: big.bin reached it"),
    "starts_many_processes": ("resource_limit", "processes: it"),
    "starts_a_native_thread": ("hacked", "side_thread: started thread(s) native thread"),
}
WATCHED = ("allocates_past_the_memory_cap", "starts_many_processes")  # again under the judge's watchdog
# the watchdog samples the candidate's processes and sums their resident memory, each fork's shared pages in each:
# on a loaded host a fork storm's sum passed the memory cap (2,254 of 2,048 MiB) before a sample saw the count
WATCHDOG_ALSO = {"starts_many_processes": f"memory: its processes passed the host memory cap of {MEMORY_CAP_MB} MiB"}


def verdict_text(result: dict[str, object]) -> str:
    return f"{result.get('diagnostic', '')} | {reasons_of(result)}"


def assert_judged(name: str, result: dict[str, object], also: str | None = None) -> None:
    status, text = EXPECTED[name]
    said = verdict_text(result)
    assert result["status"] == status and (text in said or (also is not None and also in said)), \
        f"{name}: {json.dumps(result, default=str)[:3000]}"


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_limit_holds_through_kpipe_gym_eval(tmp_path: Path, name: str) -> None:
    assert_judged(name, evaluate_fresh(tmp_path, ATTACKS[name], PROTOCOL))


@pytest.mark.parametrize("name", WATCHED)
def test_the_judges_watchdog_holds_where_no_cgroup_is_made(tmp_path: Path, name: str) -> None:
    assert_judged(name, evaluate_fresh(tmp_path, ATTACKS[name], PROTOCOL, env={"KPIPE_GYM_NO_CGROUP": "1"}),
                  WATCHDOG_ALSO.get(name))


def test_every_limit_holds_through_the_pool_and_each_next_honest_kernel_passes(tmp_path: Path) -> None:
    for name, (attacked, honest) in evaluate_each_then_honest(tmp_path, ATTACKS, PROTOCOL).items():
        assert_judged(name, attacked)
        assert honest["status"] == "pass", f"the honest kernel after {name}: {honest['status']} {honest['diagnostic']}"
