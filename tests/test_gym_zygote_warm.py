"""The fork server warms Triton's compiler on the host: nothing left behind, nothing started."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from kpipe.gym.zygote import warm_triton_compiler


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote of a GPU worker runs without the interpreter the test suite sets."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_warming_the_compiler_leaves_no_trace_and_no_cuda_state() -> None:
    environment = dict(os.environ)
    scratch_before = {p.name for p in Path(tempfile.gettempdir()).glob("kpipe-zygote-warm-*")}
    threads = os_threads()
    assert warm_triton_compiler()
    assert dict(os.environ) == environment  # the children's cache variables are the job's, untouched here
    assert {p.name for p in Path(tempfile.gettempdir()).glob("kpipe-zygote-warm-*")} == scratch_before
    assert os_threads() == threads  # a forking process must not have started threads
    assert not torch.cuda.is_initialized()


def test_the_compiler_it_warmed_compiles_for_the_gpu() -> None:
    """What the warm-up exercises is the path a child's first kernel takes: a GPU binary
    compiled on the host (ptxas included), before any device exists."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def double(x_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * 2)

    assert warm_triton_compiler()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            compiled = triton.compile(ASTSource(double, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 64}),
                                      target=GPUTarget("cuda", 90, 32))
        finally:
            del os.environ["TRITON_CACHE_DIR"]
    assert compiled.asm["cubin"] and "double" in compiled.asm["ptx"]
