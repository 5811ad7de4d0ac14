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


def test_every_column_of_every_table_and_view_has_a_comment(results):
    """The tables' comments come from kpipe.data.schemas, the views' from views.sql or, for a column
    passed through under its name, from the one meaning the relations the view reads give it."""
    import duckdb

    from kpipe.data.db import uncommented_columns

    db = results / "kpipe.duckdb"
    build_db(results, db)
    with duckdb.connect(str(db), read_only=True) as con:
        assert uncommented_columns(con) == []
        views = {name for (name,) in con.sql("select view_name from duckdb_views() where not internal").fetchall()}
        assert {"turns", "sample_turns", "fastp_samples", "stts_samples", "metric_series", "provenance"} <= views
        [(correct,)] = con.execute("select comment from duckdb_columns() where table_name = 'sample_turns' "
                            "and column_name = 'correct'").fetchall()
        assert "not hacked" in correct  # its own meaning, not trajectories.correct's


def test_plain_duckdb_opens_the_database_from_any_directory(results, tmp_path_factory, monkeypatch):
    """The views name their files by absolute path: no kpipe, no search path needed."""
    import duckdb

    build_db(results, results / "kpipe.duckdb")
    for where in (results.parent, tmp_path_factory.mktemp("elsewhere")):
        monkeypatch.chdir(where)
        path = str(results / "kpipe.duckdb") if where != results.parent else f"{results.name}/kpipe.duckdb"
        with duckdb.connect(path, read_only=True) as con:
            assert con.execute("select count(*) from train_metrics").fetchall() == [(5,)]


def test_a_moved_database_is_refused_until_rebuilt_and_a_missing_one_names_the_last_good(results, tmp_path):
    import shutil

    build_db(results, results / "kpipe.duckdb")
    assert (results / "kpipe.last-good.duckdb").exists()
    moved = tmp_path / "moved"
    shutil.copytree(results, moved)
    refused = CliRunner().invoke(query_command, ["select 1", "--db", str(moved / "kpipe.duckdb")])
    assert refused.exit_code == 1 and f"was built for {results.resolve()}; rebuild it here" in refused.output
    (moved / "kpipe.duckdb").unlink()  # what a failed build leaves
    missing = CliRunner().invoke(query_command, ["select 1", "--db", str(moved / "kpipe.duckdb")])
    assert missing.exit_code == 1 and "the last good database is" in missing.output
    rebuilt = CliRunner().invoke(query_command, ["select count(*) as n from train_metrics", "--db",
                                                 str(moved / "kpipe.duckdb"), "--rebuild", "--format", "csv"])
    assert rebuilt.output.strip().splitlines() == ["n", "5"]
