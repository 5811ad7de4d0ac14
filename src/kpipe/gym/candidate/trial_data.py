"""A trial's data: seeded inputs on the device, and the outputs flattened and digested for the
judge's comparison (a correctness trial's: whole, or a bounded sample of a huge output; a timing
window's: ``WindowOutputs``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def trial_seed(protocol_seed: int, trial: int) -> int:
    """Inputs of correctness trial `trial`: fresh per trial, identical in both children."""
    return protocol_seed * 7919 + trial


def to_device(value: Any, device: str) -> Any:
    """Move tensors to `device` keeping their dtype (integer inputs stay integers)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def make_inputs(get_inputs: Callable[[], list[Any]], seed: int, device: str) -> list[Any]:
    """Seeded inputs created on the device itself (multi-GB KernelBench inputs are slow to
    draw on the host); both children draw them identically."""
    torch.manual_seed(seed)
    with torch.device(device):
        return [to_device(v, device) for v in get_inputs()]


def clone_inputs(inputs: list[Any]) -> list[Any]:
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in inputs]


def copy_inputs(destination: list[Any], source: list[Any]) -> None:
    """Refresh input values in place: same pointers, new contents (defeats pointer caches)."""
    for dst, src in zip(destination, source):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)


def flatten_output(output: Any) -> list[torch.Tensor]:
    """A forward's result as a list of tensors (tuples flattened, Python scalars wrapped)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in flatten_output(item)]
    if isinstance(output, (bool, int, float)):
        return [torch.tensor(output)]
    raise TypeError(f"forward returned {type(output).__name__}, expected tensors")


def subclass_outputs(outputs: list[torch.Tensor]) -> list[str]:
    return [type(t).__name__ for t in outputs if type(t) not in (torch.Tensor, torch.nn.Parameter)]


@functools.lru_cache(maxsize=8)
def sample_positions(numel: int, count: int, seed: int) -> torch.Tensor:
    """Flat positions compared for a huge output: its head and tail (where missing masks
    show) and random positions in between, identical in both children (cached: every trial
    of one evaluation samples the same positions)."""
    edge = min(count // 4, numel // 2)
    generator = torch.Generator().manual_seed(seed)
    middle = torch.randint(0, numel, (count - 2 * edge,), generator=generator)
    return torch.cat([torch.arange(edge), middle, torch.arange(numel - edge, numel)])


def digest(outputs: list[torch.Tensor], max_elements: int, seed: int) -> list[dict[str, Any]]:
    """What the parent compares: a plain CPU copy of each output, or for outputs above
    `max_elements` (multi-GB KernelBench outputs) a sample at `sample_positions`."""
    digests = []
    for tensor in outputs:
        tensor = tensor.detach().as_subclass(torch.Tensor)  # subclasses are reported separately
        if tensor.numel() <= max_elements:
            digests.append({"full": tensor.to("cpu", copy=True)})
            continue
        positions = sample_positions(tensor.numel(), max_elements, seed).to(tensor.device)
        digests.append({
            "sample": tensor.reshape(-1)[positions].cpu(),
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype),
        })
    return digests


def tensor_bytes(values: Any) -> int:
    """The bytes of the tensors in `values` (inputs or outputs, nested as forwards take and return them)."""
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (list, tuple)):
        return sum(tensor_bytes(value) for value in values)
    return 0


# a timing window's outputs (``WindowOutputs``): up to this many elements travel whole; a larger output
# travels as this many positions drawn from the window's secret seed, and its sketch (``sketch``)
WINDOW_FULL_ELEMENTS = 1 << 12
# a sketch's signs: a secret pattern of this many, drawn from the window's seed and repeated over the
# output (a sign per element of an 8 GB output would not fit beside it)
SKETCH_PERIOD = 1 << 20
# independent sign patterns a sketch is taken under: one output that departs from the reference's (a
# forger's zeros beyond the sampled positions) lands within the bound of one pattern 17-22 % of the time
# (relu and normal outputs of 2^20 elements at atol = rtol = 1e-2, measured), of all 16 about 1e-11; the
# patterns share the output's one pass (its column sums) and cost a matrix-vector product each
SKETCH_PATTERNS = 16


def sketch_signs(count: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """``SKETCH_PATTERNS`` x `count` signs +-1 (float32, on `device`) drawn from `seed`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 2, (SKETCH_PATTERNS, count), generator=generator, device=device).to(torch.float32) * 2 - 1


def sketch(flat: torch.Tensor, signs: torch.Tensor, atol: float = 0.0, rtol: float = 0.0,
           out: torch.Tensor | None = None, form: str = "torch") -> torch.Tensor:
    """[S_1 .. S_k, V] (float32, on the output's device): S_p = sum_i s_pi g(x_i), g(x) = x|x|, over every
    element of `flat`, s_p the p-th of the secret sign patterns `signs` repeated; V = sum_i ((2|x_i| + t_i) t_i)^2,
    t_i = atol + rtol |x_i|, the variance of each S_p's difference for outputs within the elementwise tolerance
    of x (what the reference reports: the judge's bound, kpipe.gym.judge.compare.compare_sketch); NaN counts
    as 0 and infinities as +-3e38. g is not linear: a linear sketch of a product can be had without the
    product (Freivalds).

    Both children pay it inside every timed call, so it is the bulk of a window's fixed cost on a large output,
    and that cost's noise is read as the candidate's time. With `form` "kernel" (the protocol's
    ``window_sketch``) a GPU reads a floating-point output once in one Triton kernel
    (kpipe.gym.candidate.sketch_kernel); otherwise ``sketch_by_torch``. With `out`, written there (a window's
    row: no allocation or copy between its calls)."""
    if form == "kernel" and flat.is_cuda:
        from kpipe.gym.candidate.sketch_kernel import KERNEL_DTYPES, sketch_by_kernel

        if flat.dtype in KERNEL_DTYPES:
            return sketch_by_kernel(flat, signs, atol, rtol, out)
    total = sketch_by_torch(flat, signs, atol, rtol)
    return total if out is None else out.copy_(total)


