"""The fork server warms Triton's compiler on the host: nothing left behind, nothing started.

Each check runs in a fresh interpreter without the Triton interpreter setting, as a GPU worker's
zygote starts: Triton reads TRITON_INTERPRET once, when it is imported, and the pytest process
that runs this module may already have imported it under the interpreter the suite sets (then
compiling for a GPU fails on an assertion in triton.experimental.gluon, whichever test ran first)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def run_fresh(body: str, directory: Path) -> None:
    """`body` as a script (Triton's @jit reads its source from a file) in a new Python process whose
    Triton compiles (TRITON_INTERPRET=0); its assertions are this test's."""
    script = directory / "check.py"
    script.write_text(textwrap.dedent(body))
    scratch = directory / "tmp"  # its own temporary directory: another test's zygote warms its compiler meanwhile
    scratch.mkdir()
    done = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "0", "TMPDIR": str(scratch)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_warming_the_compiler_leaves_no_trace_and_no_cuda_state(tmp_path: Path) -> None:
    run_fresh("""
        import os
        import tempfile
        from pathlib import Path

        import torch

        from kpipe.gym.confine.zygote import warm_triton_compiler


        def os_threads() -> int:
            return len(os.listdir("/proc/self/task"))


        environment = dict(os.environ)
        scratch_before = {p.name for p in Path(tempfile.gettempdir()).glob("kpipe-zygote-warm-*")}
        threads = os_threads()
        assert warm_triton_compiler()
        assert dict(os.environ) == environment  # the children's cache variables are the job's, untouched here
        assert {p.name for p in Path(tempfile.gettempdir()).glob("kpipe-zygote-warm-*")} == scratch_before
        assert os_threads() == threads  # a forking process must not have started threads
        assert not torch.cuda.is_initialized()
    """, tmp_path)


def test_the_compiler_it_warmed_compiles_for_the_gpu(tmp_path: Path) -> None:
    """What the warm-up exercises is the path a child's first kernel takes: a GPU binary
    compiled on the host (ptxas included), before any device exists."""
    run_fresh("""
        import os
        import tempfile

        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from kpipe.gym.confine.zygote import warm_triton_compiler


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
    """, tmp_path)
