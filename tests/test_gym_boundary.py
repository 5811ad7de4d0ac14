"""KernelGym is split at its trust boundary (issue 62): what runs inside the candidate's process
(``kpipe.gym.candidate``) imports nothing from the judge (``kpipe.gym.judge``) or serving
(``kpipe.gym.serve``), directly or through any kpipe module it imports.

The imports are read from the source (``ast``): every import of a module reached, function-level
ones too (a lazy import still runs in the process that calls the function), but not those under
``if TYPE_CHECKING:`` (never run). Importing a module runs its parent packages' ``__init__`` too:
their module-level imports are walked as well (a function of theirs, such as ``kpipe.gym``'s lazy
``__getattr__`` for ``evaluate``, runs only when called). Confinement's modules may run in the
candidate's process (the sandbox is entered there, the child sets its own limits), so they may be
reached; they are held to the same rule. Below serving the layers go one way: confinement imports
neither the judge nor serving, the judge no serving.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
CANDIDATE = "kpipe.gym.candidate"
FORBIDDEN = ("kpipe.gym.judge", "kpipe.gym.serve")


def module_path(root: Path, module: str) -> Path | None:
    base = root / Path(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(root: Path, module: str, module_level_only: bool = False) -> set[str]:
    """The kpipe modules `module` imports (each resolved to a module or package that exists)."""
    path = module_path(root, module)
    if path is None:
        return set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            # `from kpipe.gym.judge import evaluation` names the submodule
            found.update(f"{target}.{alias.name}" for alias in node.names if module_path(root, f"{target}.{alias.name}"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    kept = set()
    for name in found:
        while name.startswith("kpipe") and module_path(root, name) is None and "." in name:
            name = name.rpartition(".")[0]  # `from kpipe.gym import Protocol` -> kpipe.gym
        if name.startswith("kpipe") and module_path(root, name) is not None:
            kept.add(name)
    return kept


def parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def reached(root: Path, starts: list[str]) -> dict[str, list[str]]:
    """Every kpipe module that importing `starts` and calling their functions can run, each with
    the chain of imports that reaches it. A parent package is walked for its module-level imports;
    what those import, and every other module reached, whole."""
    chains: dict[str, list[str]] = {}
    whole: set[str] = set()
    module_level: set[str] = set()
    todo = [(start, [start], True) for start in starts]
    while todo:
        module, chain, all_of_it = todo.pop()
        if module in whole or (not all_of_it and module in module_level):
            continue
        (whole if all_of_it else module_level).add(module)
        chains.setdefault(module, chain)
        todo.extend((parent, [*chain, parent], False) for parent in parents(module))
        todo.extend((target, [*chain, target], True) for target in imported(root, module, module_level_only=not all_of_it))
    return chains


def package_modules(root: Path, package: str = CANDIDATE) -> list[str]:
    directory = root / Path(*package.split("."))
    return sorted(package if p.name == "__init__.py" else f"{package}.{p.stem}" for p in directory.glob("*.py"))


def violations(root: Path, package: str = CANDIDATE, forbidden: tuple[str, ...] = FORBIDDEN) -> list[str]:
    found = []
    for module, chain in reached(root, package_modules(root, package)).items():
        if any(module == f or module.startswith(f + ".") for f in forbidden):
            found.append(" -> ".join(chain))
    return sorted(found)


def test_the_candidates_side_imports_nothing_of_the_judge_or_serving() -> None:
    modules = package_modules(SRC)
    assert f"{CANDIDATE}.child" in modules and f"{CANDIDATE}.instrument" in modules
    assert violations(SRC) == []


@pytest.mark.parametrize("package, forbidden", [
    ("kpipe.gym.confine", ("kpipe.gym.judge", "kpipe.gym.serve")),
    ("kpipe.gym.judge", ("kpipe.gym.serve",)),
])
def test_the_layers_below_serving_import_no_layer_above(package: str, forbidden: tuple[str, ...]) -> None:
    """Confinement starts the children and imports neither the judge nor serving; the judge
    imports no serving (the pool calls ``evaluate``, never the reverse)."""
    assert violations(SRC, package, forbidden) == []


def test_the_walk_reaches_what_the_child_imports() -> None:
    """The walk is not vacuous: it follows the child into the shared modules and confinement."""
    modules = reached(SRC, [f"{CANDIDATE}.child"])
    assert {"kpipe.gym.protocol", "kpipe.gym.exchange", "kpipe.gym.confine.limits", f"{CANDIDATE}.trial_data", "kpipe.gym"} <= set(modules)


@pytest.mark.parametrize("line, where", [
    ("from kpipe.gym.judge.compare import compare_outputs", "module"),
    ("from kpipe.gym.judge import feedback", "module"),
    ("import kpipe.gym.serve.pool", "function"),
    ("from ..judge import screen", "module"),
    ("from kpipe.gym.serve.cache import ResultCache", "shared"),
    ("from kpipe.gym.judge.result import EvalResult", "package"),
])
def test_an_import_of_the_judge_fails_the_walk(tmp_path: Path, line: str, where: str) -> None:
    """A planted import of the judge or serving, directly, lazily, relatively, through a shared
    module or the package's own ``__init__``, is found; the same tree without it passes."""
    gym = tmp_path / "kpipe" / "gym"
    for package in ("kpipe", "kpipe/gym", "kpipe/gym/candidate", "kpipe/gym/judge", "kpipe/gym/serve"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    for name in ("judge/compare", "judge/feedback", "judge/screen", "judge/result", "serve/pool", "serve/cache"):
        (gym / f"{name}.py").write_text("X = 1\n")
    (gym / "protocol.py").write_text("X = 1\n")
    (gym / "candidate" / "child.py").write_text("from kpipe.gym.protocol import X\n")
    assert violations(tmp_path) == []
    if where == "module":
        (gym / "candidate" / "child.py").write_text(f"from kpipe.gym.protocol import X\n{line}\n")
    elif where == "function":
        (gym / "candidate" / "child.py").write_text(f"def f():\n    {line}\n")
    elif where == "shared":
        (gym / "protocol.py").write_text(f"def f():\n    {line}\n")
    else:
        (gym / "__init__.py").write_text(f"{line}\n")
    assert violations(tmp_path), "the planted import was not found"
    if where == "package":  # under TYPE_CHECKING, or in a function of the package, it does not run on import
        (gym / "__init__.py").write_text(f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {line}\ndef __getattr__(name):\n    {line}\n")
        assert violations(tmp_path) == []


@pytest.mark.slow
def test_a_candidate_process_loads_no_module_of_the_judge() -> None:
    """What the forked or fresh child actually imports, in a fresh interpreter."""
    probe = textwrap.dedent("""
        import sys
        import kpipe.gym.candidate.child, kpipe.gym.confine.sandbox
        loaded = sorted(m for m in sys.modules if m.startswith(("kpipe.gym.judge", "kpipe.gym.serve")))
        print(loaded)
    """)
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert run.stdout.strip() == "[]", run.stdout
