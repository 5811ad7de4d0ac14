#!/usr/bin/env python
"""Benchmark: how much slower one process's host work gets when N processes do it at once.

KernelGym's evaluations are mostly host work (the candidate's Triton compile with ptxas and gcc,
fork and exit, imports), and a GPU's two workers leave its timed region idle most of the time
(``docs/gpu-results/gym_scaling_*``). So how far more GPUs add up is bounded by how one process's
host work slows when more run beside it on the same machine. This measures that bound with no
kpipe code involved: N fresh processes (N = each of ``--levels``), started together, each on GPU
``i mod GPUs``, each timing in order:

- ``python loop``: a fixed pure-Python loop (the core's own speed under load);
- ``import torch, triton``;
- ``CUDA init``: its first CUDA tensor (a context);
- ``first kernel``: compile and launch a new Triton kernel with ``tl.dot`` into an empty cache (the
  compiler's first use in the process, ptxas, and gcc of the signature's launcher where Triton
  builds one), as a candidate's first trial does;
- ``new kernel``: another new kernel of another signature (its compile, ptxas and launcher);
- ``same signature``: a new kernel with the second's signature (its compile and ptxas; the launcher
  is cached where Triton keys it by signature);
- ``exit``: from its last line to its exit seen by this process (the CUDA context's teardown).

``--env NAME=VALUE`` sets a variable in every process (to try a CUDA setting, for example;
``--env CUDA_VISIBLE_DEVICES=0`` puts every process on one GPU).

Printed per N: the median and the slowest process's seconds of each step, and the median's ratio
to N = 1. One process runs first, not reported, so the page cache is warm for every level. Host facts (cores, CPU model, cgroup CPU limit) first. On a machine without a GPU the
kernel steps are skipped.

    python benchmarks/host_contention.py --levels 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from triton_first_launch import KERNEL as SCALE_KERNEL  # benchmarks/ is this script's directory

from kpipe.infra import ledger

LOOP_N = 12_000_000
DOT_KERNEL = """
import triton
import triton.language as tl

