"""Imports go one way: from a stage to the stages below it, never up, and never in a circle.

Every ``import kpipe...`` in ``src/kpipe`` is read from the source (function-level imports too:
a lazy import is still a dependency). Command-line modules (``cli.py``, ``*_cli.py``) sit on
top and may import anything; nothing imports them but ``kpipe.cli``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "kpipe"

# bottom to top; a module may import its own layer's modules and those of lower layers
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("infrastructure", ("kpipe.infra",)),
    ("data", ("kpipe.data",)),
    ("gym", ("kpipe.gym",)),
    ("llm", ("kpipe.llm",)),
    ("agent", ("kpipe.agent",)),
    ("train", ("kpipe.train",)),
    ("evaluate", ("kpipe.evaluate",)),
    ("report", ("kpipe.report",)),
    ("workflow", ("kpipe.workflow",)),  # what the Snakefile calls: the run's services
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_cli(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last == "cli" or last.endswith("_cli") or module == "kpipe.__main__"


def layer_of(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def imports_of(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kpipe")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("kpipe"):
                found.add(target)
                # `from kpipe.x import y` may name the submodule kpipe.x.y
                found |= {f"{target}.{a.name}" for a in node.names if (PACKAGE.parent / f"{target}.{a.name}".replace(".", "/")).with_suffix(".py").exists()}
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for target in imports_of(path, module):
            while target not in modules and "." in target:  # `from kpipe.gym import Protocol` -> kpipe.gym
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module:
                targets.add(target)
        edges[module] = targets
    return edges


def test_every_module_has_a_layer_or_is_a_command_line() -> None:
    unplaced = sorted(m for m in graph() if layer_of(m) is None and not is_cli(m) and m != "kpipe")
    assert not unplaced, f"give these modules a layer in LAYERS: {unplaced}"


def test_the_top_level_holds_only_packages_and_the_command() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in {"__init__.py", "cli.py"})
    assert not loose, f"move these into their stage's package: {loose}"


def test_no_module_imports_a_higher_layer() -> None:
    violations = []
    for module, targets in graph().items():
        if is_cli(module) or module == "kpipe":
            continue
        for target in targets:
            if is_cli(target):
                violations.append(f"{module} -> {target} (a command-line module)")
            elif (layer_of(target) or 0) > (layer_of(module) or 0):
                violations.append(f"{module} ({LAYERS[layer_of(module) or 0][0]}) -> {target} ({LAYERS[layer_of(target) or 0][0]})")
    assert not violations, "imports against the layer order:\n" + "\n".join(sorted(violations))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_between_stage_modules() -> None:
    # a package's __init__ re-exporting its submodules is not a circle between stages
    edges = {m: {t for t in ts if not (m.startswith(t + ".") or t.startswith(m + "."))} for m, ts in graph().items()}
    assert cycles(edges) == []


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_circle_finder_finds_circles(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(edges) == expected
