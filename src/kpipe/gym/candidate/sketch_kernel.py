"""The sketch of a timing window's output (``kpipe.gym.candidate.trial_data.sketch``) as one Triton kernel.

Both children pay the sketch inside every timed call, so it is the bulk of a window's fixed cost on
a large output, and that cost's noise is read as the candidate's time (kgym-19's torch form, about 13
passes and 25 launches; kgym-18's 25 passes read fast candidates of 67 M-element outputs 21-29 % slower
than KernelBench's harness on an H100). The kernel reads each element once: each program sums g(x) = x|x|
down its columns of the secret patterns' period and accumulates the variance bound
((2|x| + t) t)^2, t = atol + rtol |x|, elementwise (the formula itself, not its power sums); the
patterns' matrix-vector product and the programs' partial bounds follow in two torch ops.

It runs where the protocol's ``window_sketch`` is "kernel" (not the default: on an H100 the windows it left
short read fast candidates of 67 M-element outputs further from KernelBench's harness, docs/kernelgym.md,
Known limits). Its launches are the judge's, not the candidate's: ``kpipe.gym.candidate.child`` leaves
``KERNEL_NAME`` out of what a candidate's windows launched, and
``kpipe.gym.confine.compile_caches`` seeds a candidate's private compile cache with the trusted
children's build of it, so no candidate pays its compilation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns a program sums (a period of 2^20 is 1024 programs: every SM busy)
KERNEL_NAME = "kgym_output_sketch"
# output dtypes the kernel reads (as float32, as the torch form does); others take the torch form
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def kgym_output_sketch(x_ptr, columns_ptr, partial_variance_ptr, numel, period, rows, atol, rtol, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    columns = program * BLOCK + tl.arange(0, BLOCK)
    in_period = columns < period
    column_sum = tl.zeros([BLOCK], dtype=tl.float32)
    variance = tl.zeros([BLOCK], dtype=tl.float32)
    pointers = x_ptr + columns
    left = numel  # elements from this row's start to the output's end
    for _ in range(rows):
        x = tl.load(pointers, mask=in_period & (columns < left), other=0.0).to(tl.float32)
        x = tl.where(x == x, x, 0.0)  # torch.nan_to_num(nan=0, posinf=3e38, neginf=-3e38)
        x = tl.where(x == float("inf"), 3e38, x)
        x = tl.where(x == -float("inf"), -3e38, x)
        u = tl.abs(x)
        column_sum += x * u
        t = atol + rtol * u
        w = (2.0 * u + t) * t
        variance += tl.where(in_period & (columns < left), w * w, 0.0)
        pointers += period
        left -= period
    tl.store(columns_ptr + columns, column_sum, mask=in_period)
    tl.store(partial_variance_ptr + program, tl.sum(variance, axis=0))


def sketch_by_kernel(flat: torch.Tensor, signs: torch.Tensor, atol: float = 0.0, rtol: float = 0.0,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``trial_data.sketch``'s [S_1 .. S_k, V] from one read of `flat` (a floating-point tensor of
    ``KERNEL_DTYPES``, on a GPU or under the Triton interpreter), in `out` where given."""
    flat = flat.reshape(-1).contiguous()
    patterns, period = signs.shape
    programs = triton.cdiv(period, BLOCK)
    column_sums = torch.empty(period, dtype=torch.float32, device=flat.device)
    partial_variance = torch.empty(programs, dtype=torch.float32, device=flat.device)
    kgym_output_sketch[(programs,)](flat, column_sums, partial_variance, flat.numel(), period,
                                     triton.cdiv(flat.numel(), period), float(atol), float(rtol), BLOCK=BLOCK)
    total = torch.empty(patterns + 1, dtype=torch.float32, device=flat.device) if out is None else out
    torch.mv(signs, column_sums, out=total[:patterns])
    torch.sum(partial_variance, 0, out=total[patterns])
    return total
