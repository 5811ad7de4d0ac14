"""What runs inside an evaluation's child process.

``run_child(job)`` runs one role and writes a result file the parent reads:

- ``"reference"``: the reference program only (no candidate code ever runs in this process, so
  what it reports can be trusted): outputs of every correctness trial and of eval mode, then its
  answers to the judge's timing windows (``answer_windows``), each timed on its own clock too, and
  the ``torch.compile`` baseline's calls on every window's inputs;
- ``"candidate"``: the candidate, with poisoned uninitialised memory during correctness, launch
  recording in train and eval mode and the ghost replay, then profiling and its answers to the
  judge's timing windows.

The judge trusts nothing a candidate's process writes but its outputs: it compares them itself
(``kpipe.gym.judge.compare``) and clocks each window on its own clock. Its reports (launches, patched
names, threads) can only fail it. The phases' tools live beside it: a trial's inputs and output
digests in ``kpipe.gym.candidate.trial_data``, PR in ``kpipe.gym.candidate.profiling``, the file format in
``kpipe.gym.exchange``; this module is the order they run in and what is recorded.

The job is a plain dict so a warm pool can fork and call ``run_child`` unchanged; this
module's ``__main__`` is the fresh-interpreter path: ``python -m kpipe.gym.candidate.child JOBFILE``.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import math
import os
import re
import resource
import site
import sys
import sysconfig
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kpipe.gym.candidate import instrument
from kpipe.gym.confine.environment import is_secret
from kpipe.gym.candidate.faults import classify_exception
from kpipe.gym.exchange import (JOB_FILE, PARTIAL_FILE, PREPARATION_FILE, WINDOW_ANSWER_FILE, WINDOW_FILE, WINDOW_POLL_S, WINDOW_READY_FILE,
                                encode, gc_paused)
from kpipe.gym.confine.limits import apply_rlimits
from kpipe.gym.candidate.profiling import profile_cpu, profile_cuda
from kpipe.gym.candidate.sketch_kernel import KERNEL_NAME as SKETCH_KERNEL_NAME
from kpipe.gym.protocol import Protocol
from kpipe.gym.candidate.timing import Clocks, flush_l2, l2_flush_buffer
from kpipe.gym.candidate.trial_data import (WindowOutputs, clone_inputs, digest, fingerprint, flatten_output, make_inputs, subclass_outputs,
                                  tensor_bytes, trial_seed)

# the judge's timing windows (``answer_windows``): the reference picks how many calls each takes, enough
# for about this much of a window's time on the host's clock (so a window's constant cost, the seed's
# and the answer's hand-over, stays a small share of it), between these bounds. Their fresh input sets are
# drawn in chunks of at most WINDOW_MAX_INPUT_BYTES on the device (``draw_chunk``), so a task of 268 MB
# inputs still gets its 100 ms of calls (kgym-15 drew a window's sets at once under that bound: 4 calls)
WINDOW_TARGET_MS = {"cuda": 100.0, "cpu": 20.0}
WINDOW_MIN_CALLS = 2
WINDOW_MAX_CALLS = 1024
WINDOW_MAX_INPUT_BYTES = 1 << 30
# ----------------------------------------------------------------------------- helpers


def load_module(source: str, name: str, directory: Path) -> types.ModuleType:
    """Import `source` from a real file (Triton reads kernel source with inspect)."""
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build_model(cls: type, init_inputs: list[Any], seed: int, device: str) -> torch.nn.Module:
    """Same seed before construction in both children: the weights match. Constructed on the
    device, by its generator: seeded on the host and moved (as KernelBench does), L2_59's
    32768x32768 layer took 5-9 s of every evaluation on the H100. The draws differ from
    KernelBench's, never between reference and candidate."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(*init_inputs)
    return model.to(device)


class Builds:
    """The model built once and further *fresh* copies of it for eval mode and the ghost replay.

    A copy is a ``copy.deepcopy`` of a pristine copy taken before any forward ran, with the
    random state left as construction left it: the same weights, buffers and RNG state a new
    seeded construction gives. Where a deep copy is not a faithful fresh model (it raises, or
    the class answers it with something that is not a new instance of itself), the copy is
    constructed again as before.
    """

    def __init__(self, cls: type, init_inputs: list[Any], seed: int, device: str) -> None:
        self.args = (cls, init_inputs, seed, device)
        self.model = build_model(cls, init_inputs, seed, device)
        self.rng = torch.get_rng_state()
        self.device_rng = torch.cuda.get_rng_state() if device == "cuda" else None
        self.pristine = self._deepcopy(self.model)

    def _deepcopy(self, model: torch.nn.Module) -> torch.nn.Module | None:
        import copy

        try:
            clone = copy.deepcopy(model)
        except Exception:  # noqa: BLE001 - not copyable: construct instead
            return None
        return clone if type(clone) is type(model) and clone is not model else None

    def fresh(self) -> torch.nn.Module:
        """A model as a new seeded construction would give it."""
        clone = self._deepcopy(self.pristine) if self.pristine is not None else None
        if clone is None:
            return build_model(*self.args)
        torch.manual_seed(self.args[2])
        torch.set_rng_state(self.rng)
        if self.device_rng is not None:
            torch.cuda.set_rng_state(self.device_rng)
        return clone


