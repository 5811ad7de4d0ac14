"""KernelBench problem sets, vendored under ``data/files/kernelbench`` (MIT, see SOURCE.md).

Two problem sets: ``main`` (upstream main = v0.1 sizes) and ``v0`` (the original Dec 2024
sizes). Results on the two are not comparable, so the version travels with every task id.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kpipe.data.source_text import source_hash

VERSIONS = {"main": "kernelbench.jsonl", "v0": "kernelbench_v0.jsonl"}
LEVELS = (1, 2, 3)  # level 4 downloads model weights at run time: left out


@dataclass(frozen=True)
class Problem:
    version: str
    level: int
    problem_id: int
    name: str
    code: str

    @property
    def task_id(self) -> str:
        return f"kb-{self.version}-L{self.level}-{self.problem_id}"


def load_problems(version: str) -> list[Problem]:
    """All level 1-3 problems of a vendored problem set."""
    if version not in VERSIONS:
        raise ValueError(f"unknown KernelBench version {version!r}; choose one of {sorted(VERSIONS)}")
    path = resources.files("kpipe.data") / "files" / "kernelbench" / VERSIONS[version]
    problems = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["level"] in LEVELS:
            problems.append(Problem(version, row["level"], row["problem_id"], row["name"], row["code"]))
    return problems


def select_problems(version: str, levels: list[int], ids: dict[int, list[int]] | None = None) -> list[Problem]:
    """Problems of the given levels; `ids` maps a level to the problem ids kept (all if absent)."""
    ids = ids or {}
    chosen = [p for p in load_problems(version) if p.level in levels]
    chosen = [p for p in chosen if p.level not in ids or p.problem_id in ids[p.level]]
    known = {(p.level, p.problem_id) for p in chosen}
    missing = [(lvl, i) for lvl, wanted in ids.items() for i in wanted if (lvl, i) not in known]
    if missing:
        raise ValueError(f"KernelBench {version}: no problem(s) {missing} in levels {levels}")
    return chosen


def _constant_value(node: ast.expr) -> Any:
    """The value of a constant expression (``2048 * 2``), or None when it names anything."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        try:
            return eval(compile(ast.Expression(node), "<size>", "eval"), {"__builtins__": {}})
        except Exception:
            return None


def _cap_sizes(node: ast.expr, cap: int) -> ast.expr:
    """`node` with every integer above `cap` replaced by `cap`, looking inside tuples and lists
    (``input_shape = (32768,)``, ``height, width = 128, 128``, ``[1024] * 16``)."""
    value = _constant_value(node)
    if isinstance(value, int) and not isinstance(value, bool):
        return ast.Constant(cap) if value > cap else node
    if isinstance(node, (ast.Tuple, ast.List)):
        node.elts = [_cap_sizes(element, cap) for element in node.elts]
    elif isinstance(node, ast.BinOp) and isinstance(value, (list, tuple)):
        node.left, node.right = _cap_sizes(node.left, cap), _cap_sizes(node.right, cap)
    return node


def _is_name_target(target: ast.expr) -> bool:
    if isinstance(target, ast.Name):
        return True
    return isinstance(target, (ast.Tuple, ast.List)) and all(isinstance(t, ast.Name) for t in target.elts)


def shrink_sizes(code: str, cap: int) -> str:
    """Cap every integer in a problem's module-level size constants at `cap`.

    KernelBench problems declare their sizes as module-level constants (``batch_size =
    128``, ``N = 2048 * 2``, ``input_shape = (32768,)``, ``height, width = 128, 128``) read
    by ``get_inputs``/``get_init_inputs``. Capping them gives the same computation at a
    size the Triton interpreter can run on a CPU in seconds. Integers at or below `cap`
    (kernel sizes, channels, strides) are left alone.
    """
    tree = ast.parse(code)
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(_is_name_target(t) for t in node.targets):
            node.value = _cap_sizes(node.value, cap)
    return ast.unparse(tree)


def task_rows(problems: list[Problem], split: str, size_cap: int | None) -> list[dict[str, Any]]:
    """`tasks` rows for `problems`, with sizes capped when `size_cap` is set."""
    rows = []
    for p in problems:
        code = shrink_sizes(p.code, size_cap) if size_cap else p.code
        rows.append(
            {
                "task_id": p.task_id,
                "source": "kernelbench",
                "version": p.version,
                "size_profile": f"cap{size_cap}" if size_cap else "full",
                "split": split,
                "level": p.level,
                "problem_id": p.problem_id,
                "name": p.name,
                "reference_src": code,
                "reference_hash": source_hash(p.code),
            }
        )
    return rows