@triton.jit
def dot_{n}(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :], mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :], mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    acc = tl.where(acc > 0, acc, acc * 0.01) + {n}
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
"""
STEPS = ("python loop", "import torch, triton", "CUDA init", "first kernel", "new kernel", "same signature", "exit")


def load_kernel(template: str, tag: int, scratch: Path):
    """A @triton.jit function from a new source file (Triton reads the source where it decorates)."""
    path = scratch / f"kernel_{tag}.py"
    path.write_text(template.format(n=tag))
    namespace: dict[str, object] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return next(value for name, value in namespace.items() if name.endswith(f"_{tag}"))


def one_process(go_file: str, tag: int) -> dict[str, float]:
    """The steps of one process, once `go_file` exists (every process of a level starts together)."""
    while not os.path.exists(go_file):
        time.sleep(0.002)
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    total = 0
    for i in range(LOOP_N):
        total += i * i
    seconds["python loop"] = time.perf_counter() - started

    started = time.perf_counter()
    import torch
    import triton

    seconds["import torch, triton"] = time.perf_counter() - started
    if not torch.cuda.is_available():
        return seconds
    started = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    seconds["CUDA init"] = time.perf_counter() - started

    scratch = Path(tempfile.mkdtemp(prefix="host-contention-"))
    a, b = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    c = torch.empty(256, 256, device="cuda")
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    started = time.perf_counter()
    load_kernel(DOT_KERNEL, tag, scratch)[(4, 4)](a, b, c, 256, 256, 256, BM=64, BN=64, BK=32)
    torch.cuda.synchronize()
    seconds["first kernel"] = time.perf_counter() - started
    started = time.perf_counter()
    load_kernel(SCALE_KERNEL, tag, scratch)[(4,)](x, y, x.numel(), 2.0, BLOCK=1024)
    torch.cuda.synchronize()
    seconds["new kernel"] = time.perf_counter() - started
    started = time.perf_counter()
    load_kernel(SCALE_KERNEL, tag + 1_000_000, scratch)[(4,)](x, y, x.numel(), 2.0, BLOCK=1024)
    torch.cuda.synchronize()
    seconds["same signature"] = time.perf_counter() - started
    assert triton.__version__
    return seconds


def report_and_exit(seconds: dict[str, float]) -> None:
    """The result line, flushed, then the exit (its teardown timed by the parent from the line)."""
    sys.stdout.write(json.dumps(seconds) + "\n")
    sys.stdout.flush()


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def host_facts() -> dict[str, str]:
    facts = {"cores (sched_getaffinity)": str(len(os.sched_getaffinity(0)))}
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
        facts["CPU"] = model
    except (OSError, StopIteration):
        pass
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if Path(path).exists():
            facts[f"cgroup {path}"] = Path(path).read_text().strip()
    facts["GPUs"] = str(gpu_count())
    return facts


def run_level(count: int, gpus: int, extra_env: dict[str, str]) -> list[dict[str, float]]:
    """`count` fresh processes started together, each with an empty Triton cache."""
    with tempfile.TemporaryDirectory(prefix="host-contention-level-") as root:
        go_file = os.path.join(root, "go")
        processes = []
        for index in range(count):
            env = {**os.environ, **extra_env, "TRITON_CACHE_DIR": os.path.join(root, f"cache-{index}"), "PYTHONDONTWRITEBYTECODE": "1"}
            if gpus and "CUDA_VISIBLE_DEVICES" not in extra_env:
                env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
            processes.append(subprocess.Popen(
                [sys.executable, __file__, "--child", go_file, str(1000 * count + index)],
                env=env, stdout=subprocess.PIPE, text=True))
        time.sleep(1.0)  # every interpreter started and waiting
        Path(go_file).touch()
        results: list[dict[str, float]] = [{} for _ in processes]

        def collect(index: int) -> None:
            """One process's line, then its exit timed from that line (a thread each: no process
            waits to be read while another's exit is timed)."""
            process = processes[index]
            line = process.stdout.readline()  # type: ignore[union-attr]
            seen = time.perf_counter()
            if process.wait() == 0 and line:
                results[index] = {**json.loads(line), "exit": time.perf_counter() - seen}

        threads = [threading.Thread(target=collect, args=(index,)) for index in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if not all(results):
            raise RuntimeError(f"a process of level {count} failed")
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,2,4,8,16", help="how many processes at once, comma-separated")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="set in every process")
    parser.add_argument("--child", nargs=2, metavar=("GO_FILE", "TAG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        report_and_exit(one_process(args.child[0], int(args.child[1])))
        return
    for name, value in host_facts().items():
        print(f"{name}: {value}")
    gpus = gpu_count()
    levels = [int(level) for level in args.levels.split(",")]
    medians: dict[int, dict[str, float]] = {}
    extra_env = dict(item.split("=", 1) for item in args.env)
    report: dict[str, object] = {"host": host_facts(), "env": extra_env, "levels": {}}
    lines = ["# How one process's host work slows with others beside it", "",
             "`benchmarks/host_contention.py " + " ".join(sys.argv[1:]) + "`; host: "
             + ", ".join(f"{name} {value}" for name, value in report["host"].items()), ""]  # type: ignore[union-attr]
    run_level(1, gpus, extra_env)  # not reported: warms the page cache (imports) and the driver, as a machine in use is
    for count in levels:
        results = run_level(count, gpus, extra_env)
        steps = [step for step in STEPS if step in results[0]]
        if count == levels[0]:
            lines += ["| processes at once | " + " | ".join(f"{step}: median (slowest) s, median / first level's" for step in steps) + " |",
                      "|---" * (len(steps) + 1) + "|"]
            print("\n" + "\n".join(lines[-2:]))
        medians[count] = {step: statistics.median(r[step] for r in results) for step in steps}
        report["levels"][str(count)] = results  # type: ignore[index]
        base = medians[levels[0]]
        cells = [f"{medians[count][step]:.3f} ({max(r[step] for r in results):.3f}) ×{medians[count][step] / base[step]:.2f}"
                 for step in steps]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    if out := os.environ.get("OUT"):
        Path(out).mkdir(parents=True, exist_ok=True)
        suffix = "".join(f"_{name}={value}" for name, value in extra_env.items())
        (Path(out) / f"host_contention{suffix}.json").write_text(json.dumps(report, indent=1))
        last = levels[-1]
        figures = {f"{step}_x{last}": round(medians[last][step] / medians[levels[0]][step], 2) for step in medians[last]}
        ledger.record("host_contention", "\n".join(lines) + "\n", {**extra_env, **figures}, ledger.local_device(),
                      results=Path(out))


if __name__ == "__main__":
    main()
