"""The final correctness comparison, done in the parent (where candidate code never ran)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    norm_rtol: float


@dataclass
class Comparison:
    ok: bool
    detail: str = ""  # why not, with max/mean difference
    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None


def relative_error_norm(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """||c - r|| / ||r||: catches zeros (or noise) on outputs smaller than atol."""
    reference_norm = torch.linalg.vector_norm(reference).item()
    if reference_norm == 0.0:
        return 0.0 if torch.count_nonzero(candidate).item() == 0 else float("inf")
    return torch.linalg.vector_norm(candidate - reference).item() / reference_norm


def compare_tensor(candidate: torch.Tensor, reference: torch.Tensor, tol: Tolerance) -> Comparison:
    if candidate.shape != reference.shape:
        return Comparison(False, f"shape {tuple(candidate.shape)} != expected {tuple(reference.shape)}")
    if candidate.dtype != reference.dtype:
        return Comparison(False, f"dtype {candidate.dtype} != expected {reference.dtype}")
    if candidate.numel() == 0:
        return Comparison(True)
    if not (reference.is_floating_point() or reference.is_complex()):
        equal = torch.equal(candidate, reference)
        mismatched = (candidate != reference).sum().item()
        return Comparison(equal, "" if equal else f"{mismatched} of {reference.numel()} integer values differ")
    c, r = candidate.double(), reference.double()
    if torch.isfinite(c).all() and torch.isfinite(r).all():
        return compare_finite(c, r, tol)
    bad_nonfinite = (~torch.isfinite(c) & torch.isfinite(r)).sum().item()
    if bad_nonfinite:
        return Comparison(False, f"{bad_nonfinite} NaN/Inf values where the reference is finite")
    finite = torch.isfinite(r)
    diff = (c - r).abs()[finite] if finite.any() else torch.zeros(1, dtype=torch.float64)
    max_diff, mean_diff = diff.max().item(), diff.mean().item()
    if not torch.allclose(c, r, atol=tol.atol, rtol=tol.rtol, equal_nan=True):
        return Comparison(False, f"max abs diff {max_diff:.3g}, mean abs diff {mean_diff:.3g} (atol={tol.atol}, rtol={tol.rtol})", max_diff, mean_diff)
    return norm_verdict(relative_error_norm(torch.where(finite, c, 0), torch.where(finite, r, 0)), tol, max_diff, mean_diff)


def compare_finite(c: torch.Tensor, r: torch.Tensor, tol: Tolerance) -> Comparison:
    """`compare_tensor` where every value is finite (the common case, and the judge's busiest
    loop): one difference tensor serves the bounds, the closeness test (``torch.allclose``'s
    formula) and the error norm, in a third of the passes."""
    diff = (c - r).abs()
    max_diff, mean_diff = diff.max().item(), diff.mean().item()
    if not bool((diff <= tol.atol + tol.rtol * r.abs()).all()):
        return Comparison(False, f"max abs diff {max_diff:.3g}, mean abs diff {mean_diff:.3g} (atol={tol.atol}, rtol={tol.rtol})", max_diff, mean_diff)
    reference_norm = torch.linalg.vector_norm(r).item()
    if reference_norm == 0.0:
        rel = 0.0 if max_diff == 0.0 else float("inf")
    else:
        rel = torch.linalg.vector_norm(diff).item() / reference_norm
    return norm_verdict(rel, tol, max_diff, mean_diff)


def norm_verdict(rel: float, tol: Tolerance, max_diff: float, mean_diff: float) -> Comparison:
    if rel > tol.norm_rtol:
        return Comparison(False, f"relative error norm {rel:.3g} > {tol.norm_rtol} (max abs diff {max_diff:.3g})", max_diff, mean_diff)
    return Comparison(True, "", max_diff, mean_diff)


Output = torch.Tensor | dict[str, Any]


def paired_tensors(candidate: Output, reference: Output) -> tuple[torch.Tensor, torch.Tensor, str] | Comparison:
    """The two tensors to compare from outputs as the children saved them
    (``kpipe.gym.candidate.trial_data.digest``): the full tensors, or for huge outputs the same sampled
    positions of each (then a note for the detail); a Comparison where shape or dtype differ."""
    c = candidate if isinstance(candidate, dict) else {"full": candidate}
    r = reference if isinstance(reference, dict) else {"full": reference}
    if "full" in r and "full" in c:
        return c["full"], r["full"], ""
    shape = lambda d: list(d["full"].shape) if "full" in d else d["shape"]  # noqa: E731
    dtype = lambda d: str(d["full"].dtype) if "full" in d else d["dtype"]  # noqa: E731
    if shape(c) != shape(r):
        return Comparison(False, f"shape {tuple(shape(c))} != expected {tuple(shape(r))}")
    if dtype(c) != dtype(r):
        return Comparison(False, f"dtype {dtype(c)} != expected {dtype(r)}")
    return c["sample"], r["sample"], f" (on {r['sample'].numel()} sampled elements)"


def compare_output(candidate: Output, reference: Output, tol: Tolerance) -> Comparison:
    pair = paired_tensors(candidate, reference)
    if isinstance(pair, Comparison):
        return pair
    c, r, note = pair
    result = compare_tensor(c, r, tol)
    return result if result.ok else Comparison(False, result.detail + note, result.max_abs_diff, result.mean_abs_diff)


def compare_outputs(candidate: list[Output], reference: list[Output], tol: Tolerance) -> Comparison:
    """All outputs must match in count, shape, dtype and value."""
    if len(candidate) != len(reference):
        return Comparison(False, f"{len(candidate)} output tensors, expected {len(reference)}")
    worst = Comparison(True, "", 0.0, 0.0)
    for index, (c, r) in enumerate(zip(candidate, reference)):
        result = compare_output(c, r, tol)
        if not result.ok:
            prefix = f"output {index}: " if len(reference) > 1 else ""
            return Comparison(False, prefix + result.detail, result.max_abs_diff, result.mean_abs_diff)
        if result.max_abs_diff is not None and result.max_abs_diff >= (worst.max_abs_diff or 0.0):
            worst = result
    return worst


# a window's sketch (kpipe.gym.candidate.trial_data.sketch) may differ from the reference's by this many
# standard deviations of the difference that outputs within the elementwise tolerance give (whose
# errors do not know the secret signs): an honest output fails with probability below 1e-15
SKETCH_DEVIATIONS = 8.0


def compare_sketch(candidate: dict[str, Any], reference: dict[str, Any]) -> str:
    """Why a huge output's sketch departs from the reference's (empty: it does not). Without it, a
    candidate that knows which positions are sampled computes only those; with it, every element
    counts: leaving a fraction f of a standard-normal output at zero moves each sketch by a normal
    variable of deviation about sqrt(3 f n) against a bound of about 0.3 sqrt(n) at atol = rtol = 1e-2;
    each of the independent sign patterns (``SKETCH_PATTERNS``) must hold, so f above a few per cent fails
    all but about 1e-11 of the time (one pattern alone let a full forgery through 17-22 % of its calls)."""
    variance = float(reference["sketch_variance"])
    for got, expected in zip(candidate["sketch"], reference["sketch"], strict=True):  # one a secret sign pattern
        got, expected = float(got), float(expected)
        if not (math.isfinite(expected) and math.isfinite(variance)):  # a reference with NaN/Inf: no bound to hold
            return ""
        bound = SKETCH_DEVIATIONS * math.sqrt(variance) + 1e-6 * abs(expected)  # float32 sums, the same order on both sides
        if not abs(got - expected) <= bound:  # NaN fails too
            return f"its sketch over every element is {got:.6g}, expected {expected:.6g} +- {bound:.3g}"
    return ""


def compare_norms(candidate: list[Output], reference: list[Output], norm_rtol: float) -> Comparison:
    """Count, shape, dtype, the relative error norm in float32 and, for a huge output, its sketch
    over every element (``compare_sketch``): a timing window's check of every call. It makes a
    forger compute and leaves closeness to the correctness trials (an honest kernel at the edge of
    atol failed one of 16 fresh calls elementwise on an H200)."""
    if len(candidate) != len(reference):
        return Comparison(False, f"{len(candidate)} output tensors, expected {len(reference)}")
    for index, (candidate_output, reference_output) in enumerate(zip(candidate, reference)):
        pair = paired_tensors(candidate_output, reference_output)
        prefix = f"output {index}: " if len(reference) > 1 else ""
        if isinstance(pair, Comparison):
            return Comparison(False, prefix + pair.detail)
        c, r, note = pair
        if c.shape != r.shape or c.dtype != r.dtype:
            return Comparison(False, f"{prefix}shape/dtype {tuple(c.shape)} {c.dtype} != expected {tuple(r.shape)} {r.dtype}{note}")
        if c.numel() == 0:
            continue
        if not (r.is_floating_point() or r.is_complex()):
            if not torch.equal(c, r):
                return Comparison(False, f"{prefix}integer values differ{note}")
            continue
        if c.dtype in (torch.float16, torch.bfloat16):
            c, r = c.float(), r.float()
        finite = torch.isfinite(r)
        if not bool(finite.all()):
            c, r = torch.where(finite, c, 0), torch.where(finite, r, 0)
        rel = relative_error_norm(c, r)
        if not rel <= norm_rtol:  # NaN fails too
            return Comparison(False, f"{prefix}relative error norm {rel:.3g} > {norm_rtol}{note}")
        if isinstance(reference_output, dict) and "sketch" in reference_output:
            why = compare_sketch(candidate_output, reference_output) if isinstance(candidate_output, dict) and "sketch" in candidate_output \
                else "it has no sketch"
            if why:
                return Comparison(False, f"{prefix}{why}")
    return Comparison(True)