@contextmanager
def poisoned_memory() -> Iterator[None]:
    """New tensors start as NaN (floats) / max-int: an output never written cannot pass."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.utils.deterministic.fill_uninitialized_memory = previous[2]


def watched_objects() -> dict[str, Any]:
    """What a candidate could patch to fake results or slow things down: torch's namespaces,
    Tensor methods, CUDA timing, the clocks, our launch hooks, and every name of KernelGym's own
    modules loaded in this process (the judge's helpers here: output flattening, digests, the
    timed call) with the code object of each of its functions (``f.__code__ = ...`` keeps the
    function but changes what it does)."""
    import triton.runtime.jit as triton_jit

    spaces: dict[str, Any] = {
        "torch": torch,
        "torch.nn.functional": torch.nn.functional,
        "torch.Tensor": torch.Tensor,
        "torch.nn.Module": torch.nn.Module,
        "time": time,
        "torch.testing": torch.testing,
        "triton.runtime.jit.JITFunction": triton_jit.JITFunction,
    }
    if torch.cuda.is_available():
        spaces["torch.cuda"] = torch.cuda
        spaces["torch.cuda.Event"] = torch.cuda.Event
    for module in list(sys.modules.values()):
        # by its spec: this module runs as __main__ in a fresh interpreter (python -m kpipe.gym.candidate.child)
        name = getattr(getattr(module, "__spec__", None), "name", "") or ""
        if name.startswith("kpipe.") and isinstance(module, types.ModuleType):
            spaces[name] = module
            for attribute, value in list(vars(module).items()):
                if isinstance(value, type) and value.__module__ in (name, module.__name__):
                    spaces[f"{name}.{attribute}"] = value
    watched = {}
    for prefix, space in spaces.items():
        for name, value in list(vars(space).items()):
            if callable(value) or isinstance(value, (types.ModuleType, property, staticmethod, classmethod)):
                watched[f"{prefix}.{name}"] = value
                if prefix.startswith("kpipe.") and isinstance(value, types.FunctionType):
                    watched[f"{prefix}.{name}.__code__"] = value.__code__
    return watched


def patched_names(before: dict[str, Any]) -> list[str]:
    now = watched_objects()
    return sorted(name for name, value in before.items() if now.get(name) is not value)


def prime_lazy_state(device: str, profile: bool) -> None:
    """Trigger torch's own lazy rebinding before the patch snapshot, so it is not mistaken
    for the candidate's doing (importing torch._dynamo, which poisoned_memory() does,
    rebinds torch.manual_seed; CUDA and the profiler initialise lazily)."""
    import torch._dynamo  # noqa: F401
    import torch.profiler  # noqa: F401

    with poisoned_memory():
        torch.empty(1, device=device)
    # torch's OpenMP pool starts at the first parallel host op (a candidate's forward may be one), as
    # many threads as that op has chunks of 32768 elements: started here at full width, its threads are
    # not taken for the candidate's (side_os_threads)
    torch.ones(1 << 15, 2 * torch.get_num_threads()).add_(1)
    torch.ones(256, 256) @ torch.ones(256, 256)
    # numpy's OpenBLAS pool (the Triton interpreter's tl.dot is a numpy matmul) does not survive the
    # zygote's fork and restarts at the first matmul large enough to split: the bank's honest L2_76
    # was judged hacked for that thread (issue 62, row 12)
    import numpy

    numpy.ones((256, 256), dtype=numpy.float32) @ numpy.ones((256, 256), dtype=numpy.float32)
    if device == "cuda":
        torch.cuda.init()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        torch.cuda.synchronize()
        if profile:  # the profiler (kineto) also initialises lazily
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities):
                torch.ones(1, device=device).add_(1)
                torch.cuda.synchronize()


class Phase:
    """Writes the phase name to a file, so a child that dies says where, and keeps how long
    each phase took (``durations()``: what an evaluation's seconds were spent on)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.marks: list[tuple[str, float]] = []

    def __call__(self, name: str, announce: bool = True) -> None:
        """Start phase `name`; `announce=False` times it without overwriting the file, which
        then still names the phase a failed run failed in (the parent reads it afterwards)."""
        self.marks.append((name, time.perf_counter()))
        if self.path and announce:
            Path(self.path).write_text(name)

    def durations(self) -> list[list[Any]]:
        """[[phase, seconds], ...] in order, the last phase up to now."""
        ends = [t for _, t in self.marks[1:]] + [time.perf_counter()]
        return [[name, end - start] for (name, start), end in zip(self.marks, ends)]


def os_threads() -> dict[int, str]:
    """This process's threads as the kernel lists them (/proc/self/task), by id, with their names:
    every thread, however it was started (``threading``, ``_thread``, ctypes' pthread_create)."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            threads[int(tid)] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # it ended meanwhile
            continue
    return threads


# the CUDA driver's threads (its event handler, one a process, and its callback threads)
CUDA_THREAD_RE = re.compile(r"cuda-EvtHandlr|cuda\d+")
ONE_A_PROCESS = frozenset({"cuda-EvtHandlr"})


def side_os_threads(before: dict[int, str], inherited_names: set[str], cuda: bool, python_before: set[int]) -> list[str]:
    """Threads alive now that were not before the candidate's import (`before`, `python_before`:
    the threads and the interpreter's thread states then) and that the runtime did not start:

    - a thread with a name it inherits from the one that started it (`inherited_names`: the main
      thread's, before and now): the runtime's own late helpers name themselves (the CUDA driver's
      ``cuda-EvtHandlr``, LLVM's ``llvm-worker-N``), and the pools that do not (torch's OpenMP,
      numpy's OpenBLAS) are started before the snapshot (``prime_lazy_state``);
    - a thread named like one of CUDA's where there is no CUDA, or like one a process has once
      (``ONE_A_PROCESS``) that was already running: a name is the thread's to set, so one named
      to pass for the runtime's is told apart by what the runtime does;
    - a thread running Python code (a thread state of the interpreter's) that ``threading`` does
      not list: no runtime thread runs Python, whatever the thread calls itself.
    The ``threading`` threads are the caller's to report."""
    python_threads = {thread.native_id for thread in threading.enumerate()}
    names_before = set(before.values())
    side = []
    for tid, name in sorted(os_threads().items()):
        if tid in before or tid in python_threads:
            continue
        if name in inherited_names:
            side.append(f"native thread {tid} ({name})")
        elif CUDA_THREAD_RE.fullmatch(name) and (not cuda or (name in ONE_A_PROCESS and name in names_before)):
            side.append(f"native thread {tid} ({name}, named like a CUDA driver thread)")
    listed = {thread.ident for thread in threading.enumerate()}
    side += [f"python thread {ident}" for ident in sorted(set(sys._current_frames()) - python_before - listed)]
    return side


# ----------------------------------------------------------------------------- roles


def run_reference(job: dict[str, Any], protocol: Protocol, device: str, workdir: Path, phase: Phase) -> dict[str, Any]:
    phase("load reference")
    module = load_module(job["reference_src"], "kpipe_reference", workdir)
    clocks = Clocks(device)
    init_inputs = module.get_init_inputs()
    result: dict[str, Any] = {"outputs": [], "mutates_inputs": False}
    keep = functools.partial(digest, max_elements=protocol.compare_max_elements, seed=protocol.seed)
    phase("build reference")
    builds = Builds(module.Model, init_inputs, protocol.seed, device)
    model = builds.model
    for trial in range(protocol.correct_trials):
        phase(f"reference correctness trial {trial}")
        inputs = make_inputs(module.get_inputs, trial_seed(protocol.seed, trial), device)
        before = fingerprint(inputs)
        if trial == 0:  # for eval mode, the ghost replay, the compiled baseline's build, the profile, the window's count
            first_inputs = clone_inputs(inputs)
        with torch.no_grad():
            result["outputs"].append(keep(flatten_output(model(*inputs))))
        result["mutates_inputs"] |= fingerprint(inputs) != before
        del inputs
    phase("reference eval mode")
    eval_model = builds.fresh().eval()
    with torch.no_grad():
        result["eval_outputs"] = keep(flatten_output(eval_model(*clone_inputs(first_inputs))))
    del eval_model, builds
    if device == "cuda":
        phase("build Triton's runtime helpers")
        build_triton_runtime()
    compiled = compiled_reference(model, first_inputs, result, phase) if protocol.wants_compile else None
    if job.get("gate_path"):  # the judge answers once this child holds its device's timing lease
        phase("reference waiting at the gate")
        write_result(str(workdir / PARTIAL_FILE), {})
        if wait_for_gate(Path(job["gate_path"]), job["gate_wait_s"], job["parent_pid"]) != "go":
            raise RuntimeError("the judge stopped the reference at the gate")
    if job.get("window_rounds"):
        l2 = l2_flush_buffer(protocol, device)
        calls = window_calls(model, module.get_inputs, device, clocks, l2, protocol)
        result["compile_windows_ms"] = answer_windows(job, workdir, model, module.get_inputs, protocol, clocks, l2, phase, calls,
                                                      reference=True, compiled=compiled)
    return result


def compiled_reference(model: torch.nn.Module, inputs: list[Any], result: dict[str, Any], phase: Phase) -> Any:
    """The ``torch.compile`` baseline, compiled by one untimed call before the gate; None (and
    ``compile_error``) when it cannot compile. Inductor's compile takes seconds (4-6 s from cold on
    an H200, in the GPU DAG's trace), and a child that holds its GPU's timing lease stops every other
    child on that GPU: compiled in the warm-up, as until 2026-11-28, it held the lease that long. The
    call matches the timed ones (no grad, input set 0's shapes), so they reuse its graph; the timing's
    own warm-up calls still run under the lease."""
    phase("reference torch.compile build")
    try:
        compiled = torch.compile(model)
        with torch.no_grad():
            compiled(*clone_inputs(inputs))
        return compiled
    except Exception as exc:  # a baseline that cannot compile is reported, not fatal
        result["compile_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return None


def build_triton_runtime() -> None:
    """Build Triton's host-side helpers (``cuda_utils``: gcc, about a second) here, in the trusted
    cache every candidate's private cache is seeded from (kpipe.gym.confine.compile_caches); otherwise
    every candidate child builds them again. Before the gate: gcc runs while another child may be
    timed, never while this one holds the timing lease."""
    import triton

    try:
        triton.runtime.driver.active.utils  # noqa: B018 - the attribute access builds them
    except Exception as exc:  # noqa: BLE001 - not fatal: each candidate then builds its own
        print(f"kpipe: Triton's runtime helpers were not built in the trusted cache: {exc}", file=sys.stderr)


def run_candidate(job: dict[str, Any], protocol: Protocol, device: str, workdir: Path, phase: Phase) -> dict[str, Any]:
    phase("prepare (lazy torch state, hooks)")
    clocks = Clocks(device)
    prime_lazy_state(device, protocol.profile)
    instrument.install()
    real_thread_start = threading.Thread.start
    started_threads: list[str] = []

    def start_and_record(thread: threading.Thread) -> None:
        started_threads.append(thread.name)
        real_thread_start(thread)

    threading.Thread.start = start_and_record  # type: ignore[method-assign]
    threads_before = set(threading.enumerate())
    os_threads_before, python_states_before = os_threads(), set(sys._current_frames())
    main_thread_name = Path("/proc/self/comm").read_text().strip()
    reference = load_module(job["reference_src"], "kpipe_reference", workdir)
    # taken before candidate code runs (it could rebind the module's names)
    reference_model, get_inputs, init_inputs = reference.Model, reference.get_inputs, reference.get_init_inputs()
    watched = watched_objects()
    result: dict[str, Any] = {"outputs": [], "launches": {}, "mutates_inputs": False}

    phase("load candidate")
    candidate = load_module(job["candidate_src"], "kpipe_candidate", workdir)
    if not isinstance(getattr(candidate, "ModelNew", None), type):
        raise LookupError("the candidate module defines no class ModelNew")
    phase("build candidate")
    with poisoned_memory():
        builds = Builds(candidate.ModelNew, init_inputs, protocol.seed, device)
    model = builds.model

    keep = functools.partial(digest, max_elements=protocol.compare_max_elements, seed=protocol.seed)
    train_launches: list[str] = []
    for trial in range(protocol.correct_trials):
        phase(f"candidate correctness trial {trial}")
        inputs = make_inputs(get_inputs, trial_seed(protocol.seed, trial), device)
        before = fingerprint(inputs)
        if trial == 0:  # for eval mode, the ghost replay, the compiled baseline's build, the profile, the window's count
            first_inputs = clone_inputs(inputs)
        with poisoned_memory(), instrument.recording() as log, torch.no_grad():
            outputs = flatten_output(model(*inputs))
        clocks.sync()
        result.setdefault("subclass_outputs", []).extend(subclass_outputs(outputs))
        result["outputs"].append(keep(outputs))
        result["mutates_inputs"] |= fingerprint(inputs) != before
        train_launches.extend(log.names)
        del inputs, outputs
    result["launches"]["train"] = train_launches

    phase("candidate eval mode")
    eval_model = builds.fresh().eval()
    with poisoned_memory(), instrument.recording() as log, torch.no_grad():
        result["eval_outputs"] = keep(flatten_output(eval_model(*clone_inputs(first_inputs))))
    result["launches"]["eval"] = list(log.names)
    del eval_model

    if protocol.hacking_check and protocol.ghost_replay:
        phase("candidate ghost replay")
        ghost_model = builds.fresh()
        with poisoned_memory(), instrument.suppressed(), torch.no_grad():
            result["ghost_outputs"] = keep(flatten_output(ghost_model(*clone_inputs(first_inputs))))
        del ghost_model
    del builds

    def integrity() -> dict[str, Any]:
        return {
            "patched": patched_names(watched),
            "hooks_intact": instrument.installed_intact() and threading.Thread.start is start_and_record,
            "threads": sorted(set(started_threads) | {t.name for t in set(threading.enumerate()) - threads_before})
            + side_os_threads(os_threads_before, {main_thread_name, Path("/proc/self/comm").read_text().strip()}, device == "cuda",
                              python_states_before),
        }

    if job.get("gate_path"):
        phase("candidate waiting at the gate")
        result.update(integrity())
        write_result(str(workdir / PARTIAL_FILE), result)
        if wait_for_gate(Path(job["gate_path"]), job["gate_wait_s"], job["parent_pid"]) != "go":
            result["stopped_at_gate"] = True
            return result

    if protocol.profile:
        phase("candidate profiling")
        inputs = clone_inputs(first_inputs)

        def forward() -> Any:
            with torch.no_grad():
                return model(*inputs)

        launched = set(train_launches) | set(result["launches"]["eval"])
        result["profile"] = profile_cuda(forward, launched) if device == "cuda" else profile_cpu(forward, clocks)

    if job.get("window_rounds"):
        with instrument.recording() as log:  # what the windows launched: a report, which can only fail the candidate
            answer_windows(job, workdir, model, get_inputs, protocol, clocks, l2_flush_buffer(protocol, device), phase,
                           job["window_calls"], reference=False)
        result["launches"]["windows"] = sorted(set(log.names) - {SKETCH_KERNEL_NAME})  # the sketch's launches are the judge's

    phase("candidate integrity")
    result.update(integrity())
    return result


def wait_for_judge(path: Path, timeout_s: float, parent: int, poll_s: float = 0.002) -> str | None:
    """The text of the judge's answer at `path` (the gate's go/stop, a timing window's seed).

    The parent kills us on timeout; if the parent itself died (we were re-parented: our
    parent is no longer `parent`, the one we started under) or never answers within the
    timeout, None rather than wait as an orphan.
    """
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if os.getppid() != parent or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
    return path.read_text().strip()


def wait_for_gate(path: Path, timeout_s: float, parent: int) -> str:
    """The parent's go/stop after it compared our correctness outputs ("stop" when none came)."""
    return wait_for_judge(path, timeout_s, parent) or "stop"


def window_calls(forward: Callable[..., Any], get_inputs: Callable[[], Any], device: str, clocks: Clocks,
                 l2: torch.Tensor | None, protocol: Protocol) -> int:
    """The calls of every timing window, chosen by the reference child from a few calls of its own run
    as a window runs them (fresh inputs, the flush, the outputs gathered and sketched): about
    ``WINDOW_TARGET_MS`` of a window on the host's clock, within the bounds. (kgym-16 counted the
    calls' own time alone: a reference of microseconds took 1024 calls a window, 1.5 s of window on
    an H100 for 10 ms of calls, and its stock of windows held the GPU's timing lease for 70 s.) On the
    CPU also at most the protocol's ``perf_trials``: the reference runs torch there and the candidate
    the Triton interpreter, whose calls take 100x as long, so a target reached by the reference's
    calls would take minutes."""
    sample = 3
    tolerance = (protocol.atol, protocol.rtol)

    def draw(call: int) -> list[Any]:
        return make_inputs(get_inputs, trial_seed(protocol.seed, call), device)

    run_window_calls(forward, draw, sample, clocks, l2, protocol.seed, tolerance,  # caches, allocator blocks, clocks
                     sketch_form=protocol.window_sketch)
    started = clocks.perf_counter()
    _, calls_ms = run_window_calls(forward, draw, sample, clocks, l2, protocol.seed, tolerance, sketch_form=protocol.window_sketch)
    call_ms = max(calls_ms, (clocks.perf_counter() - started) * 1e3) / sample
    wanted = math.ceil(WINDOW_TARGET_MS["cuda" if device == "cuda" else "cpu"] / call_ms) if call_ms > 0 else WINDOW_MAX_CALLS
    most = WINDOW_MAX_CALLS if device == "cuda" else min(WINDOW_MAX_CALLS, protocol.perf_trials)
    return max(WINDOW_MIN_CALLS, min(wanted, most))


def draw_chunk(draw: Callable[[int], list[Any]], first: int, calls: int) -> list[list[Any]]:
    """The input sets of calls `first`, `first` + 1, ... (`draw` gives a call's): as many as
    ``WINDOW_MAX_INPUT_BYTES`` holds, at least one, none past `calls`."""
    sets = [draw(first)]
    room = WINDOW_MAX_INPUT_BYTES // max(tensor_bytes(sets[0]), 1)
    sets += [draw(call) for call in range(first + 1, min(calls, first + room))]
    return sets


def run_window_calls(forward: Callable[..., Any], draw: Callable[[int], list[Any]], calls: int, clocks: Clocks,
                     l2: torch.Tensor | None, seed: int, tolerance: tuple[float, float] | None = None,
                     report_variance: bool = False, sketch_form: str = "torch") -> tuple[list[list[dict[str, Any]]], float]:
    """One window's calls, back to back as a GPU queue takes them: their inputs drawn in chunks
    (``draw_chunk``; `draw` gives a call's), each call behind the L2 flush, the host waiting for the
    GPU once before the first and once after the last, then one copy to the host per output
    position (``kpipe.gym.candidate.trial_data.WindowOutputs``, whose positions and sketch signs
    come from `seed`; with `tolerance` every call's sketch variance bound is computed too, and kept
    in the digests with `report_variance`; `sketch_form`: the protocol's ``window_sketch``). Returns each call's output digests and the calls' own
    milliseconds, summed: on a GPU from an event queued behind the flush to one right after the
    call (KernelBench's region), on the CPU the host clock around the call. Read from the
    reference's child only: the judge's clock covers the whole window, whose other work (drawing the
    inputs, the flush, gathering the outputs, the sketch and its variance) both children do alike and
    which cancels (kpipe.gym.judge.evaluation.candidate_window_ms)."""
    gathered: list[WindowOutputs] = []
    events: list[tuple[Any, Any]] = []
    calls_ms = 0.0
    pending: list[list[Any]] = []
    clocks.sync()
    with torch.no_grad():
        for call in range(calls):
            if not pending:
                pending = draw_chunk(draw, call, calls)
            inputs = pending.pop(0)
            flush_l2(l2)
            if clocks.cuda:
                start, end = clocks.event(enable_timing=True), clocks.event(enable_timing=True)
                clocks.record(start)
                outputs = flatten_output(forward(*inputs))
                clocks.record(end)
                events.append((start, end))
            else:
                started = clocks.perf_counter()
                outputs = flatten_output(forward(*inputs))
                calls_ms += (clocks.perf_counter() - started) * 1e3
            if call == 0:
                gathered = [WindowOutputs(output, calls, seed, tolerance, sketch_form) for output in outputs]
            if len(outputs) != len(gathered):
                raise ValueError(f"call {call} returned {len(outputs)} outputs, the first call {len(gathered)}")
            for position, output in zip(gathered, outputs):
                position.put(call, output)
            del outputs, inputs
    clocks.sync()
    calls_ms += sum(float(clocks.elapsed_time(start, end)) for start, end in events)
    columns = [position.digests(report_variance) for position in gathered]
    return [[column[call] for column in columns] for call in range(calls)], calls_ms


def answer_windows(job: dict[str, Any], workdir: Path, forward: Callable[..., Any], get_inputs: Callable[[], Any], protocol: Protocol,
                   clocks: Clocks, l2: torch.Tensor | None, phase: Phase, calls: int, reference: bool,
                   compiled: Callable[..., Any] | None = None) -> list[float]:
    """The judge's timing windows, until it says stop (at most ``job["window_rounds"]``): say we are
    ready, wait for the judge's secret seed, run the calls on fresh input sets drawn from it
    (``run_window_calls``) and write their outputs. The judge clocks everything from revealing the
    seed to the answer's file appearing. Both children do the same work in a window; the
    `reference` child also writes its sketches' variance bounds and its calls' time on its own
    clock, and then, outside the judge's clock, times the ``torch.compile`` baseline (`compiled`) on
    the same inputs; returns those milliseconds, a window each."""
    step = f"{job['role']} timing windows"
    phase(step)  # the phase file names the windows; their steps are timed for the trace alone
    phase(f"{step}: warm-up", announce=False)
    # before the seed, what needs none: the allocator's blocks for the inputs, the protocol's untimed
    # calls (caches, TLB; on a GPU for at least warmup_ms: its clocks dropped while the child
    # waited), and one window's other work on throwaway inputs (the sketch's first matrix-vector
    # product, the copies to the host, the answer's encoding: kgym-15's first window of a
    # candidate took 17-32 ms longer than its second on an H200), so the two children's answers
    # differ by their calls alone
    device = clocks.device
    tolerance = (protocol.atol, protocol.rtol)
    warm = draw_chunk(lambda call: make_inputs(get_inputs, trial_seed(0, call), device), 0, calls)
    warm_until = clocks.perf_counter() + (protocol.warmup_ms / 1e3 if clocks.cuda else 0.0)
    done = 0
    with torch.no_grad():
        while done < max(protocol.warmup, 1) or clocks.perf_counter() < warm_until:
            flush_l2(l2)
            forward(*warm[done % len(warm)])
            if compiled is not None:
                compiled(*warm[done % len(warm)])
            clocks.sync()
            done += 1
    rehearsal, _ = run_window_calls(forward, lambda call: warm[call % len(warm)], min(calls, 2), clocks, l2, 0,
                                    tolerance, reference, protocol.window_sketch)
    encode({"outputs": rehearsal})
    del warm, rehearsal
    compile_ms: list[float] = []
    for index in range(job["window_rounds"]):
        with gc_paused():  # the judge's clock runs from the seed to the answer
            phase(f"{step}: waiting for the judge", announce=False)
            (workdir / WINDOW_READY_FILE.format(round=index)).write_bytes(b"")
            text = wait_for_judge(workdir / WINDOW_FILE.format(round=index), job["gate_wait_s"], job["parent_pid"], WINDOW_POLL_S)
            if text is None:
                raise RuntimeError("the judge sent no timing window")
            asked = json.loads(text)
            if asked.get("stop"):
                break
            seed = int(asked["seed"])

            def draw(call: int) -> list[Any]:
                return make_inputs(get_inputs, trial_seed(seed, call), device)

            phase(f"{step}: calls on fresh inputs, their outputs to the host", announce=False)
            outputs, calls_ms = run_window_calls(forward, draw, calls, clocks, l2, seed, tolerance, reference, protocol.window_sketch)
            phase(f"{step}: writing the answer", announce=False)
            answer: dict[str, Any] = {"outputs": outputs}
            if reference:
                answer.update(calls=calls, calls_ms=calls_ms)
            write_result(str(workdir / WINDOW_ANSWER_FILE.format(round=index)), answer)
        if compiled is not None:
            phase(f"{step}: the torch.compile baseline", announce=False)
            compile_ms.append(run_window_calls(compiled, draw, calls, clocks, l2, seed, sketch_form=protocol.window_sketch)[1])
        del outputs
    return compile_ms


# ----------------------------------------------------------------------------- entry


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def describe_device(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def device_identity(device: str) -> str:
    """Which physical GPU this process ran on, as seen from inside it: its UUID and PCI
    address (nvidia-smi's spelling), so placement can be checked against the pool's plan."""
    if device != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = str(getattr(props, "uuid", ""))
    pci = "{:08X}:{:02X}:{:02X}.0".format(
        getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", 0), getattr(props, "pci_device_id", 0)
    )
    return f"GPU-{uuid} {pci}" if uuid else pci


def write_result(path: str, payload: dict[str, Any]) -> None:
    """`payload` in the exchange format (``kpipe.gym.exchange``), appearing whole at `path`."""
    tmp = f"{path}.tmp"
    Path(tmp).write_bytes(encode(payload))
    os.replace(tmp, path)


def short_path(filename: str, prefixes: list[tuple[str, str]]) -> str:
    """`filename` with the first matching machine-specific prefix replaced by its label."""
    for prefix, label in prefixes:
        if filename.startswith(prefix):
            return label + filename[len(prefix):]
    return filename


def candidate_traceback(exc: BaseException) -> str:
    """The traceback without KernelGym's own frames: what the kernel author needs. Paths are
    shortened (the candidate's file by its name, libraries below ``<site-packages>``): the
    scratch directory and the install location are noise to a model and differ per run."""
    prefixes = sorted(
        [(os.getcwd() + os.sep, ""), *((path + os.sep, "<site-packages>/") for path in site.getsitepackages()),
         (sysconfig.get_paths()["purelib"] + os.sep, "<site-packages>/"), (sysconfig.get_paths()["stdlib"] + os.sep, "<python>/")],
        key=lambda pair: -len(pair[0]),
    )
    summary = traceback.TracebackException.from_exception(exc)
    frames = [f for f in summary.stack if "/kpipe/gym/" not in f.filename]
    for frame in frames:
        frame.filename = short_path(frame.filename, prefixes)
    summary.stack = traceback.StackSummary.from_list(frames)
    return "".join(summary.format())[-6000:]


def settle_process(device: str, protocol: Protocol, limits: dict[str, Any] | None) -> None:
    """What a child sets before anything runs: its limits (a candidate's job's, ``kpipe.gym.confine.limits``;
    none but core dumps off for the reference's and a child still waiting for its job), no secrets in
    its environment, the interpreter on a CPU, cuBLAS's workspace setting (read when cuBLAS starts)."""
    apply_rlimits(limits)
    for name in [k for k in os.environ if is_secret(k)]:
        del os.environ[name]
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if protocol.cublas_workspace_config:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", protocol.cublas_workspace_config)
    else:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    warnings.filterwarnings("ignore")


def prepare_device(device: str, protocol: dict[str, Any]) -> None:
    """A child started before its job (``kpipe.gym.confine.zygote.ZygoteLauncher``) pays here, while it
    waits, what every child's start costs: its CUDA context and torch's lazy state. ``run_child``
    then finds them made; nothing of a candidate has run yet. It also walks what the candidate's
    run snapshots (``watched_objects``), which copies the pages it touches, shared with the zygote
    until then: in a forked child the first walk took 4x the next (10 ms against 2.4 on a CPU host,
    30 ms in a candidate child), and the snapshot itself is still taken just before the candidate loads."""
    settled = Protocol.from_dict(protocol)
    settle_process(device, settled, None)
    prime_lazy_state(device, settled.profile)
    watched_objects()


def run_child(job: dict[str, Any]) -> None:
    """Run one role of an evaluation and write its result file (never raises for a bad
    candidate: the exception is classified and written).

    `job` keys: ``role`` ("reference" | "candidate"), ``reference_src``, ``candidate_src``
    (candidate role), ``protocol`` (``Protocol.to_dict()``), ``device`` ("cuda" | "cpu"),
    ``workdir`` (scratch directory; becomes the cwd), ``result_path``, ``phase_path``
    (optional), ``gate_path`` (optional: stop before timing — a candidate after its
    correctness stage — write ``workdir/partial.safetensors`` and wait for "go"/"stop" in that file, at
    most ``gate_wait_s``: the judge answers "go" once it holds the device's timing lease),
    ``window_rounds`` and, for a candidate, ``window_calls`` (optional: then answer the judge's timing
    windows, ``answer_windows``).
    Sets its rlimits (``kpipe.gym.confine.limits.apply_rlimits``: a candidate's ``limits``) and scrubs
    secrets from ``os.environ`` itself, so a forked child of a warm pool is confined the same way.
    """
    # what is imported by now is never garbage: a collection that walked it (0.1-0.2 s with torch
    # and Triton) would land in whatever this process was timing
    gc.freeze()
    protocol = Protocol.from_dict(job["protocol"])
    job = {**job, "parent_pid": os.getppid()}
    device = job["device"]
    settle_process(device, protocol, job.get("limits"))
    workdir = Path(job["workdir"])
    os.chdir(workdir)
    # read by now; the candidate's code, which runs later in this directory, finds no job file
    for leftover in (JOB_FILE, PREPARATION_FILE):
        (workdir / leftover).unlink(missing_ok=True)
    phase = Phase(job.get("phase_path"))
    started_unix = time.time()
    phase("start (device init)")
    payload: dict[str, Any] = {
        "role": job["role"],
        "device": describe_device(device),
        "device_id": device_identity(device),
        "torch_version": str(torch.__version__),
        "triton_version": str(__import__("triton").__version__),
    }
    device_used_at_start = device_memory_used_mb(device)
    run = run_reference if job["role"] == "reference" else run_candidate
    try:
        payload.update(run(job, protocol, device, workdir, phase))
        payload["status"] = "ok"
    except BaseException as exc:  # noqa: BLE001 - every candidate failure becomes a result
        status, summary = classify_exception(exc)
        payload["status"] = status
        payload["error"] = summary
        payload["traceback"] = candidate_traceback(exc)
        payload["phase"] = Path(job["phase_path"]).read_text() if job.get("phase_path") else ""
    phase("write result", announce=payload["status"] == "ok")
    try:  # instrumentation only (kpipe.gym.judge.evaluation's trace): never part of a verdict
        payload["stats"] = {"phases": phase.durations(), "started_unix": started_unix,
                            "memory": memory_stats(device, device_used_at_start)}
    except BaseException as exc:  # noqa: BLE001 - a candidate that broke torch.cuda loses only its stats
        payload["stats"] = {"error": f"{type(exc).__name__}"}
    write_result(job["result_path"], payload)


def device_memory_used_mb(device: str) -> float | None:
    """Memory in use on the whole GPU (every process: this child's context included), MiB."""
    if device != "cuda":
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def memory_stats(device: str, used_at_start_mb: float | None) -> dict[str, Any]:
    """This child's peak GPU memory and the device's use when it started (what the previous
    evaluations left: the worker and zygote never touch CUDA), and its host peak RSS."""
    stats: dict[str, Any] = {"host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device == "cuda":
        stats.update(device_used_at_start_mb=used_at_start_mb,
                     peak_allocated_mb=torch.cuda.max_memory_allocated() / 2**20,
                     peak_reserved_mb=torch.cuda.max_memory_reserved() / 2**20)
    return stats


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    run_child(job)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: a broken CUDA context or a candidate's atexit hook can hang it
    os._exit(0)


if __name__ == "__main__":
    main()
