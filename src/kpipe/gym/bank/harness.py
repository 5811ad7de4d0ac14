"""A minimal correctness check of a bank candidate against its KernelBench reference.

It is not the evaluator (`kpipe.gym.evaluate` is): no sandbox, no hacking checks, no
timing. It exists so the bank can be verified on its own — both models built from the
same seed, run on the same seeded inputs, compared the way KernelBench does — on the CPU
through the Triton interpreter or at full size on a GPU.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kpipe.gym.confine.zygote import LAUNCH_PRELOAD

TOLERANCE = 1e-2  # KernelBench's atol = rtol for fp32 problems


@dataclass(frozen=True)
class Outcome:
    status: str  # pass | mismatch | runtime_error | compilation_error | crashed | timeout
    detail: str = ""


def load_module(source: str, name: str, directory: Path) -> ModuleType:
    """Import `source` from a real file: `triton.jit` reads kernel source through `inspect`."""
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


class PoisonedAllocations(TorchFunctionMode):
    """Fill what the candidate allocates with NaN, so an output element it never writes cannot pass."""

    ALLOCATORS = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in self.ALLOCATORS and result.is_floating_point():
            result.fill_(float("nan"))
        return result


def _to_device(values: list[Any], device: str) -> list[Any]:
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def _is_compile_error(error: BaseException) -> bool:
    """Triton front-end errors: `CompilationError` when compiling, `InterpreterError` under TRITON_INTERPRET=1."""
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"CompilationError", "InterpreterError"})


def relative_norm_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||: catches wrong outputs that hide under atol when outputs are tiny."""
    return ((actual - expected).norm() / expected.norm().clamp_min(torch.finfo(torch.float32).tiny)).item()


def compare_outputs(expected: Any, actual: Any) -> Outcome:
    """KernelBench's allclose, plus exact shape and dtype and a relative-norm guard (softmax outputs are ~1e-6)."""
    if not isinstance(actual, torch.Tensor):
        return Outcome("mismatch", f"output is {type(actual).__name__}, expected a tensor")
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return Outcome(
            "mismatch", f"output {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
        )
    actual, expected = actual.double().cpu(), expected.double().cpu()
    diff = (actual - expected).abs().nan_to_num(nan=float("inf"))
    if not torch.allclose(actual, expected, atol=TOLERANCE, rtol=TOLERANCE):
        return Outcome("mismatch", f"max abs diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}")
    relative_error = relative_norm_error(actual, expected)
    if relative_error > TOLERANCE:
        return Outcome("mismatch", f"relative norm error {relative_error:.3g} (max abs diff {diff.max().item():.3g})")
    return Outcome("pass")


def check_candidate(reference_src: str, candidate_src: str, device: str = "cpu", seed: int = 0) -> Outcome:
    """Build reference and candidate from the same seed, run both on the same inputs, compare."""
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        reference = load_module(reference_src, "bank_reference", Path(tmp))
        try:
            candidate = load_module(candidate_src, "bank_candidate", Path(tmp))
        except SyntaxError as error:
            return Outcome("compilation_error", f"SyntaxError: {error}")
        torch.manual_seed(seed)
        reference_model = reference.Model(*reference.get_init_inputs()).to(device)
        torch.manual_seed(seed)
        try:
            candidate_model = candidate.ModelNew(*reference.get_init_inputs()).to(device)
        except Exception as error:
            return Outcome("runtime_error", f"building ModelNew: {error!r}")
        torch.manual_seed(seed)
        inputs = _to_device(reference.get_inputs(), device)
        expected = reference_model(*[v.clone() if isinstance(v, torch.Tensor) else v for v in inputs])
        try:
            with PoisonedAllocations():
                actual = candidate_model(*[v.clone() if isinstance(v, torch.Tensor) else v for v in inputs])
            if device != "cpu":
                torch.cuda.synchronize()
        except Exception as error:
            status = "compilation_error" if _is_compile_error(error) else "runtime_error"
            tail = traceback.format_exception_only(error)[-1].strip()
            return Outcome(status, tail[-500:])
        return compare_outputs(expected, actual)


def _child(connection: Any, reference_src: str, candidate_src: str, device: str, seed: int) -> None:
    connection.send(check_candidate(reference_src, candidate_src, device, seed))


def check_isolated(
    reference_src: str, candidate_src: str, device: str = "cpu", seed: int = 0, timeout_s: float = 300.0
) -> Outcome:
    """`check_candidate` in a child process: a buggy kernel that corrupts memory cannot take the caller down.

    Children come from a fork server that imported torch and Triton but never ran an op: forking a
    process whose OpenMP pool is running makes the child hang in its first parallel torch op. It
    also imports what Triton's first kernel launch would (``LAUNCH_PRELOAD``), which every child
    would otherwise import anew (the fork server skips a module this Triton lacks).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "triton", "triton.language", *LAUNCH_PRELOAD])
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(sender, reference_src, candidate_src, device, seed))
    child.start()
    sender.close()
    if not receiver.poll(timeout_s):
        child.kill()
        child.join()
        return Outcome("timeout", f"no result after {timeout_s:.0f}s")
    try:
        outcome: Outcome = receiver.recv()
    except EOFError:
        child.join()
        return Outcome("crashed", f"child exited with code {child.exitcode}")
    child.join()
    return outcome
