#!/usr/bin/env python
"""Benchmark: what a forked evaluation child pays at its first Triton kernel launch, with and
without the zygote's ``LAUNCH_PRELOAD`` (``kpipe.gym.confine.zygote``).

Each variant is a fresh process that prepares itself as the worker's zygote does (``PRELOAD``,
optionally ``LAUNCH_PRELOAD``, ``warm_triton_compiler`` on a GPU), then forks a child that, after
its device is set up (as ``kpipe.gym.candidate.child``'s "start" phase), compiles and launches two fresh
kernels into an empty cache. Printed per variant: the seconds of the first and of the second
launch (their difference is what the first pays once: lazy imports, runtime helpers) and the
modules the first launch imported. On a CPU, Triton runs through its interpreter. When $OUT is set,
records its report $OUT/triton_first_launch.md and ledger line (``kpipe.infra.ledger``).

    . scripts/device_env.sh && python benchmarks/triton_first_launch.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kpipe.infra import ledger

KERNEL = """
import triton
import triton.language as tl

@triton.jit
def scale_{n}(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor + {n}, mask=mask)
"""


def launch_fresh_kernel(index: int, device: str) -> float:
    """Seconds to compile and launch a kernel this process has never seen (a new source)."""
    import torch

    namespace: dict[str, object] = {}
    text = KERNEL.format(n=index)
    with tempfile.NamedTemporaryFile("w", suffix=".py") as source:  # @triton.jit reads its source file when it decorates
        source.write(text)
        source.flush()
        exec(compile(text, source.name, "exec"), namespace)
    kernel = namespace[f"scale_{index}"]
    x = torch.randn(4096, device=device)
    y = torch.empty_like(x)
    started = time.perf_counter()
    kernel[(4,)](x, y, x.numel(), 2.0, BLOCK=1024)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def one_variant(launch_preload: bool) -> dict[str, object]:
    """This process as a zygote (with or without LAUNCH_PRELOAD), and one forked child's launches."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # as a pool worker's: is_available() leaves the driver alone
    from kpipe.gym.confine import zygote

    zygote.preload(launch_time=launch_preload)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        zygote.warm_triton_compiler()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own empty cache, as a candidate's
        os.close(read_end)
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="first-launch-")
        if device == "cuda":
            torch.cuda.mem_get_info()  # the child's "start (device init)"
        before = set(sys.modules)
        first = launch_fresh_kernel(1, device)
        imported = sorted(set(sys.modules) - before)
        second = launch_fresh_kernel(2, device)
        os.write(write_end, json.dumps({"first_s": first, "second_s": second, "imported": imported}).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        result = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    import triton

    return {"launch_preload": launch_preload, "device": device, "triton": triton.__version__, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", choices=("with", "without"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_variant(args.one == "with")))
        return
    lines, figures = ["# What a forked child pays at its first Triton launch, with and without LAUNCH_PRELOAD", ""], {}
    for variant in ("without", "with"):
        run = subprocess.run([sys.executable, __file__, "--one", variant], capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise SystemExit(f"the {variant} variant failed:\n{run.stderr[-3000:]}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
        tops = sorted({name.rsplit(".", 1)[0] if name.count(".") > 2 else name for name in result["imported"]})
        lines += [f"- {variant} LAUNCH_PRELOAD ({result['device']}, Triton {result['triton']}): first launch "
                  f"{result['first_s']:.3f} s, second {result['second_s']:.3f} s; the first imported "
                  f"{len(result['imported'])} modules", "  " + ", ".join(tops[:60])]
        print("\n".join(lines[-2:]), flush=True)
        figures.update({f"first_s_{variant}": round(result["first_s"], 3), f"second_s_{variant}": round(result["second_s"], 3)})
    if os.environ.get("OUT"):
        ledger.record("triton_first_launch", "\n".join(lines) + "\n", figures, ledger.local_device(),
                      results=Path(os.environ["OUT"]))


if __name__ == "__main__":
    main()
