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


def turn_row(eval_key: str) -> dict:
    return {"run": "r", "stage": "eval", "iteration": 0, "task_id": "kb-main-L1-1", "sample": 0, "turn": 1,
            "model": "m", "eval_key": eval_key, "status": "pass", "correct": True}


def test_evals_holds_only_what_the_trajectories_reference_and_gym_cache_holds_all(results):
    """The result cache keeps results of replaced runs (an unchanged candidate is not evaluated
    again); `evals` shows only those of the current trajectories, the cache is `gym_cache`."""
    import duckdb

    write_table([turn_row("current"), turn_row(None)], results / "trajectories" / "part-0.parquet", "trajectories")
    write_table([{"key": "current", "status": "pass"}, {"key": "replaced", "status": "mismatch"}],
                results / "evals" / "gym_cache.parquet", "evals")
    build_db(results, results / "kpipe.duckdb")
    with duckdb.connect(str(results / "kpipe.duckdb"), read_only=True) as con:
        assert con.sql("select key from evals").fetchall() == [("current",)]
        assert sorted(con.sql("select key from gym_cache").fetchall()) == [("current",), ("replaced",)]


def test_the_newest_duckdb_1x_cli_opens_the_database_and_runs_the_readme_queries(results):
    """DuckDB 2 writes a storage version that 1.x refuses; build_db writes one that 1.x reads
    (the CLI of `pip install duckdb-cli`, a dev extra)."""
    import subprocess
    import sys
    from pathlib import Path

    cli = Path(sys.executable).parent / "duckdb"
    assert cli.exists(), "the DuckDB 1.x CLI is missing: pip install 'duckdb-cli>=1.5,<2' (kpipe's dev extra)"
    assert subprocess.run([str(cli), "--version"], capture_output=True, text=True).stdout.startswith("v1.")
    write_table([turn_row("current")], results / "trajectories" / "part-0.parquet", "trajectories")
    build_db(results, results / "kpipe.duckdb")
    readme_queries = ["select level, count(*) from tasks group by level", "describe trajectories",
                      "select column_name, comment from duckdb_columns() where table_name = 'trajectories'",
                      (Path(__file__).resolve().parents[1] / "workflow" / "sql" / "rl_reward.sql").read_text(),
                      "select count(*) as turns from turns"]
    for sql in readme_queries:
        result = subprocess.run([str(cli), "-readonly", "-csv", str(results / "kpipe.duckdb"), "-c", sql],
                                capture_output=True, text=True)
        assert result.returncode == 0 and not result.stderr, (sql, result.stderr)
    assert result.stdout.split() == ["turns", "1"]


def test_query_prints_null_as_null_and_a_corrupt_file_says_it_regenerates(results):
    from kpipe.data.db import DatabaseError

    db = results / "kpipe.duckdb"
    build_db(results, db)
    out = CliRunner().invoke(query_command, ["select null as nothing, 'nan'::double as not_a_number", "--db", str(db)])
    assert out.output.splitlines()[-1].split() == ["|", "NULL", "|", "nan", "|"]
    (results / "train_metrics" / "stage=sft" / "part-0.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatabaseError, match="delete it and run the same snakemake command again"):
        build_db(results, db)
