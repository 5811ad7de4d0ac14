"""A bank of known Triton solutions for KernelBench (`main` problem set) tasks, with known bugs.

Each task directory (``L{level}_{KernelBench name}``) holds a correct ``ModelNew`` whose work
is done by Triton kernels (``legit``) and realistic buggy variants. The bank gives the
evaluator's tests ground truth, the GPU check its workload, and the offline teacher its
answers, so every program is a plain candidate with nothing bank-specific.

Only the legit programs are written out, as ``legit.py``; a buggy variant is the same program
with a bug or two, so it is declared, not copied. Each task's ``variants.toml`` lists, under
each variant's name, the exact edits (``[[wrong_index]]``: ``old`` -> ``new``) that turn its
legit program, less the module docstring (the expected-speedup note a buggy program has not
earned), into that variant. ``old`` must occur exactly once in the program it edits and no
two edits of one program overlap, so an edit cannot land anywhere but where it was meant;
`_load_bank` makes the programs in memory. The GEMM-with-epilogue tasks of level 2 share one
kernel: their legit programs are declared the same way, as ``[[legit]]`` edits of the
``legit.py`` named by ``legit_from`` (L2_63's), rather than six copies of one GEMM. Every
buggy variant of the bank is such an edit, so none stays a file. To read a generated program:
``python -c "from kpipe.gym.bank import solutions_for; print(solutions_for(2, 9)[0].source)"``.

Two likenesses stay, because each program must read as a whole candidate a model would write:
L1_1 (a plain ``A @ B`` GEMM: no epilogue, B stored K x N, its own names) opens with the same
grouped tile order as L2_63, but deriving it would edit half its lines; and L2_14's two kernels
(a column sum and a GEMV) are two different reductions with loops of one shape.

Expected statuses are for the shrunk problem `shrink_sizes(code, SHRUNK_CAP)`: 48 is not a
multiple of the blocks the masks guard, so every tail is exercised. At the full KernelBench
sizes the masked dimensions are multiples of the blocks, so a missing tail mask is latent
there: `expected_status_full` says what a full-size run should give. Outputs an unwritten
element would leave wrong are caught only when allocations start poisoned (NaN), as the
evaluator's protocol and `harness.check_candidate` do.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable

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
class Edit:
    """Replace `old`, which occurs exactly once in the program edited, by `new`."""

    old: str
    new: str


@dataclass(frozen=True)
class Solution:
    task_name: str
    level: int
    problem_id: int
    variant: str
    expected_status: str
    source: str
    expected_status_full: str
    base: str = field(repr=False)  # the program `edits` turn into `source` (`source` itself for a legit.py)
    edits: tuple[Edit, ...] = field(repr=False)

    @property
    def key(self) -> str:
        """A stable id, e.g. ``L2_76/missing_mask``."""
        return f"L{self.level}_{self.problem_id}/{self.variant}"


def apply_edits(program: str, edits: Iterable[Edit]) -> str:
    """`program` with every edit made, each found in `program` itself (not in another edit's result)."""
    spans = []
    for edit in edits:
        start = program.find(edit.old)
        if not edit.old or start < 0 or program.find(edit.old, start + 1) >= 0:
            raise ValueError(f"edit {edit.old!r} must occur exactly once in the program it edits")
        spans.append((start, start + len(edit.old), edit.new))
    pieces, end = [], 0
    for start, stop, new in sorted(spans):
        if start < end:
            raise ValueError(f"edits overlap at {program[start:stop]!r}")
        pieces += [program[end:start], new]
        end = stop
    return "".join(pieces) + program[end:]


def without_docstring(program: str) -> str:
    """`program` less its module docstring: a buggy variant claims no expected speedup."""
    first = ast.parse(program).body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return "".join(program.splitlines(keepends=True)[first.end_lineno:])
    return program


def _full_size_status(variant: str) -> str:
    """Every dimension of the bank's tasks at full size is a multiple of the blocks its masks guard."""
    return "pass" if variant == "missing_mask" else VARIANT_STATUS[variant]


def _task_programs(root: Traversable, task_dir: Traversable) -> dict[str, tuple[str, tuple[Edit, ...]]]:
    """Each variant declared for a task -> (the program it edits, its edits), legit first."""
    declared = tomllib.loads((task_dir / "variants.toml").read_text())
    legit_dir = root / declared.pop("legit_from", task_dir.name)
    edits = {variant: tuple(Edit(**edit) for edit in entries) for variant, entries in declared.items()}
    if unknown := set(edits) - set(VARIANTS):
        raise ValueError(f"{task_dir.name}/variants.toml: unknown variants {sorted(unknown)}")
    legit_base, legit_edits = (legit_dir / "legit.py").read_text(), edits.pop("legit", ())
    bare_legit = without_docstring(apply_edits(legit_base, legit_edits))
    return {"legit": (legit_base, legit_edits)} | {v: (bare_legit, edits[v]) for v in VARIANTS if v in edits}


@cache
def _load_bank() -> tuple[Solution, ...]:
    root = resources.files(__name__)
    solutions = []
    for task_dir in sorted(root.iterdir(), key=lambda p: p.name):
        match = _TASK_DIR.match(task_dir.name)
        if not task_dir.is_dir() or not match:
            continue
        for variant, (base, edits) in _task_programs(root, task_dir).items():
            solutions.append(
                Solution(
                    task_name=match["name"],
                    level=int(match["level"]),
                    problem_id=int(match["problem_id"]),
                    variant=variant,
                    expected_status=VARIANT_STATUS[variant],
                    source=apply_edits(base, edits),
                    expected_status_full=_full_size_status(variant),
                    base=base,
                    edits=edits,
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
