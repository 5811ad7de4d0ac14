import json

import pytest
from click.testing import CliRunner

from kpipe.data.io import write_table
from kpipe.data.db import build_db, query_command


@pytest.fixture
def results(tmp_path):
    rows = [{"run": "r", "stage": "sft", "iteration": 0, "step": s, "name": "loss", "value": float(10 - s)} for s in range(5)]
    write_table(rows, tmp_path / "train_metrics" / "stage=sft" / "part-0.parquet", "train_metrics")
    return tmp_path


def test_views_over_parquet_and_empty_tables(results):
    db = results / "kpipe.duckdb"
    counts = build_db(results, db)
    assert counts["train_metrics"] == 1 and counts["tasks"] == 0
    out = CliRunner().invoke(query_command, ["select count(*) as n, min(value) as lo from train_metrics", "--db", str(db), "--format", "json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == [{"n": 5, "lo": 6.0}]
    empty = CliRunner().invoke(query_command, ["select count(*) as n from tasks", "--db", str(db), "--format", "csv"])
    assert empty.output.strip().splitlines() == ["n", "0"]


def test_query_is_read_only_and_works_from_another_directory(results, tmp_path_factory, monkeypatch):
    db = results / "kpipe.duckdb"
    build_db(results, db)
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    ok = CliRunner().invoke(query_command, ["select step from metric_series order by step limit 1", "--db", str(db)])
    assert ok.exit_code == 0 and "0" in ok.output
    denied = CliRunner().invoke(query_command, ["create table x as select 1", "--db", str(db)])
    assert denied.exit_code != 0
    assert "read-only" in denied.output.lower()


def test_sql_from_file_and_usage_errors(results, tmp_path):
    db = results / "kpipe.duckdb"
    build_db(results, db)
    sql = tmp_path / "q.sql"
    sql.write_text("select max(step) as last from train_metrics")
    out = CliRunner().invoke(query_command, ["--file", str(sql), "--db", str(db), "--format", "csv"])
    assert out.output.strip().splitlines() == ["last", "4"]
    both = CliRunner().invoke(query_command, ["select 1", "--file", str(sql), "--db", str(db)])
    assert both.exit_code == 2
    missing = CliRunner().invoke(query_command, ["select 1", "--db", str(tmp_path / "none.duckdb")])
    assert missing.exit_code == 1 and "no database" in missing.output
