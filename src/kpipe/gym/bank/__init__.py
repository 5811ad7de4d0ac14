"""A bank of known Triton solutions for KernelBench (`main` problem set) tasks, with known bugs.

Each task directory (``L{level}_{KernelBench name}``) holds ``legit.py`` — a correct
``ModelNew`` whose work is done by Triton kernels — and realistic buggy variants. The bank
gives the evaluator's tests ground truth, the GPU check its workload, and the offline
teacher its answers, so the files are plain candidate programs with nothing bank-specific.

Expected statuses are for the shrunk problem `shrink_sizes(code, SHRUNK_CAP)`: 48 is not a
multiple of the blocks the masks guard, so every tail is exercised. At the full KernelBench
sizes the masked dimensions are multiples of the blocks, so a missing tail mask is latent
there: `expected_status_full` says what a full-size run should give. Outputs an unwritten
element would leave wrong are caught only when allocations start poisoned (NaN), as the
evaluator's protocol and `harness.check_candidate` do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

VARIANT_STATUS = {
    "legit": "pass",
    "compile_error": "compilation_error",
    "wrong_index": "mismatch",
    "missing_mask": "mismatch",
    "wrong_dtype": "mismatch",
}
VARIANTS = tuple(VARIANT_STATUS)
SHRUNK_CAP = 48

_TASK_DIR = re.compile(r"^L(?P<level>[12])_(?P<name>(?P<problem_id>\d+)_\w+)$")


@dataclass(frozen=True)
class Solution:
    task_name: str
    level: int
    problem_id: int
    variant: str
    expected_status: str
    source: str
    expected_status_full: str

    @property
    def key(self) -> str:
        """A stable id, e.g. ``L2_76/missing_mask``."""
        return f"L{self.level}_{self.problem_id}/{self.variant}"


def _full_size_status(variant: str) -> str:
    """Every dimension of the bank's tasks at full size is a multiple of the blocks its masks guard."""
    return "pass" if variant == "missing_mask" else VARIANT_STATUS[variant]


@cache
def _load_bank() -> tuple[Solution, ...]:
    root = resources.files(__name__)
    solutions = []
    for task_dir in sorted(root.iterdir(), key=lambda p: p.name):
        match = _TASK_DIR.match(task_dir.name)
        if not task_dir.is_dir() or not match:
            continue
        level, problem_id = int(match["level"]), int(match["problem_id"])
        for variant in VARIANTS:
            file = task_dir / f"{variant}.py"
            if not file.is_file():
                continue
            solutions.append(
                Solution(
                    task_name=match["name"],
                    level=level,
                    problem_id=problem_id,
                    variant=variant,
                    expected_status=VARIANT_STATUS[variant],
                    source=file.read_text(),
                    expected_status_full=_full_size_status(variant),
                )
            )
    return tuple(solutions)


def list_solutions(variant: str | None = None) -> list[Solution]:
    """Every solution of the bank, or only those of one variant ("legit", "compile_error", ...)."""
    if variant is not None and variant not in VARIANT_STATUS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    return [s for s in _load_bank() if variant is None or s.variant == variant]


def solutions_for(level: int, problem_id: int) -> list[Solution]:
    """The legit solution and buggy variants of one KernelBench task (empty if not in the bank)."""
    return [s for s in _load_bank() if (s.level, s.problem_id) == (level, problem_id)]


BANK_TASKS: list[tuple[int, int]] = sorted({(s.level, s.problem_id) for s in _load_bank()})
