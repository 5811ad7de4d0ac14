"""The final correctness comparison, done in the parent (where candidate code never ran)."""

from __future__ import annotations

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
    (``kpipe.gym.trial_data.digest``): the full tensors, or for huge outputs the same sampled
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


def compare_norms(candidate: list[Output], reference: list[Output], norm_rtol: float) -> Comparison:
    """Count, shape, dtype and the relative error norm alone, in float32: the timing challenge's
    check. It makes a forger compute and leaves closeness to the correctness trials, so it skips
    their float64 passes over up to 16 calls of full-size outputs."""
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
    return Comparison(True)
