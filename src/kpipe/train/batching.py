"""What SFT and RL share about batches: data order, micro-batching under a token budget, precision, config typing.

Both trainers run the same kind of step (length-grouped micro-batches under a token budget, every
process as many passes as the busiest, bf16 on a GPU), so they take these from here rather than
one trainer reaching into the other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

PRECISIONS = ("auto", "bf16", "fp16", "no")


def accepted_types(annotation: str) -> tuple[type, ...]:
    """Python types a config field accepts, from its annotation string (ints are fine as floats)."""
    names = {"float": (int, float), "int": (int,), "str": (str,), "bool": (bool,), "None": (type(None),)}
    accepted: tuple[type, ...] = ()
    for part in annotation.split("|"):
        part = part.strip()
        accepted += (tuple,) if part.startswith("tuple") else names[part]
    return accepted


def resolve_precision(requested: str) -> str | None:
    """'auto' means bf16 on GPU and fp32 on CPU, unless an accelerate config already chose."""
    if requested != "auto":
        return requested
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None  # let Accelerator read the launcher's choice
    return "bf16" if torch.cuda.is_available() else "no"


def steps_per_epoch(n_samples: int, batch_size: int) -> int:
    """Optimizer steps per pass over the data (a partial last batch is a step)."""
    return math.ceil(n_samples / batch_size)


def batch_indices(n_samples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Sample indices of the global batch of optimizer step `step`: a fresh permutation per epoch."""
    per_epoch = steps_per_epoch(n_samples, batch_size)
    epoch, position = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n_samples)
    return order[position * batch_size:(position + 1) * batch_size].tolist()


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group indices into micro-batches of similar length whose padded size (count × longest) fits the budget.

    Sorting by length first keeps padding small; a sample longer than the budget runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for index in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def max_over_processes(accelerator: Any, value: int) -> int:
    """The largest `value` of all processes: FSDP gathers parameters in every forward pass, so each
    process must run as many passes as the busiest one."""
    return int(accelerator.reduce(torch.tensor([value], device=accelerator.device), "max").item())
