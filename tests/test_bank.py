"""The bank of known solutions: legit kernels pass, each buggy variant fails the way it claims.

Runs every bank program in the Triton interpreter on shrunk sizes (`SHRUNK_CAP`), and compiles
every kernel for an H100 (sm_90) at the full KernelBench size without a GPU. Programs declared
as edits (`variants.toml`) differ from the program they edit exactly where the edits say.
"""

import ast
from difflib import SequenceMatcher

import pytest
import torch

from kpipe.data.kernelbench import select_problems, shrink_sizes
from kpipe.gym.bank import (
    BANK_TASKS,
    SHRUNK_CAP,
    VARIANTS,
    Edit,
    apply_edits,
    list_solutions,
    solutions_for,
    without_docstring,
)
from kpipe.gym.bank.compile_check import H100_SHARED_MEMORY_BYTES, compile_in_subprocess
from kpipe.gym.bank.harness import check_isolated, compare_outputs, load_module

PROBLEMS = {(p.level, p.problem_id): p for p in select_problems("main", [1, 2])}
SOLUTIONS = list_solutions()
TENSOR_CORE_GEMMS = {(1, 1), (2, 9), (2, 12), (2, 59), (2, 63), (2, 76), (2, 86)}


def reference_code(level: int, problem_id: int, cap: int | None = SHRUNK_CAP) -> str:
    code = PROBLEMS[(level, problem_id)].code
    return shrink_sizes(code, cap) if cap else code


def test_bank_covers_enough_tasks_of_both_levels():
    levels = [level for level, _ in BANK_TASKS]
    assert levels.count(1) >= 6 and levels.count(2) >= 6
    for level, problem_id in BANK_TASKS:
        solutions = solutions_for(level, problem_id)
        assert solutions[0].task_name == PROBLEMS[(level, problem_id)].name
        variants = {s.variant for s in solutions}
        assert "legit" in variants and len(variants - {"legit"}) >= 3, (level, problem_id, variants)


def test_lookup_api():
    assert {s.variant for s in list_solutions("legit")} == {"legit"}
    assert len(list_solutions("legit")) == len(BANK_TASKS)
    assert solutions_for(3, 1) == []
    with pytest.raises(ValueError, match="unknown variant"):
        list_solutions("off_by_one")
    missing_mask = list_solutions("missing_mask")[0]
    assert missing_mask.expected_status == "mismatch" and missing_mask.expected_status_full == "pass"


def _changed_lines(before: str, after: str) -> set[int]:
    """Lines of `before` a line diff to `after` replaces or deletes (or, for an insertion, follows)."""
    ops = SequenceMatcher(None, before.splitlines(), after.splitlines(), autojunk=False).get_opcodes()
    return {i for tag, i1, i2, _, _ in ops if tag != "equal" for i in (range(i1, i2) if i2 > i1 else [i1 - 1])}


def _lines_of(program: str, text: str) -> set[int]:
    first = program[: program.index(text)].count("\n")
    return set(range(first, first + text.rstrip("\n").count("\n") + 1))


@pytest.mark.parametrize("solution", [s for s in SOLUTIONS if s.edits], ids=lambda s: s.key)
def test_a_declared_program_differs_from_its_base_exactly_by_its_edits(solution):
    changed = _changed_lines(solution.base, solution.source)
    declared = [_lines_of(solution.base, edit.old) for edit in solution.edits]
    assert changed <= set().union(*declared), "changed outside the declared edits"
    assert all(lines & changed for lines in declared), "a declared edit that changes nothing"


def test_a_buggy_variant_edits_its_legit_program_less_the_docstring():
    legit = {(s.level, s.problem_id): s.source for s in list_solutions("legit")}
    for solution in SOLUTIONS:
        if solution.variant != "legit":
            base = without_docstring(legit[(solution.level, solution.problem_id)])
            assert solution.base == base and solution.edits, solution.key
            assert legit[(solution.level, solution.problem_id)].endswith(base) and "Expected H100" not in base


