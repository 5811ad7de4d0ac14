"""The evaluation protocol: every setting that can change a KernelGym result.

The protocol travels (as JSON) with every result and is part of its cache key, so two
results are comparable exactly when their protocols are equal.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from kpipe.gym.limits import Limits
from kpipe.gym.screen import FINDING_CODES

# Bump when the meaning of a result changes (a new check, a different statistic).
# kgym-3: the timed region is KernelBench's (start event queued behind the L2 flush, end event
# right after the call), cuBLAS runs with its default workspace, and warm-up lasts at least
# warmup_ms on a GPU. kgym-2 started after a host synchronize, ended after a device-wide
# synchronize and limited cuBLAS's workspace: 6-16 % over KernelBench's published H100 eager
# times, 20-25 % lower speedups on sub-millisecond kernels
# (git show 63b36f8:docs/gpu-results/kernelbench_side_by_side_2026-11-25_H100.md)
# kgym-4: on a GPU the candidate child also times the reference, interleaved with the
# candidate's trials, and the candidate's times are divided by how far the GPU's speed had
# drifted from the reference's own timing (max_gpu_drift bounds it): the same candidate's
# speedup moved 3-10 % between evaluations with kgym-3 on an H100 with unlocked clocks
# (git show 63b36f8:docs/gpu-results/timing_noise_2026-11-25_H100.md)
# kgym-6: those paired trials run back to back, the host synchronising only between chunks of
# random length: after every synchronised trial the GPU idled while the host queued the next,
# and that idling set an offset per timing window that pairing could not divide out (speedup CV
# 0.5-0.9 % -> 0.04-0.44 % on an H100, git show 63b36f8:docs/gpu-results/window_state_2026-11-25_H100.md)
# kgym-7: candidates run confined (kpipe.gym.sandbox): a PID namespace of their own (no visible
# parent), no network, files only in their scratch, whose home and TMPDIR they now are; and PR's
# total (Eq. 7) counts memcpy and memset. No timing setting changed (confined and unconfined
# throughput and statuses were the same on an H100); hostile candidates' statuses did.
# kgym-8: several evaluations share a GPU, and only timed regions are exclusive: a child times
# (the reference its baselines, a candidate after the gate) holding the device's timing lease
# (kpipe.gym.lease), while other children start, compile and run correctness trials beside it.
# The reference child now also stops at a gate before its timing.
# kgym-9: the host-clock re-check of a speedup above recheck_speedup_above times each call after
# a host synchronize (recheck_timing_start), so its host clock no longer covers the harness's own
# input copy and L2 flush queued before the call: on a launch-bound kernel (0.18 ms, L2_14's legit
# one) those made the host time about twice the event time, the check's bound, and an honest kernel
# was judged hacked once in eight (`965801b:docs/gpu-results/gym_scaling_2026-11-27j_4xH200.md`).
# kgym-10: the re-check takes the harness's own host cost out of the candidate's host time
# (recheck_subtracts_harness): the events, the device-wide synchronize and the event wait around
# each call, as the trusted reference child measures them around a call that does nothing, under the
# timing lease (0.027-0.043 ms on H200s). It is charged to no kernel's speed, and it is the whole
# margin of a kernel of a few tens of microseconds. Honest launch-bound bank kernels (L1_40 0.22 ms,
# L2_14 0.19 ms) came as close as 0.57-0.60 of their event speedup to the bound of 0.5
# (`965801b:docs/gpu-results/gym_scaling_2026-11-28_2xH200.md`), and one was judged hacked once in 480 (`965801b:docs/gpu-results/gym_scaling_2026-11-27m_4xH200.md`).
# kgym-11: the candidate's process is untrusted, whatever it writes. After its timing the judge
# reveals a timing challenge (kpipe.gym.isolate.Challenge): fresh inputs from a seed no candidate has
# seen, whose calls the judge clocks itself against the reference's, never skipped, with or without
# the hacking check (the host-clock re-check of fast candidates stays, its evidence required). Every check
# fails closed when its evidence is missing; the judge reads the scratch directory without following
# links, blocking or reading past a cap; a status only the judge gives is never taken from a child.
# kgym-12: every candidate runs under limits (kpipe.gym.limits): host memory of its processes
# (memory_limit_mb, now a cgroup's or the judge's watchdog's cap, no longer an address-space limit),
# file size (file_size_limit_mb) and processes and threads (task_limit); one it hits is the judge's
# status resource_limit, naming it. Native threads the candidate starts (the low-level thread API,
# ctypes) are side threads too: counted from the OS's list of the process's threads.
# The timing challenge runs two rounds, a seed each, and the better one is judged (an honest answer's
# fixed costs once read 60 ms over the reference's on an H200).
# kgym-13: the challenge's calls run back to back, the host waiting for the GPU before the first and
# after the last and copying each output position once (kpipe.gym.child.run_challenge_calls), instead
# of three waits and a copy per call, each a point where a GPU shared with another process may switch
# away for a time slice; the reference's mean call is its back-to-back one; up to 64 calls (16 before)
# within 1 GiB of inputs on the device and 64 MiB of outputs in the answer; the candidate's own host
# times for them are no longer read. Up to three rounds, the judge stopping at the first that fits the
# claim the candidate's process wrote just before them (kpipe.gym.evaluation.early_stop).
PROTOCOL_VERSION = "kgym-13"

BASELINES = ("eager", "compile", "both")
# where a timed call's start event is recorded: queued behind the L2 flush (the call's launch
# overhead hides behind the flush, as in KernelBench) or after a host synchronize (the GPU idle:
# launch overhead inside the region)
TIMING_STARTS = ("behind_flush", "after_sync")
# where it ends: an event right after the call (then a device-wide synchronize, whose end the
# parent uses instead when the candidate left work running that the call did not wait for) or
# an event after the device-wide synchronize (its latency inside the region)
TIMING_ENDS = ("call", "after_sync")
# when the host synchronises during paired timing: after every trial (kgym-4), or only between
# chunks, the trials of a chunk queued back to back (kgym-6; kpipe.gym.timing.time_back_to_back)
PAIRED_HOST_SYNCS = ("trial", "chunk")
# what fields added since mean in a protocol written by an earlier version
EARLIER_DEFAULTS = {"kgym-2": {"timing_start": "after_sync", "timing_end": "after_sync", "cublas_workspace_config": ":4096:8",
                               "warmup_ms": 0.0, "paired_reference_trials": 0, "paired_host_sync": "trial",
                               "recheck_timing_start": "after_sync", "recheck_subtracts_harness": False},
                    "kgym-3": {"paired_reference_trials": 0, "paired_host_sync": "trial", "recheck_timing_start": "behind_flush",
                               "recheck_subtracts_harness": False},
                    "kgym-4": {"paired_host_sync": "trial", "recheck_timing_start": "behind_flush", "recheck_subtracts_harness": False},
                    # briefly the chunk-mean statistic (commit 5fe75e2, withdrawn): synchronised per trial
                    "kgym-5": {"paired_host_sync": "trial", "recheck_timing_start": "behind_flush", "recheck_subtracts_harness": False},
                    "kgym-6": {"recheck_timing_start": "behind_flush", "recheck_subtracts_harness": False},
                    "kgym-7": {"recheck_timing_start": "behind_flush", "recheck_subtracts_harness": False},
                    "kgym-8": {"recheck_timing_start": "behind_flush", "recheck_subtracts_harness": False},
                    "kgym-9": {"recheck_subtracts_harness": False},
                    "kgym-10": {}, "kgym-11": {}}
# no limits but the address space (memory_limit_mb, unset by default) up to kgym-11
for _earlier in EARLIER_DEFAULTS.values():
    _earlier.update(memory_limit_mb=None, file_size_limit_mb=None, task_limit=None)
# no disk quota before it (issue 62; it comes with kgym-14, "kgym-13" joins here then): none meant
for _version in (*EARLIER_DEFAULTS, "kgym-12"):
    EARLIER_DEFAULTS.setdefault(_version, {})["disk_limit_mb"] = None
DEVICES = ("auto", "cuda", "cpu")
# the least value of each limit (kpipe.gym.limits): below them an honest child cannot start
LIMIT_MINIMUMS = {"memory_limit_mb": 256, "file_size_limit_mb": 1, "task_limit": 16, "disk_limit_mb": 16}

# Static findings (kpipe.gym.screen) that reject a candidate as hacked by default; the
# others only inform (they are listed in the result and the feedback).
DEFAULT_REJECT_FINDINGS = (
    "try_except",
    "inherits_model",
    "monkey_patch",
    "thread",
    "tensor_subclass",
    "introspection",
    "subprocess",
    "network",
    "env_access",
    "ctypes",
)


@dataclass(frozen=True)
class Protocol:
    """How one candidate is judged. Defaults follow the paper (K=5 correctness trials)
    and the KernelGym brief (100 timed trials, 10x re-verification threshold)."""

    correct_trials: int = 5
    perf_trials: int = 100
    warmup: int = 10
    # ... and on a GPU at least this long: clocks drop while a candidate child waits for the
    # parent's verdict, and 10 calls of a 2 ms kernel do not bring them back
    warmup_ms: float = 100.0
    atol: float = 1e-2
    rtol: float = 1e-2
    # ||cand - ref|| / ||ref|| must stay below this: all-zeros output cannot pass on
    # tasks whose outputs are smaller than atol.
    norm_rtol: float = 0.05
    baseline: str = "both"
    device: str = "auto"
    timeout_s: float = 300.0
    reject_findings: tuple[str, ...] = DEFAULT_REJECT_FINDINGS
    hacking_check: bool = True
    ghost_replay: bool = True
    profile: bool = True
    recheck_speedup_above: float = 10.0
    # where each re-check call's region starts (TIMING_STARTS): after a host synchronize, so the
    # host clock around it holds the call and whatever it left running, not the harness's input
    # copy and L2 flush queued before it (kgym-8 and earlier: behind the flush, as timing_start)
    recheck_timing_start: str = "after_sync"
    # ... and the harness's own host cost around each call (its events, the synchronize, the event
    # wait), measured by the reference child around a call that does nothing, comes off the
    # candidate's host time before it is compared (kgym-9 and earlier: kept in it)
    recheck_subtracts_harness: bool = True
    # timed outputs compared with the reference (spot check of the timed path)
    timed_output_checks: int = 3
    # outputs larger than this are compared on a sample of this many elements (head, tail
    # and random positions): full copies of 8 GB KernelBench outputs cannot travel. 2^20
    # random positions miss a wrong region covering a fraction f of the output with
    # probability (1 - f)^(2^19) (f = 1e-5: 0.5%); larger samples cost seconds per
    # evaluation in copies, pickling and comparison (benchmarks/gym_pool.py)
    compare_max_elements: int = 1 << 20
    feedback_max_chars: int = 4000
    # a candidate's limits (kpipe.gym.limits; None: unlimited): host memory of its processes, MiB (a
    # cgroup's memory.max where one can be made, else the judge's watchdog on their resident memory;
    # an honest candidate's child holds 0.4-3 GiB, a full-size KernelBench model on the CPU more), the
    # size of any file it writes, MiB (above the largest result file a child writes: the judge
    # reads at most 4x the reference's + 32 MiB), and its processes and threads together (torch's
    # OpenMP pool, the CUDA driver's and LLVM's threads, Triton's compiler processes)
    memory_limit_mb: int | None = 16384
    file_size_limit_mb: int | None = 1024
    task_limit: int | None = 1024
    # what a candidate's scratch directory may hold on disk, MiB (the judge's quota: allocated blocks,
    # every entry at least 4 KiB; kpipe.gym.limits): its compile caches and what it writes
    disk_limit_mb: int | None = 4096
    seed: int = 42
    l2_flush_mb: int = 256
    timing_start: str = "behind_flush"  # TIMING_STARTS
    timing_end: str = "call"  # TIMING_ENDS
    # CUBLAS_WORKSPACE_CONFIG of the children ("": unset, cuBLAS's default workspace, as
    # KernelBench and its published timings run; ":4096:8" made cuBLAS GEMMs 3-11 % slower
    # on the H100); an inherited setting wins
    cublas_workspace_config: str = ""
    # reference trials the candidate child times on a GPU between its own timed trials (0: none):
    # each chunk's median over the reference child's is the GPU's drift since the baseline was
    # timed, divided out of the candidate trials before it (needs the eager baseline)
    paired_reference_trials: int = 50
    # ... capped at this fraction either way (the result says when): what a candidate slowing the
    # reference beside it could gain
    max_gpu_drift: float = 0.08
    # PAIRED_HOST_SYNCS
    paired_host_sync: str = "chunk"
    version: str = field(default=PROTOCOL_VERSION)

    def __post_init__(self) -> None:
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES}, got {self.baseline!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.correct_trials < 1 or self.perf_trials < 1 or self.warmup < 0 or self.warmup_ms < 0:
            raise ValueError("correct_trials and perf_trials must be >= 1, warmup and warmup_ms >= 0")
        if self.timing_start not in TIMING_STARTS:
            raise ValueError(f"timing_start must be one of {TIMING_STARTS}, got {self.timing_start!r}")
        if self.recheck_timing_start not in TIMING_STARTS:
            raise ValueError(f"recheck_timing_start must be one of {TIMING_STARTS}, got {self.recheck_timing_start!r}")
        if self.timing_end not in TIMING_ENDS:
            raise ValueError(f"timing_end must be one of {TIMING_ENDS}, got {self.timing_end!r}")
        if self.paired_host_sync not in PAIRED_HOST_SYNCS:
            raise ValueError(f"paired_host_sync must be one of {PAIRED_HOST_SYNCS}, got {self.paired_host_sync!r}")
        if self.paired_reference_trials < 0 or not 0 < self.max_gpu_drift < 1:
            raise ValueError("paired_reference_trials must be >= 0 and max_gpu_drift in (0, 1)")
        for name, least in LIMIT_MINIMUMS.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"{name} must be null (unlimited) or an integer >= {least}, got {value!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if not isinstance(self.reject_findings, tuple):
            object.__setattr__(self, "reject_findings", tuple(self.reject_findings))
        unknown = sorted(set(self.reject_findings) - set(FINDING_CODES))
        if unknown:
            raise ValueError(f"reject_findings names no screen finding: {', '.join(unknown)} "
                             f"(the codes are {', '.join(FINDING_CODES)})")

    def limits(self) -> Limits:
        """A candidate's caps (kpipe.gym.limits)."""
        return Limits(self.memory_limit_mb, self.file_size_limit_mb, self.task_limit, self.disk_limit_mb)

    @property
    def wants_eager(self) -> bool:
        return self.baseline in ("eager", "both")

    @property
    def wants_compile(self) -> bool:
        return self.baseline in ("compile", "both")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["reject_findings"] = sorted(self.reject_findings)
        return data

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): equal protocols give equal strings and cache keys."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Protocol:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown protocol key(s): {', '.join(unknown)}")
        values = {**EARLIER_DEFAULTS.get(data.get("version", PROTOCOL_VERSION), {}), **data}
        if "reject_findings" in values:
            values["reject_findings"] = tuple(values["reject_findings"])
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> Protocol:
        return cls.from_dict(json.loads(text))
