"""The vendored KernelBench problem sets: counts, selection, size capping, task rows."""

from __future__ import annotations

import ast

import pytest

from kpipe.data.kernelbench import LEVELS, VERSIONS, load_problems, select_problems, shrink_sizes, task_rows
from kpipe.data.source_text import source_hash


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_problem_sets_hold_levels_1_to_3(version):
    problems = load_problems(version)
    counts = {level: sum(p.level == level for p in problems) for level in LEVELS}
    assert counts == {1: 100, 2: 100, 3: 50}
    for p in problems:
        assert p.task_id == f"kb-{version}-L{p.level}-{p.problem_id}"
        assert "class Model" in p.code and "def get_inputs" in p.code and "def get_init_inputs" in p.code


def test_unknown_version_is_an_error():
    with pytest.raises(ValueError, match="unknown KernelBench version 'v9'"):
        load_problems("v9")


def test_select_by_levels_and_ids():
    chosen = select_problems("main", [1, 2], {1: [19, 23]})
    assert [(p.level, p.problem_id) for p in chosen if p.level == 1] == [(1, 19), (1, 23)]
    assert sum(p.level == 2 for p in chosen) == 100
    with pytest.raises(ValueError, match=r"\(1, 999\)"):
        select_problems("main", [1], {1: [999]})
    with pytest.raises(ValueError, match=r"\(3, 1\)"):
        select_problems("main", [1], {3: [1]})  # ids of a level that is not selected


def test_shrink_sizes_caps_large_constants_only():
    code = "N = 2048 * 2\nk = 3\nflag = True\nscale = 1e9\nname = 'x'\nM = N * 2\n"
    tree = ast.parse(shrink_sizes(code, 64))
    values = {node.targets[0].id: ast.unparse(node.value) for node in tree.body}
    assert values == {"N": "64", "k": "3", "flag": "True", "scale": "1000000000.0", "name": "'x'", "M": "N * 2"}


def test_shrink_sizes_reaches_into_tuples_lists_and_unpacking():
    code = "input_shape = (32768,)\nheight, width = (128, 128)\nsizes = [16384, 8] * 2\nshape = (b, 3, 224)\n"
    assert shrink_sizes(code, 64) == (
        "input_shape = (64,)\nheight, width = (64, 64)\nsizes = [64, 8] * 2\nshape = (b, 3, 64)"
    )


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_no_module_level_integer_above_the_cap_survives(version):
    for p in load_problems(version):
        tree = ast.parse(shrink_sizes(p.code, 64))
        for node in tree.body:
            if isinstance(node, ast.Assign):
                constants = [n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant)]
                big = [c for c in constants if isinstance(c, int) and not isinstance(c, bool) and c > 64]
                assert not big, f"{p.task_id}: {ast.unparse(node)}"


@pytest.mark.parametrize("level, problem_id", [(1, 1), (1, 89), (2, 36), (2, 76)])
def test_capped_problems_run_small_on_the_cpu(level, problem_id):
    import torch

    (p,) = select_problems("main", [level], {level: [problem_id]})
    namespace: dict = {}
    exec(shrink_sizes(p.code, 64), namespace)
    inputs = namespace["get_inputs"]()
    assert all(max(x.shape, default=1) <= 64 for x in inputs if isinstance(x, torch.Tensor))
    with torch.no_grad():
        out = namespace["Model"](*namespace["get_init_inputs"]())(*inputs)
    assert torch.isfinite(out).all()


def test_task_rows_record_profile_and_hash_of_the_original():
    problems = select_problems("main", [1], {1: [1]})
    capped, full = task_rows(problems, "eval", 64)[0], task_rows(problems, "eval", None)[0]
    assert (capped["size_profile"], full["size_profile"]) == ("cap64", "full")
    assert capped["reference_hash"] == full["reference_hash"] == source_hash(problems[0].code)
    assert full["reference_src"] == problems[0].code and "N = 64" in capped["reference_src"]
    assert capped["task_id"] == "kb-main-L1-1" and capped["split"] == "eval"