def test_an_edit_must_occur_exactly_once_and_not_overlap_another():
    program = "a = 1\nb = 1\n"
    assert apply_edits(program, [Edit("b = 1", "b = 2"), Edit("a", "c")]) == "c = 1\nb = 2\n"
    for edits in ([Edit("= 1", "= 2")], [Edit("z", "y")], [Edit("", "y")], [Edit("a = 1", ""), Edit("1\nb", "")]):
        with pytest.raises(ValueError):
            apply_edits(program, edits)


def _method(tree: ast.Module, class_name: str, method: str) -> ast.FunctionDef:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)


def _function_args(tree: ast.Module, class_name: str, method: str) -> list[str]:
    return [a.arg for a in _method(tree, class_name, method).args.args]


@pytest.mark.parametrize("solution", list_solutions("legit"), ids=lambda s: s.key)
def test_legit_is_a_well_formed_candidate(solution):
    tree = ast.parse(solution.source)
    reference = ast.parse(PROBLEMS[(solution.level, solution.problem_id)].code)
    assert _function_args(tree, "ModelNew", "__init__") == _function_args(reference, "Model", "__init__")
    assert len(_function_args(tree, "ModelNew", "forward")) == len(_function_args(reference, "Model", "forward"))
    assert any(isinstance(n, ast.Try) for n in ast.walk(tree)) is False
    assert "@triton.jit" in solution.source and "Expected H100 speedup" in solution.source
    forward = _method(tree, "ModelNew", "forward")
    calls = {n.func.attr for n in ast.walk(forward) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not calls & {"matmul", "mm", "addmm", "linear", "relu", "softmax", "sum", "mean", "layer_norm", "gelu"}


@pytest.mark.parametrize("solution", list_solutions("legit"), ids=lambda s: s.key)
def test_same_seed_gives_the_reference_parameters(solution, tmp_path):
    reference = load_module(reference_code(solution.level, solution.problem_id), "ref", tmp_path)
    candidate = load_module(solution.source, "cand", tmp_path)
    torch.manual_seed(3)
    expected = reference.Model(*reference.get_init_inputs()).state_dict()
    torch.manual_seed(3)
    actual = candidate.ModelNew(*reference.get_init_inputs()).state_dict()
    assert list(actual) == list(expected)
    assert all(torch.equal(actual[k], expected[k]) for k in expected)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda s: s.key)
def test_solution_behaves_as_labelled_in_the_interpreter(solution):
    outcome = check_isolated(reference_code(solution.level, solution.problem_id), solution.source, seed=1)
    assert outcome.status == solution.expected_status, outcome.detail


@pytest.fixture(scope="module")
def h100_builds():
    chosen = [s for s in SOLUTIONS if s.variant in ("legit", "compile_error")]
    pairs = [(reference_code(s.level, s.problem_id, cap=None), s.source) for s in chosen]
    return dict(zip([s.key for s in chosen], compile_in_subprocess(pairs, arch=90)))


@pytest.mark.parametrize("solution", list_solutions("legit"), ids=lambda s: s.key)
def test_legit_compiles_for_h100_at_full_size(solution, h100_builds):
    report = h100_builds[solution.key]
    assert report.ok, report.error
    assert all(k.shared_bytes <= H100_SHARED_MEMORY_BYTES for k in report.kernels)
    if (solution.level, solution.problem_id) in TENSOR_CORE_GEMMS:
        assert any(k.uses_tensor_cores for k in report.kernels), "a GEMM that misses the tensor cores"


@pytest.mark.parametrize("solution", list_solutions("compile_error"), ids=lambda s: s.key)
def test_compile_error_fails_to_compile_for_h100(solution, h100_builds):
    report = h100_builds[solution.key]
    assert not report.ok and report.error


def test_comparison_rejects_what_allclose_alone_lets_through():
    tiny = torch.full((4, 1000), 1e-4)
    assert compare_outputs(tiny, torch.zeros_like(tiny)).status == "mismatch"  # within atol, wrong
    assert compare_outputs(tiny, tiny.half()).status == "mismatch"
    assert compare_outputs(tiny, tiny.reshape(1000, 4)).status == "mismatch"
    assert compare_outputs(tiny, torch.full_like(tiny, float("nan"))).status == "mismatch"
    assert compare_outputs(tiny, tiny * (1 + 1e-4)).status == "pass"


def test_every_variant_name_is_known():
    assert {s.variant for s in SOLUTIONS} <= set(VARIANTS)
