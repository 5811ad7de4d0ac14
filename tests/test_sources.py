"""Query-source loaders: each fixture (in its source's real schema) normalises into ``queries``;
a missing or malformed source fails with one SourceError line naming source, path and problem."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kpipe.data.cli import data
from kpipe.data.io import read_table, write_table
from kpipe.data.schemas import schema_of
from kpipe.data.source_text import source_hash
from kpipe.data.sources import SourceError, kernelbook_reference, load_source, name_from_ops, parse_level

FIXTURES = Path(__file__).parent / "fixtures" / "sources"
FILES = {
    "cudallm": "cudallm_rl.parquet",
    "cudallm_sft": "cudallm_sft.parquet",
    "drkernel_rl": "drkernel_rl.parquet",
    "drkernel_coldstart": "drkernel_coldstart.parquet",
    "kernelbook": "kernelbook.parquet",
}


def spec(kind: str, path: Path | str | None = None, **extra) -> dict:
    return {"name": f"my_{kind}", "kind": kind, "path": str(path or FIXTURES / FILES[kind]), **extra}


@pytest.mark.parametrize("kind", sorted(FILES))
def test_fixture_normalises_into_queries(kind):
    table = load_source(spec(kind))
    assert table.schema.equals(schema_of("queries"), check_metadata=False)
    rows = table.to_pylist()
    assert rows
    for row in rows:
        assert row["source"] == kind
        assert row["query_id"] == f"{kind}-{row['source_id']}"
        assert row["reference_hash"] == source_hash(row["reference_src"])
        assert "class Model" in row["reference_src"]
        assert row["contaminated"] is False
    assert len({row["query_id"] for row in rows}) == len(rows)


def test_drkernel_rl_fields_follow_the_dataset_card():
    rows = load_source(spec("drkernel_rl")).to_pylist()
    assert [row["source_id"] for row in rows] == ["cuda_llm_763652", "cuda_llm_763653"]
    assert [row["level"] for row in rows] == [0, 0]  # extra_info.level is the string "0"
    assert rows[0]["name"] == "rsqrt_pow"  # from the JSON-encoded extra_info.ops


def test_cudallm_reads_reference_from_py_code_or_reward_model(tmp_path):
    table = pq.read_table(FIXTURES / FILES["cudallm"])
    from_py_code = load_source(spec("cudallm")).to_pylist()
    assert [row["level"] for row in from_py_code] == [1, 2, 2]
    assert from_py_code[0]["reference_src"] == table["py_code"][0].as_py()
    assert from_py_code[0]["source_id"] == from_py_code[0]["reference_hash"]  # no id column: content id
    without_py_code = tmp_path / "sft.parquet"
    pq.write_table(table.drop_columns(["py_code"]), without_py_code)
    from_reward_model = load_source(spec("cudallm", without_py_code)).to_pylist()
    assert [r["reference_src"] for r in from_reward_model] == [r["reference_src"] for r in from_py_code]


def test_coldstart_ids_are_the_uuids():
    rows = load_source(spec("drkernel_coldstart")).to_pylist()
    assert [row["source_id"] for row in rows] == ["0", "1"]
    assert all(row["level"] is None for row in rows)


def test_kernelbook_rows_without_their_entry_point_class_are_skipped(caplog):
    rows = load_source(spec("kernelbook")).to_pylist()
    assert [row["source_id"] for row in rows] == ["0", "1"]
    assert "skipped 1 of 3 rows" in caplog.text


def test_kernelbook_reference_runs_in_kernelbench_convention():
    import torch

    table = pq.read_table(FIXTURES / FILES["kernelbook"]).to_pylist()
    for row in table[:2]:
        original: dict = {}
        exec(row["python_code"], original)
        args, kwargs = original["get_init_inputs"]()
        torch.manual_seed(0)
        inputs = original["get_inputs"]()
        expected = original[row["entry_point"]](*args, **kwargs)(*inputs)

        converted: dict = {}
        exec(kernelbook_reference(row["python_code"], row["entry_point"]), converted)
        model = converted["Model"](*converted["get_init_inputs"]())
        torch.testing.assert_close(model(*inputs), expected)


def test_limit_keeps_the_first_rows():
    assert load_source(spec("cudallm", limit=2)).num_rows == 2


def test_directory_and_jsonl_sources(tmp_path):
    table = pq.read_table(FIXTURES / FILES["drkernel_rl"])
    with open(tmp_path / "part-1.jsonl", "w") as handle:
        for row in table.to_pylist():
            handle.write(json.dumps(row) + "\n")
    pq.write_table(table, tmp_path / "part-0.parquet")
    (tmp_path / "README.md").write_text("ignored")
    rows = load_source(spec("drkernel_rl", tmp_path)).to_pylist()
    assert len(rows) == 4
    assert rows[0]["reference_src"] == rows[2]["reference_src"]


def test_kernelbench_source_selects_problems_and_keeps_the_original_hash():
    from kpipe.data.kernelbench import select_problems

    table = load_source({"name": "kb", "kind": "kernelbench", "version": "main", "levels": [1],
                         "ids": {"level_1": [1, 88]}, "size_cap": 64})
    rows = table.to_pylist()
    assert [row["query_id"] for row in rows] == ["kernelbench-main-L1-1", "kernelbench-main-L1-88"]
    originals = {p.problem_id: p.code for p in select_problems("main", [1], {1: [1, 88]})}
    assert rows[0]["reference_hash"] == source_hash(originals[1])
    assert "N = 64" in rows[0]["reference_src"]


def test_parse_level_and_name_from_ops():
    assert [parse_level(v) for v in (2, "3", " 1 ", None, "easy", True)] == [2, 3, 1, None, None, None]
    assert name_from_ops('["torch.abs", "nn.Conv2d"]') == "abs_Conv2d"
    assert name_from_ops(["torch.matmul"]) == "matmul"
    assert name_from_ops("[]") is None


# --- errors: one SourceError line naming the source, the path and what is wrong -----------


def assert_source_error(source: dict, *fragments: str) -> None:
    with pytest.raises(SourceError) as caught:
        load_source(source)
    message = str(caught.value)
    assert "\n" not in message
    assert source["name"] in message
    for fragment in fragments:
        assert fragment in message, message


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.parquet"
    assert_source_error(spec("cudallm", missing), str(missing), "no such file")


def test_empty_directory(tmp_path):
    assert_source_error(spec("kernelbook", tmp_path), str(tmp_path), "holds no")


def test_unreadable_file(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    assert_source_error(spec("drkernel_rl", broken), str(broken), "cannot read")


def test_wrong_columns(tmp_path):
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pq.read_table(FIXTURES / FILES["kernelbook"]), wrong)
    assert_source_error(spec("drkernel_coldstart", wrong), str(wrong), "missing column 'messages'",
                        "missing column 'original_python_code'")


def test_wrong_nested_type(tmp_path):
    table = pq.read_table(FIXTURES / FILES["drkernel_coldstart"])
    flattened = pa.array([json.dumps(m) for m in table["messages"].to_pylist()])
    wrong = tmp_path / "flat_messages.parquet"
    pq.write_table(table.set_column(0, "messages", flattened), wrong)
    assert_source_error(spec("drkernel_coldstart", wrong), "column 'messages' is string",
                        "list<struct<role: string, content: string>>")


def test_wrong_struct_field(tmp_path):
    table = pq.read_table(FIXTURES / FILES["drkernel_rl"])
    reward = pa.array([{"answer": "x", "style": "rule"}] * table.num_rows)
    wrong = tmp_path / "reward.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("reward_model"), "reward_model", reward), wrong)
    assert_source_error(spec("drkernel_rl", wrong), "missing column 'reward_model.ground_truth'")


def test_cudallm_without_any_reference_column(tmp_path):
    table = pq.read_table(FIXTURES / FILES["cudallm"]).drop_columns(["py_code", "reward_model"])
    wrong = tmp_path / "noref.parquet"
    pq.write_table(table, wrong)
    assert_source_error(spec("cudallm", wrong), "'py_code'", "'reward_model.ground_truth'")


def test_empty_source(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(FIXTURES / FILES["kernelbook"]).slice(0, 0), empty)
    assert_source_error(spec("kernelbook", empty), "no rows")


def test_hub_without_datasets_says_to_pass_a_path(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    source = {"name": "paper_rl", "kind": "drkernel_rl", "hub": "hkust-nlp/drkernel-rl-data"}
    assert_source_error(source, "hkust-nlp/drkernel-rl-data", "pass `path:`")
    with_missing_copy = {**source, "path": "data/drkernel-rl-data"}  # falls back to the hub
    assert_source_error(with_missing_copy, "local path data/drkernel-rl-data does not exist", "`datasets`")


def test_neither_path_nor_hub_and_unknown_kind():
    assert_source_error({"name": "nowhere", "kind": "kernelbook"}, "`path:`", "GPUMODE/KernelBook")
    assert_source_error({"name": "odd", "kind": "sakana", "path": "x"}, "unknown kind 'sakana'")


def test_kernelbench_source_with_unknown_ids():
    assert_source_error({"name": "kb", "kind": "kernelbench", "levels": [1], "ids": {"level_1": [999]}}, "999")


# --- CLI -------------------------------------------------------------------------------------


def test_cli_builds_tasks_and_decontaminated_queries(tmp_path):
    runner = CliRunner()
    tasks = tmp_path / "tasks.parquet"
    result = runner.invoke(data, ["tasks", "--levels", "1", "--levels", "2", "--ids", "1:19", "--ids", "2:76",
                                  "--size-cap", "64", "--out", str(tasks)])
    assert result.exit_code == 0, result.output
    assert read_table(tasks, "tasks")["task_id"].to_pylist() == ["kb-main-L1-19", "kb-main-L2-76"]

    config = tmp_path / "config.yaml"
    config.write_text(
        "queries:\n  sources:\n"
        f"    - {{name: cuda, kind: cudallm, path: {FIXTURES / FILES['cudallm']}}}\n"
        f"    - {{name: book, kind: kernelbook, path: {FIXTURES / FILES['kernelbook']}}}\n"
        "  decontamination: {mode: drop, threshold: 0.8}\n"
    )
    queries, counts = tmp_path / "queries.parquet", tmp_path / "counts.json"
    result = runner.invoke(data, ["queries", "--config", str(config), "--tasks", str(tasks),
                                  "--out", str(queries), "--counts", str(counts)])
    assert result.exit_code == 0, result.output
    tally = json.loads(counts.read_text())
    assert tally["sources"] == {"cuda": 3, "book": 2}
    assert (tally["exact_duplicates"], tally["near_duplicates"], tally["kept"]) == (1, 1, 3)
    assert read_table(queries, "queries").num_rows == 3


def test_distillation_reads_the_sft_source_and_rl_the_rl_source(tmp_path):
    """Issue 55 (paper §4.1, §6.1): the cold start is distilled from the cudaLLM SFT queries (up to 8,000:
    distill.max_queries), RL trains on the RL file; each source names its stages, kept per query."""
    from kpipe.agent.distill import shard_tasks
    from kpipe.data.ingest import build_queries, build_tasks
    from kpipe.train.rl import training_tasks

    tasks = build_tasks({"version": "main", "levels": [1, 2], "ids": {"level_1": [19], "level_2": [76]}, "size_cap": 64})
    queries, counts = build_queries({"sources": [
        {"name": "cudallm_sft", "kind": "cudallm_sft", "path": str(FIXTURES / FILES["cudallm_sft"]), "stages": ["distill"]},
        {"name": "cudallm", "kind": "cudallm", "path": str(FIXTURES / FILES["cudallm"]), "stages": ["rl"]},
    ], "decontamination": {"mode": "drop", "threshold": 0.8}}, tasks)
    path = tmp_path / "queries.parquet"
    write_table(queries, path, "queries")
    sft_ids = {row["query_id"] for row in load_source(spec("cudallm_sft")).to_pylist()}
    distilled = [task.task_id for shard in (0, 1) for task in shard_tasks(path, shard, 2)]
    assert set(distilled) == sft_ids and all(task_id.startswith("cudallm_sft-") for task_id in distilled)
    assert [task.task_id for task in shard_tasks(path, 0, 1, max_queries=1)] == sorted(sft_ids)[:1]
    rl = [task.task_id for task in training_tasks(path)]
    assert rl and all(task_id.startswith("cudallm-") for task_id in rl)  # the RL file's undecontaminated row
    both = load_source(spec("cudallm"))  # a source naming no stages feeds both
    assert set(both["stages"].to_pylist()[0]) == {"distill", "rl"}
    with pytest.raises(SourceError, match="stages"):
        load_source(spec("cudallm", stages=["sft"]))
    write_table(queries.filter(pc.equal(queries["source"], "cudallm")), path, "queries")
    with pytest.raises(ValueError, match="no non-contaminated query of a source with stage distill"):
        shard_tasks(path, 0, 1)


def test_sft_rows_take_the_reference_from_py_code_original_code_or_reward_model(tmp_path):
    table = pq.read_table(FIXTURES / FILES["cudallm_sft"])
    rows = load_source(spec("cudallm_sft")).to_pylist()
    assert [row["reference_src"] for row in rows] == table["py_code"].to_pylist()
    assert rows[0]["source_id"] == rows[0]["reference_hash"] and rows[0]["name"] == "Model"
    path = tmp_path / "ground_truth_only.parquet"
    pq.write_table(table.drop(["py_code"]), path)
    assert [row["reference_src"] for row in load_source(spec("cudallm_sft", path)).to_pylist()] == table["py_code"].to_pylist()


def test_cli_reports_bad_sources_in_one_line(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"queries:\n  sources:\n    - {{name: gone, kind: cudallm, path: {tmp_path / 'gone.parquet'}}}\n")
    tasks = tmp_path / "tasks.parquet"
    CliRunner().invoke(data, ["tasks", "--levels", "1", "--ids", "1:19", "--out", str(tasks)])
    result = CliRunner().invoke(data, ["queries", "--config", str(config), "--tasks", str(tasks), "--out",
                                       str(tmp_path / "q.parquet")])
    assert result.exit_code == 1
    assert result.output.startswith("Error: query source 'gone'") and result.output.count("\n") == 1


def test_cli_show_sources_lists_every_kind_and_checks_files():
    runner = CliRunner()
    listing = runner.invoke(data, ["show-sources"])
    assert listing.exit_code == 0
    for kind in ("kernelbench", *FILES):
        assert kind in listing.output
    good = runner.invoke(data, ["show-sources", "--check", str(FIXTURES / FILES["kernelbook"]), "--kind", "kernelbook"])
    assert good.exit_code == 0 and "2 rows" not in good.output and "3 rows" in good.output
    bad = runner.invoke(data, ["show-sources", "--check", str(FIXTURES / FILES["kernelbook"]), "--kind", "drkernel_rl"])
    assert bad.exit_code == 1 and "missing column 'prompt'" in bad.output