def sketch_by_torch(flat: torch.Tensor, signs: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> torch.Tensor:
    """``sketch`` in torch ops: about 13 passes over the output (about 3 ms a call of 67 M elements on an H100
    at kgym-18's 25). The patterns share g's column sums (rows of the patterns' length); V comes from the
    power sums of u = |x|, V = A^2 S4 + 2AB S3 + (B^2 + 2AC) S2 + 2BC S1 + n C^2 with A = (2 + rtol) rtol,
    B = 2 atol (1 + rtol), C = atol^2: every term non-negative, so nothing cancels (within 2e-7 of the
    elementwise formula in float64 at 6.7e7 normal elements on the CPU, and 2e-3 where the CPU's BLAS dot
    accumulates in float32), and S2, S3, S4 are dot products of x and g (u^2 = x x, u^3 = g x, u^4 = g g)
    that write nothing."""
    x = torch.nan_to_num(flat.float(), nan=0.0, posinf=3e38, neginf=-3e38).reshape(-1)
    patterns, period = signs.shape
    u = x.abs()
    g = x * u
    whole = g.numel() // period * period
    total = torch.zeros(patterns + 1, dtype=torch.float32, device=flat.device)
    total[:patterns] = signs @ g[:whole].view(-1, period).sum(0) + signs[:, :g.numel() - whole] @ g[whole:]
    if atol or rtol:
        a, r = float(atol), float(rtol)
        A, B, C = (2 + r) * r, 2 * a * (1 + r), a * a
        total[patterns] = (A * A * torch.dot(g, g) + 2 * A * B * torch.dot(g, x) + (B * B + 2 * A * C) * torch.dot(x, x)
                           + 2 * B * C * u.sum() + x.numel() * C * C)
    return total


class WindowOutputs:
    """One output position of a timing window's calls, gathered on the device as the calls run and
    brought to the host in one copy at the end. Every call's output is checked: whole up to
    ``WINDOW_FULL_ELEMENTS``, else at positions drawn from the window's secret seed plus its sketch
    over every element (``sketch``), so computing only some positions fails. `tolerance`: also each
    call's sketch variance bound, which both children compute (the same work on both sides of the
    judge's clock) and only the reference's reports. Each output is read when its call returns,
    since a kernel may hand back a buffer its next call reuses."""

    def __init__(self, first: torch.Tensor, calls: int, seed: int, tolerance: tuple[float, float] | None = None,
                 sketch_form: str = "torch") -> None:
        self.shape, self.dtype, self.tolerance, self.sketch_form = tuple(first.shape), first.dtype, tolerance, sketch_form
        numel = first.numel()
        self.positions = None
        if numel > WINDOW_FULL_ELEMENTS:
            generator = torch.Generator().manual_seed(seed)
            self.positions = torch.randint(0, numel, (WINDOW_FULL_ELEMENTS,), generator=generator).to(first.device)
        width = self.shape if self.positions is None else (WINDOW_FULL_ELEMENTS,)
        self.buffer = torch.empty((calls, *width), dtype=first.dtype, device=first.device)
        self.sketches = torch.zeros((calls, SKETCH_PATTERNS + 1), dtype=torch.float32, device=first.device)
        self.signs = None if self.positions is None else sketch_signs(min(numel, SKETCH_PERIOD), seed ^ 0x5EED, first.device)

    def put(self, call: int, output: torch.Tensor) -> None:
        output = output.detach().as_subclass(torch.Tensor)
        if tuple(output.shape) != self.shape or output.dtype != self.dtype:  # copy_ would broadcast or cast
            raise ValueError(f"call {call} returned {tuple(output.shape)} {output.dtype}, the first call {self.shape} {self.dtype}")
        if self.positions is None:
            self.buffer[call].copy_(output)
            return
        flat = output.reshape(-1)  # the judge's work between two calls: as few launches as it can be
        torch.index_select(flat, 0, self.positions, out=self.buffer[call])
        sketch(flat, self.signs, *(self.tolerance or (0.0, 0.0)), out=self.sketches[call], form=self.sketch_form)

    def digests(self, report_variance: bool) -> list[dict[str, Any]]:
        host = self.buffer.to("cpu")
        if self.positions is None:
            return [{"full": row} for row in host.unbind(0)]
        sketches = self.sketches.to("cpu").tolist()
        return [{"sample": row, "shape": list(self.shape), "dtype": str(self.dtype), "sketch": values[:-1],
                 **({"sketch_variance": values[-1]} if report_variance else {})}
                for row, values in zip(host.unbind(0), sketches)]


def fingerprint(inputs: list[Any]) -> list[tuple[float, float]]:
    """Cheap, copy-free summary of the input values (to notice a forward writing into them)."""
    prints = []
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.numel():
            accumulate = torch.float64 if value.is_floating_point() else torch.int64
            total = torch.nansum(value, dtype=accumulate) if value.is_floating_point() else value.sum(dtype=accumulate)
            spread = torch.linalg.vector_norm(torch.nan_to_num(value) if value.is_floating_point() else value.double(), dtype=torch.float64)
            prints.append((float(total), float(spread)))
    return prints
