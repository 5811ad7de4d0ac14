"""The evaluation protocol: every setting that can change a KernelGym result.

The protocol travels (as JSON) with every result and is part of its cache key, so two
results are comparable exactly when their protocols are equal.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from kpipe.gym.confine.limits import Limits

# Bump when the meaning of a result changes (a new check, a different statistic); CHANGELOG.md holds
# the history of kgym-2 to kgym-13.
# kgym-14: the verdict and the reward come only from what the judge observes itself. A speedup is
# a ratio of times on the judge's clock: timing windows of back-to-back calls on fresh inputs drawn
# from a secret seed that serves one candidate once, the candidate's window against the reference's
# of the same seed (kpipe.gym.judge.evaluation.judge_windows); every call's output is checked (whole, or at
# secret positions and by a sketch of every element); the child's own timings, drift pairing, span
# charging, host re-check and claim are gone; children's files are safetensors and JSON read by a
# strict schema (kpipe.gym.exchange), no pickle.
# kgym-15: a candidate's window is read against the reference's least fixed cost over its windows, not
# the one of the same seed (kpipe.gym.judge.evaluation.candidate_window_ms): one stalled reference
# window no longer shortens the candidate's time.
# kgym-16: both children do the same work in a window (the sketch's variance pass too), a window's inputs
# are drawn in chunks so a task of large inputs still gets its ~100 ms of calls, and each child
# rehearses a window's work before the first (kpipe.gym.candidate.child.answer_windows).
# kgym-17: a window's calls are counted by its time on the host's clock, not the calls' own (a reference of
# microseconds took 1024 calls, 1.5 s a window), and a candidate is read against the least fixed cost
# over every window its reference run answered (kpipe.gym.judge.evaluation.candidate_window_ms).
# kgym-18: a candidate whose least window is within 5 % of the reference's fixed cost (or below it) is read
# from the windows' ratio, not their difference (kpipe.gym.judge.evaluation.resolved_fixed_ms): under a load
# that changed between the reference's run and the candidate's, the difference read an honest-speed kernel
# at the floor, 1000x. A huge output's sketch is taken under 16 secret sign patterns, each held to the bound
# (kpipe.gym.candidate.trial_data.SKETCH_PATTERNS): under one, a candidate computing only the sampled positions
# passed 17-22 % of its calls, and a CPU test's window of few calls now and then.
# kgym-19: the sketch in about 13 passes over a large output instead of 25 (its variance from power sums of |x|,
# kpipe.gym.candidate.trial_data.sketch): the bulk of a window's fixed cost, which read fast candidates of 67 M-element
# outputs 21-29 % slower than KernelBench's harness on an H100 (docs/kernelgym.md, Known limits).
# kgym-20: the judge's work between a window's calls in fewer launches (the sampled positions by index_select, the
# sketch written into the window's row), and `window_sketch`: "kernel" runs the sketch on a GPU as one Triton kernel
# that reads the output once (kpipe.gym.candidate.sketch_kernel). Not the default: on an H100 it read the fast
# candidates of 67 M-element outputs further from KernelBench's harness than kgym-18 did (docs/kernelgym.md, Known limits).
PROTOCOL_VERSION = "kgym-20"

BASELINES = ("eager", "compile", "both")
# the fields kgym-14 removed (the candidate's own timing), which a protocol of an earlier version may hold
RETIRED_FIELDS = frozenset({"timing_start", "timing_end", "paired_reference_trials", "max_gpu_drift", "paired_host_sync",
                            "recheck_speedup_above", "recheck_timing_start", "recheck_subtracts_harness", "timed_output_checks"})
# what fields added since mean in a protocol written by an earlier version: no limits but the
# address space (memory_limit_mb, unset by default) up to kgym-11
EARLIER_DEFAULTS = {f"kgym-{n}": {"memory_limit_mb": None, "file_size_limit_mb": None, "task_limit": None} for n in range(2, 12)}
EARLIER_DEFAULTS["kgym-2"].update(cublas_workspace_config=":4096:8", warmup_ms=0.0)
# no disk quota before kgym-14 (issue 62): none meant
for _version in (*EARLIER_DEFAULTS, "kgym-12", "kgym-13"):
    EARLIER_DEFAULTS.setdefault(_version, {})["disk_limit_mb"] = None
DEVICES = ("auto", "cuda", "cpu")
# how a timing window's output is sketched on a GPU (kpipe.gym.candidate.trial_data.sketch): torch ops, or one Triton kernel
WINDOW_SKETCHES = ("torch", "kernel")
# the least value of each limit (kpipe.gym.confine.limits): below them an honest child cannot start
LIMIT_MINIMUMS = {"memory_limit_mb": 256, "file_size_limit_mb": 1, "task_limit": 16, "disk_limit_mb": 16}

# Every code the static screen (kpipe.gym.judge.screen) reports; the protocol's reject_findings must name only these (a
# misspelt code would otherwise reject nothing, silently).
FINDING_CODES = (
    "try_except",  # a fallback path around the kernel
    "inherits_model",  # ModelNew(Model): reference code reachable
    "torch_op_in_forward",  # torch compute left in ModelNew.forward (informs; PR measures it)
    "thread",
    "cuda_stream",
    "monkey_patch",  # assignment to attributes of torch / triton / time / builtins
    "tensor_subclass",
    "introspection",  # gc, inspect, sys._getframe: reaching the harness's objects
    "file_io",
    "network",
    "subprocess",
    "env_access",
    "ctypes",
    "process_exit",
)

# Static findings (kpipe.gym.judge.screen) that reject a candidate as hacked by default; the
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
# The static findings that belong to the hacking check (paper §3.3: a Triton kernel actually computes the
# output, no fallback to the reference or to PyTorch), which `hacking_check=False` (the paper's "w/o
# hacking check" ablation) stops rejecting along with the launch check and the ghost replay. The other
# findings are the sandbox's policy and stay on with it.
HACKING_CHECK_FINDINGS = ("try_except", "inherits_model")


@dataclass(frozen=True)
class Protocol:
    """How one candidate is judged. Defaults follow the paper (K=5 correctness trials)
    and the KernelGym brief (100 timed calls)."""

    correct_trials: int = 5
    # on the CPU, the calls of each timing window at most (on a GPU a window takes as many as make
    # about 100 ms of the reference's time, up to 1024: kpipe.gym.candidate.child.window_calls), and untimed
    # calls before the first window
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
    # the paper's hacking check (§3.3) and kpipe's forms of it: a Triton kernel launched in train and
    # eval mode and in the timing windows (`no_triton_launch`), the ghost replay (`ghost_replay`) and
    # the static fallback screens (HACKING_CHECK_FINDINGS). False (the "w/o hacking check" ablation)
    # turns off exactly these; the sandbox's other findings, the integrity checks (`monkey_patch`,
    # `side_thread`, `tensor_subclass`, `input_mutation`) and every output check stay on.
    hacking_check: bool = True
    ghost_replay: bool = True
    profile: bool = True
    # a correctness trial's outputs larger than this are compared on a sample of this many elements
    # (head, tail and random positions): full copies of 8 GB KernelBench outputs cannot travel
    # (a timing window's are checked at secret positions and by a sketch, kpipe.gym.candidate.trial_data). 2^20
    # random positions miss a wrong region covering a fraction f of the output with
    # probability (1 - f)^(2^19) (f = 1e-5: 0.5%); larger samples cost seconds per
    # evaluation in copies, pickling and comparison (benchmarks/gym_pool.py)
    compare_max_elements: int = 1 << 20
    feedback_max_chars: int = 4000
    # a candidate's limits (kpipe.gym.confine.limits; None: unlimited): host memory of its processes, MiB (a
    # cgroup's memory.max where one can be made, else the judge's watchdog on their resident memory;
    # an honest candidate's child holds 0.4-3 GiB, a full-size KernelBench model on the CPU more), the
    # size of any file it writes, MiB (above the largest result file a child writes: the judge
    # reads at most 4x the reference's + 32 MiB), and its processes and threads together (torch's
    # OpenMP pool, the CUDA driver's and LLVM's threads, Triton's compiler processes)
    memory_limit_mb: int | None = 16384
    file_size_limit_mb: int | None = 1024
    task_limit: int | None = 1024
    # what a candidate's scratch directory may hold on disk, MiB (the judge's quota: allocated blocks,
    # every entry at least 4 KiB; kpipe.gym.confine.limits): its compile caches and what it writes
    disk_limit_mb: int | None = 4096
    seed: int = 42
    l2_flush_mb: int = 256
    # CUBLAS_WORKSPACE_CONFIG of the children ("": unset, cuBLAS's default workspace, as
    # KernelBench and its published timings run; ":4096:8" made cuBLAS GEMMs 3-11 % slower
    # on the H100); an inherited setting wins
    cublas_workspace_config: str = ""
    # how a GPU sketches a timing window's large outputs (WINDOW_SKETCHES): "torch", about 13 passes over the
    # output (1.26 ms a call of 67 M elements on an H100), or "kernel", one Triton kernel (0.14 ms); the CPU
    # always takes the torch form (docs/kernelgym.md, "Known limits")
    window_sketch: str = "torch"
    version: str = field(default=PROTOCOL_VERSION)

    def __post_init__(self) -> None:
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES}, got {self.baseline!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.window_sketch not in WINDOW_SKETCHES:
            raise ValueError(f"window_sketch must be one of {WINDOW_SKETCHES}, got {self.window_sketch!r}")
        if self.correct_trials < 1 or self.perf_trials < 1 or self.warmup < 0 or self.warmup_ms < 0:
            raise ValueError("correct_trials and perf_trials must be >= 1, warmup and warmup_ms >= 0")
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
        """A candidate's caps (kpipe.gym.confine.limits)."""
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
        if data.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:  # an earlier version's record
            data = {key: value for key, value in data.items() if key not in RETIRED_FIELDS}
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
