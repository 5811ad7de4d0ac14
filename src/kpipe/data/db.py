"""The DuckDB database: views over the Parquet tables, and ``kpipe query``.

The database holds no data, only views over Parquet files named relative to the database's
folder (``results/``): a moved or copied tree needs no rebuild, and every reader opens it with
:func:`connect`, which resolves those names there. The Snakemake rule names exactly the files
of the current DAG, so a file left on disk by other settings is never read. A table with no
files becomes an empty typed table, so queries and joins still bind. Every column carries its
meaning (``kpipe.data.schemas``) as a DuckDB comment.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import click
import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from kpipe.infra.config import REPO_ROOT
from kpipe.data.io import SchemaError, check_schema
from kpipe.data.schemas import TABLES, column_descriptions, schema_of

DB_NAME = "kpipe.duckdb"
DEFAULT_VIEWS_SQL = REPO_ROOT / "workflow" / "sql" / "views.sql"


class DatabaseError(RuntimeError):
    """A table file cannot be read; the message names it."""


def files_on_disk(results: Path) -> dict[str, list[Path]]:
    """Every Parquet file under `results`/<table>/, per table (``kpipe query --rebuild``, tests)."""
    return {table: sorted((results / table).rglob("*.parquet")) for table in TABLES}


def check_files(files: Mapping[str, Sequence[Path]]) -> None:
    """Raise DatabaseError naming the first file that is not a readable Parquet file of its table.

    Read before anything is replaced: a truncated file must not cost the previous database."""
    for table, paths in files.items():
        for path in paths:
            try:
                check_schema(pq.read_schema(path), table, str(path))
            except SchemaError as error:
                raise DatabaseError(str(error)) from None
            except (OSError, pa.ArrowException) as error:
                raise DatabaseError(f"{path}: not a readable Parquet file of table {table} ({error})") from None


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def build_db(results: Path, db_path: Path, views_sql: Path = DEFAULT_VIEWS_SQL,
             files: Mapping[str, Sequence[str | os.PathLike]] | None = None) -> dict[str, int]:
    """(Re)build `db_path`: one base view per table over `files` (default: every Parquet file
    under `results`), then the derived views of `views_sql`.

    Every file is checked first, and the database is written to a temporary file and renamed, so
    a failure (or a reader) never meets a half-built one and the previous database survives.
    Returns the number of Parquet files behind each base table.
    """
    chosen = files_on_disk(results) if files is None else files
    by_table = {table: [Path(path) for path in chosen.get(table, [])] for table in TABLES}
    check_files(by_table)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    home = db_path.parent.resolve()
    tmp = db_path.with_name(db_path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        with duckdb.connect(str(tmp)) as con:
            con.execute(f"SET file_search_path = {_sql_string(str(home))}")
            for table, paths in by_table.items():
                if paths:
                    names = ", ".join(_sql_string(os.path.relpath(path.resolve(), home)) for path in paths)
                    con.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet([{names}], "
                                "union_by_name = true, hive_partitioning = false)")
                else:
                    empty = schema_of(table).empty_table()  # noqa: F841 (read by DuckDB's replacement scan)
                    con.execute(f"CREATE TABLE {table} AS SELECT * FROM empty")
                for column, text in column_descriptions(table).items():
                    con.execute(f"COMMENT ON COLUMN {table}.{column} IS {_sql_string(text)}")
            con.execute(views_sql.read_text())
        os.replace(tmp, db_path)
    finally:
        tmp.unlink(missing_ok=True)
    return {table: len(paths) for table, paths in by_table.items()}


def connect(db_path: Path) -> duckdb.DuckDBPyConnection:
    """Open `db_path` read-only, its views' file names resolved in its own folder."""
    con = duckdb.connect(str(db_path), read_only=True)
    con.execute(f"SET file_search_path = {_sql_string(str(Path(db_path).resolve().parent))}")
    return con


def default_db(results: str | None = None) -> Path:
    """--results DIR, else $KPIPE_DB, else ./results of the current directory: the run in hand,
    not the checkout kpipe was installed from."""
    if results:
        return Path(results) / DB_NAME
    return Path(os.environ.get("KPIPE_DB") or Path("results") / DB_NAME)


def locate_db(explicit: str | None, results: str | None = None) -> Path:
    """--db, else :func:`default_db`; an error when there is none."""
    path = Path(explicit) if explicit else default_db(results)
    if not path.exists():
        raise click.ClickException(f"no database at {path}: run the pipeline (or `kpipe query --rebuild`) first")
    return path


def run_query(db_path: Path, sql: str) -> pa.Table:
    with connect(db_path) as con:
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
@click.option("--results", type=click.Path(file_okay=False), help="the results folder whose kpipe.duckdb to query")
@click.option("--db", help="database path (default: $KPIPE_DB, else results/kpipe.duckdb of the current directory)")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--rebuild", is_flag=True, help="rebuild the views over every Parquet file beside the database first")
def query_command(sql: str | None, sql_file: str | None, results: str | None, db: str | None, fmt: str,
                  rebuild: bool) -> None:
    """Run SQL read-only against the kpipe DuckDB database.

    Tables: tasks, queries, evals, trajectories, train_metrics, plus the views of
    workflow/sql/views.sql. Example: kpipe query "select level, count(*) from tasks group by level"
    """
    if (sql is None) == (sql_file is None):
        raise click.UsageError("give the SQL either as an argument or with --file")
    text = sql if sql is not None else Path(sql_file).read_text()  # type: ignore[arg-type]
    if rebuild:
        target = Path(db) if db else default_db(results)
        try:
            build_db(target.parent, target)
        except DatabaseError as error:
            raise click.ClickException(str(error)) from None
    path = locate_db(db, results)
    try:
        result = run_query(path, text)
    except duckdb.Error as error:
        raise click.ClickException(f"query failed: {str(error).splitlines()[0]}") from None
    click.echo(format_table(result, fmt))
    sys.stdout.flush()
