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
    bad_nonfinite = (~torch.isfinite(c) & torch.isfinite(r)).sum().item()
    if bad_nonfinite:
        return Comparison(False, f"{bad_nonfinite} NaN/Inf values where the reference is finite")
    finite = torch.isfinite(r)
    diff = (c - r).abs()[finite] if finite.any() else torch.zeros(1, dtype=torch.float64)
    max_diff, mean_diff = diff.max().item(), diff.mean().item()
    if not torch.allclose(c, r, atol=tol.atol, rtol=tol.rtol, equal_nan=True):
        return Comparison(False, f"max abs diff {max_diff:.3g}, mean abs diff {mean_diff:.3g} (atol={tol.atol}, rtol={tol.rtol})", max_diff, mean_diff)
    rel = relative_error_norm(torch.where(finite, c, 0), torch.where(finite, r, 0))
    if rel > tol.norm_rtol:
        return Comparison(False, f"relative error norm {rel:.3g} > {tol.norm_rtol} (max abs diff {max_diff:.3g})", max_diff, mean_diff)
    return Comparison(True, "", max_diff, mean_diff)


Output = torch.Tensor | dict[str, Any]


def compare_output(candidate: Output, reference: Output, tol: Tolerance) -> Comparison:
    """Compare two outputs as the children saved them (``kpipe.gym.trial_data.digest``): full
    tensors, or for huge outputs the same sampled positions of each."""
    c = candidate if isinstance(candidate, dict) else {"full": candidate}
    r = reference if isinstance(reference, dict) else {"full": reference}
    if "full" in r and "full" in c:
        return compare_tensor(c["full"], r["full"], tol)
    shape = lambda d: list(d["full"].shape) if "full" in d else d["shape"]  # noqa: E731
    dtype = lambda d: str(d["full"].dtype) if "full" in d else d["dtype"]  # noqa: E731
    if shape(c) != shape(r):
        return Comparison(False, f"shape {tuple(shape(c))} != expected {tuple(shape(r))}")
    if dtype(c) != dtype(r):
        return Comparison(False, f"dtype {dtype(c)} != expected {dtype(r)}")
    result = compare_tensor(c["sample"], r["sample"], tol)
    return result if result.ok else Comparison(False, f"{result.detail} (on {r['sample'].numel()} sampled elements)", result.max_abs_diff, result.mean_abs_diff)


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
