"""Decontamination: exact and near duplicates of evaluation tasks are caught, unrelated queries
are not, drop/flag behave as configured, and the similarity is the exact Jaccard it claims."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kpipe.data.decontam import TaskIndex, content_shingle_sets, decontaminate, shingle_sets, tokens
from kpipe.data.ingest import build_queries, build_tasks
from kpipe.data.io import to_table
from kpipe.data.kernelbench import load_problems
from kpipe.data.sources import load_source, query_row

FIXTURES = Path(__file__).parent / "fixtures" / "sources"
EVAL = {"version": "main", "levels": [1, 2], "ids": {"level_1": [19], "level_2": [76]}, "size_cap": 64}


@pytest.fixture(scope="module")
def tasks() -> pa.Table:
    return build_tasks(EVAL)


@pytest.fixture(scope="module")
def cudallm() -> pa.Table:
    """Row 0: L1-19 re-commented (exact); row 1: L2-76 renamed and resized (near); row 2: unrelated."""
    return load_source({"name": "cuda", "kind": "cudallm", "path": str(FIXTURES / "cudallm_rl.parquet")})


def problem(level: int, problem_id: int, version: str = "main") -> str:
    return next(p.code for p in load_problems(version) if (p.level, p.problem_id) == (level, problem_id))


def test_flag_marks_exact_and_near_duplicates_and_spares_the_unrelated(tasks, cudallm):
    flagged, counts = decontaminate(cudallm, tasks, mode="flag", threshold=0.8)
    rows = flagged.to_pylist()
    assert [row["contaminated"] for row in rows] == [True, True, False]
    assert [row["contaminated_with"] for row in rows[:2]] == ["kb-main-L1-19", "kb-main-L2-76"]
    assert rows[0]["similarity"] == 1.0 and rows[1]["similarity"] >= 0.8
    assert rows[2]["similarity"] < 0.3
    assert counts == {"mode": "flag", "threshold": 0.8, "total": 3, "training_duplicates": 0,
                      "exact_duplicates": 1, "near_duplicates": 1, "kept": 3,
                      "lost_by_source": {"cudallm": {"repeated": 0, "exact": 1, "near": 1}}}


def test_drop_removes_the_contaminated(tasks, cudallm):
    kept, counts = decontaminate(cudallm, tasks, mode="drop", threshold=0.8)
    assert kept.num_rows == counts["kept"] == 1
    assert kept["contaminated"].to_pylist() == [False]
    assert kept["query_id"].to_pylist() == [cudallm["query_id"][2].as_py()]


def test_threshold_decides_near_duplicates_only(tasks):
    near = problem(2, 76).replace("x = x + self.bias", "x = x * 2.0 + self.bias - 1.0")
    queries = to_table([query_row("cudallm", "edited", near, 2, None)], "queries")
    _, score = TaskIndex(tasks["reference_src"].to_pylist()).best_matches([near])
    assert 0.3 < score[0] < 1.0
    assert decontaminate(queries, tasks, "drop", threshold=score[0])[0].num_rows == 0
    assert decontaminate(queries, tasks, "drop", threshold=min(1.0, score[0] + 0.01))[0].num_rows == 1


def test_same_template_different_op_is_not_a_near_duplicate(tasks):
    siblings = [problem(1, 20), problem(1, 21), problem(1, 22)]  # LeakyReLU, Sigmoid, Tanh vs ReLU
    queries = to_table([query_row("kernelbench", str(i), code, 1, None) for i, code in enumerate(siblings)], "queries")
    _, counts = decontaminate(queries, tasks, "flag", threshold=0.5)
    assert counts["exact_duplicates"] == counts["near_duplicates"] == 0


def test_other_kernelbench_version_of_an_evaluation_task_is_caught(tasks):
    queries = load_source({"name": "kb0", "kind": "kernelbench", "version": "v0", "levels": [1, 2],
                           "ids": {"level_1": [19, 20], "level_2": [76, 77]}})
    flagged, _ = decontaminate(queries, tasks, "flag", threshold=0.8)
    caught = {row["query_id"]: row["contaminated_with"] for row in flagged.to_pylist() if row["contaminated"]}
    assert caught == {"kernelbench-v0-L1-19": "kb-main-L1-19", "kernelbench-v0-L2-76": "kb-main-L2-76"}


def test_repeated_training_queries_are_dropped_once_in_both_modes(tasks, cudallm):
    doubled = pa.concat_tables([cudallm, cudallm])
    for mode in ("drop", "flag"):
        _, counts = decontaminate(doubled, tasks, mode=mode, threshold=0.8)
        assert counts["total"] == 6 and counts["training_duplicates"] == 3


def test_no_tasks_leaves_queries_unmarked(tasks, cudallm):
    kept, counts = decontaminate(cudallm, tasks.slice(0, 0), "drop", 0.8)
    assert kept.num_rows == 3 and counts["exact_duplicates"] == counts["near_duplicates"] == 0
    assert kept["similarity"].null_count == 3


@pytest.mark.parametrize("mode, threshold", [("remove", 0.8), ("drop", 0.0), ("flag", 1.5)])
def test_bad_settings_are_rejected(tasks, cudallm, mode, threshold):
    with pytest.raises(ValueError, match="decontamination"):
        decontaminate(cudallm, tasks, mode=mode, threshold=threshold)


def test_tokens_abstract_names_and_numbers_but_keep_attributes():
    original = "y = torch.relu(x)  # note\nN = 4096\n"
    renamed = "out = torch.relu(inp)\nM = 17\n"
    assert tokens(original) == tokens(renamed)
    assert tokens(original) != tokens(original.replace("relu", "sigmoid"))
    assert tokens('"""doc"""\nx = 1') == tokens("x = 2")


def test_similarity_is_the_exact_jaccard_of_content_shingles():
    codes = [problem(1, 1), problem(1, 2), problem(2, 76), problem(3, 1)]
    queries = [problem(1, 2, "v0"), problem(2, 12), problem(1, 1).replace("matmul", "mm")]
    grams, owner = content_shingle_sets(codes)
    task_sets = [set(grams[owner == i].tolist()) for i in range(len(codes))]
    best, score = TaskIndex(codes).best_matches(queries)
    qgrams, qowner = content_shingle_sets(queries)
    for i in range(len(queries)):
        query_set = set(qgrams[qowner == i].tolist())
        brute = [len(query_set & t) / len(query_set | t) for t in task_sets]
        assert score[i] == pytest.approx(max(brute))
        assert brute[best[i]] == pytest.approx(max(brute))


def test_shingle_sets_are_unique_per_source_and_stable():
    codes = [problem(1, 19), problem(1, 19), "x"]
    grams, owner = shingle_sets(codes)
    first, second = grams[owner == 0], grams[owner == 1]
    assert np.array_equal(first, second) and len(np.unique(first)) == len(first)
    assert (owner == 2).sum() == 0  # shorter than one shingle: no shingles
    assert np.array_equal(shingle_sets(codes)[0], grams)


def test_build_queries_concatenates_sources_and_reports_counts(tasks):
    config = {
        "sources": [
            {"name": "cuda", "kind": "cudallm", "path": str(FIXTURES / "cudallm_rl.parquet")},
            {"name": "rl", "kind": "drkernel_rl", "path": str(FIXTURES / "drkernel_rl.parquet")},
            {"name": "cold", "kind": "drkernel_coldstart", "path": str(FIXTURES / "drkernel_coldstart.parquet")},
            {"name": "kb", "kind": "kernelbench", "levels": [1], "ids": {"level_1": [1, 19]}},
        ],
        "decontamination": {"mode": "drop", "threshold": 0.8},
    }
    table, counts = build_queries(config, tasks)
    assert counts["sources"] == {"cuda": 3, "rl": 2, "cold": 2, "kb": 2}
    # cold-start repeats an RL reference and a cudaLLM one; kb L1-19 repeats the cudaLLM exact copy
    assert counts["training_duplicates"] == 3
    assert (counts["exact_duplicates"], counts["near_duplicates"]) == (1, 1)
    assert table.num_rows == counts["kept"] == 9 - 3 - 2
    assert not any(table["contaminated"].to_pylist())


def test_build_queries_rejects_repeated_source_names(tasks):
    from kpipe.data.sources import SourceError

    twice = {"name": "a", "kind": "kernelbench", "levels": [1], "ids": {"level_1": [1]}}
    with pytest.raises(SourceError, match="more than once"):
        build_queries({"sources": [twice, twice]}, tasks)


def test_a_query_in_two_sources_keeps_every_stage_it_belongs_to(tasks, tmp_path):
    """The SFT file comes first: its copy is kept, and RL's copy's stage travels with it (issue 64)."""
    from kpipe.data.sources import training_queries
    from kpipe.data.io import write_table

    shared = problem(1, 23)  # not an evaluation task
    only_rl = problem(1, 36)
    def row(kind: str, source_id: str, reference: str, stages: list[str]) -> dict:
        return {**query_row(kind, source_id, reference, 1, None), "stages": stages}

    sft = to_table([row("cudallm_sft", "s0", shared, ["distill"])], "queries")
    rl = to_table([row("cudallm", "r0", shared, ["rl"]), row("cudallm", "r1", only_rl, ["rl"])], "queries")
    table, counts = decontaminate(pa.concat_tables([sft, rl]), tasks)
    assert table.num_rows == 2 and counts["training_duplicates"] == 1
    assert dict(zip(table["query_id"].to_pylist(), table["stages"].to_pylist())) == {
        "cudallm_sft-s0": ["distill", "rl"], "cudallm-r1": ["rl"]}
    assert counts["lost_by_source"] == {"cudallm_sft": {"repeated": 0, "exact": 0, "near": 0},
                                        "cudallm": {"repeated": 1, "exact": 0, "near": 0}}
    path = tmp_path / "queries.parquet"
    write_table(table, path, "queries")
    assert [q["query_id"] for q in training_queries(path, "rl")] == ["cudallm-r1", "cudallm_sft-s0"]
    assert [q["query_id"] for q in training_queries(path, "distill")] == ["cudallm_sft-s0"]
