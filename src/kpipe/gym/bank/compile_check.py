"""Compile a candidate's Triton kernels for an NVIDIA target on a machine without a GPU.

The Triton interpreter runs kernels as NumPy code, so it misses errors only the compiler
sees (a non-constexpr block size, a loop-carried variable that changes type, `tl.dot`
shape rules) and says nothing about whether the full-size launch configuration fits the
GPU. Here `forward` runs at the full KernelBench size on meta tensors (no memory, no
compute); every kernel launch is intercepted and compiled to a cubin for the target with
the launch's own constexprs, `num_warps` and `num_stages`, using the ptxas bundled with
Triton. Triton must have been imported without TRITON_INTERPRET: `compile_in_subprocess`
sees to that.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kpipe.gym.bank.harness import load_module

H100_SHARED_MEMORY_BYTES = 232_448  # 227 KiB: the most one block may use on sm_90
_DTYPE_NAMES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
    torch.bool: "i1",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@dataclass(frozen=True)
class KernelBuild:
    name: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    uses_tensor_cores: bool


@dataclass(frozen=True)
class CompileReport:
    ok: bool
    kernels: tuple[KernelBuild, ...] = ()
    error: str = ""


def argument_type(value: Any) -> str:
    """Triton's signature type of one launch argument."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPE_NAMES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument of type {type(value).__name__}")


def _compile_launch(kernel: Any, args: tuple, kwargs: dict, arch: int) -> KernelBuild:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound.arguments[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = argument_type(value)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return KernelBuild(
        name=kernel.__name__,
        num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages,
        shared_bytes=compiled.metadata.shared,
        uses_tensor_cores="mma" in compiled.asm["ptx"],
    )


def compile_launches(reference_src: str, candidate_src: str, arch: int = 90) -> CompileReport:
    """Run `forward` on full-size meta inputs and compile every kernel it launches for `sm_{arch}`."""
    import triton.compiler.code_generator  # noqa: F401  (its imports fail under the meta device below)
    from triton.runtime.jit import JITFunction

    builds: list[KernelBuild] = []

    def compile_instead_of_launch(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        builds.append(_compile_launch(self, args, kwargs, arch))

    saved_run = JITFunction.run
    JITFunction.run = compile_instead_of_launch  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp, torch.device("meta"), torch.no_grad():
            reference = load_module(reference_src, "bank_reference", Path(tmp))
            candidate = load_module(candidate_src, "bank_candidate", Path(tmp))
            candidate.ModelNew(*reference.get_init_inputs())(*reference.get_inputs())
    except Exception as error:
        return CompileReport(False, tuple(builds), traceback.format_exception_only(error)[-1].strip()[-500:])
    finally:
        JITFunction.run = saved_run  # type: ignore[method-assign]
    if not builds:
        return CompileReport(False, (), "forward launched no Triton kernel")
    too_big = [b for b in builds if b.shared_bytes > H100_SHARED_MEMORY_BYTES]
    if too_big:
        return CompileReport(False, tuple(builds), f"{too_big[0].name} needs {too_big[0].shared_bytes} B of shared memory")
    return CompileReport(True, tuple(builds))


def _interpreter_loaded() -> bool:
    """Under TRITON_INTERPRET=1 at import, Triton's own `@jit` helpers (`tl.cdiv`...) cannot be compiled."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return not isinstance(tl.cdiv, JITFunction)


def compile_in_subprocess(
    pairs: list[tuple[str, str]], arch: int = 90, timeout_s: float = 600.0
) -> list[CompileReport]:
    """`compile_launches` for each (reference, candidate) pair in one fresh Python without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        request, response = Path(tmp) / "request.json", Path(tmp) / "response.json"
        request.write_text(json.dumps({"arch": arch, "pairs": pairs}))
        result = subprocess.run(
            [sys.executable, "-m", __name__, str(request), str(response)],
            env=env, capture_output=True, text=True, timeout=timeout_s,
        )
        if result.returncode != 0:
            raise RuntimeError(f"compile check process failed: {result.stderr[-2000:]}")
        reports = json.loads(response.read_text())
    return [
        CompileReport(r["ok"], tuple(KernelBuild(**k) for k in r["kernels"]), r["error"]) for r in reports
    ]


def main(request_path: str, response_path: str) -> None:
    if _interpreter_loaded():
        raise SystemExit("compile_check: unset TRITON_INTERPRET, Triton was imported in interpreter mode")
    request = json.loads(Path(request_path).read_text())
    reports = [compile_launches(ref, cand, request["arch"]) for ref, cand in request["pairs"]]
    Path(response_path).write_text(json.dumps([asdict(r) for r in reports]))


if __name__ == "__main__":
    main(*sys.argv[1:])
