"""The DuckDB database: views over the Parquet tables, and ``kpipe query``.

The database holds no data, only views over ``results/<table>/**/*.parquet`` with absolute
paths, so it is cheap to rebuild and ``kpipe query`` works from any directory. A table with
no files yet becomes an empty typed table, so queries and joins still bind.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
import duckdb
import pyarrow as pa

from kpipe.infra.config import REPO_ROOT
from kpipe.data.schemas import TABLES, schema_of

DEFAULT_RESULTS = REPO_ROOT / "results"
DEFAULT_VIEWS_SQL = REPO_ROOT / "workflow" / "sql" / "views.sql"


def table_glob(results: Path, table: str) -> str:
    return str(results.resolve() / table / "**" / "*.parquet")


def build_db(results: Path, db_path: Path, views_sql: Path = DEFAULT_VIEWS_SQL) -> dict[str, int]:
    """(Re)build `db_path`: one base view per table, then the derived views of `views_sql`.

    Written to a temporary file and renamed, so a reader never opens a half-built database.
    Returns the number of Parquet files behind each base table.
    """
    tmp = db_path.with_name(db_path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    counts = {}
    with duckdb.connect(str(tmp)) as con:
        for table in TABLES:
            files = sorted((results / table).rglob("*.parquet")) if (results / table).exists() else []
            counts[table] = len(files)
            if files:
                con.execute(
                    f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{table_glob(results, table)}', "
                    "union_by_name = true, hive_partitioning = false)"
                )
            else:
                empty = schema_of(table).empty_table()  # noqa: F841 (read by DuckDB's replacement scan)
                con.execute(f"CREATE TABLE {table} AS SELECT * FROM empty")
        con.execute(views_sql.read_text())
    os.replace(tmp, db_path)
    return counts


def locate_db(explicit: str | None) -> Path:
    """--db, else $KPIPE_DB, else this checkout's results/kpipe.duckdb."""
    path = Path(explicit or os.environ.get("KPIPE_DB") or DEFAULT_RESULTS / "kpipe.duckdb")
    if not path.exists():
        raise click.ClickException(f"no database at {path}: run the pipeline (or `kpipe query --rebuild`) first")
    return path


def run_query(db_path: Path, sql: str) -> pa.Table:
    with duckdb.connect(str(db_path), read_only=True) as con:
        relation = con.sql(sql)
        return relation.to_arrow_table() if relation is not None else pa.table({})


def format_table(result: pa.Table, fmt: str) -> str:
    """Render a query result as an aligned table, CSV or JSON records."""
    frame = result.to_pandas()
    if fmt == "csv":
        return frame.to_csv(index=False).rstrip("\n")
    if fmt == "json":
        return json.dumps(json.loads(frame.to_json(orient="records")), indent=2)
    from tabulate import tabulate

    return tabulate(frame, headers="keys", tablefmt="github", showindex=False, floatfmt=".4g")


@click.command("query")
@click.argument("sql", required=False)
@click.option("--file", "sql_file", type=click.Path(exists=True, dir_okay=False), help="read the SQL from a file")
@click.option("--db", help="database path (default: $KPIPE_DB or results/kpipe.duckdb of this checkout)")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--rebuild", is_flag=True, help="rebuild the views over results/ before querying")
def query_command(sql: str | None, sql_file: str | None, db: str | None, fmt: str, rebuild: bool) -> None:
    """Run SQL read-only against the kpipe DuckDB database.

    Tables: tasks, queries, evals, trajectories, train_metrics, plus the views of
    workflow/sql/views.sql. Example: kpipe query "select level, count(*) from tasks group by level"
    """
    if (sql is None) == (sql_file is None):
        raise click.UsageError("give the SQL either as an argument or with --file")
    text = sql if sql is not None else Path(sql_file).read_text()  # type: ignore[arg-type]
    if rebuild:
        target = Path(db) if db else DEFAULT_RESULTS / "kpipe.duckdb"
        build_db(target.parent, target)
    path = locate_db(db)
    try:
        result = run_query(path, text)
    except duckdb.Error as error:
        raise click.ClickException(f"query failed: {str(error).splitlines()[0]}") from None
    click.echo(format_table(result, fmt))
    sys.stdout.flush()
