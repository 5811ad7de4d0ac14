"""The DuckDB database: views over the Parquet tables, and ``kpipe query``.

The database holds no data, only views over Parquet files named by absolute path, so any DuckDB
client opens it from any directory (DuckDB keeps no search path in a database file). A moved or
copied tree needs a rebuild, which Snakemake does (the rule's `results` param is the folder's
absolute path); `connect` refuses a database built for another folder instead of reading that
folder's files. The Snakemake rule names exactly the files of the current DAG, so a file left on
disk by other settings is never read. A table with no files becomes an empty typed table, so
queries and joins still bind. `evals` holds only the KernelGym results that the current
trajectories reference; the whole result cache, results of replaced runs too, is `gym_cache`. Every column of every table and view carries its meaning as a
DuckDB comment: the tables' from ``kpipe.data.schemas``, the views' from views.sql, or, for a
column a view passes through unchanged under its name, the one meaning that name has in the tables.

A build that fails leaves no database (Snakemake deletes the output before the job, so the next
run builds again); each good build is also copied to ``kpipe.last-good.duckdb`` beside it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
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

log = logging.getLogger(__name__)

DB_NAME = "kpipe.duckdb"
LAST_GOOD_NAME = "kpipe.last-good.duckdb"
BUILD_TABLE = "build_info"
DEFAULT_VIEWS_SQL = REPO_ROOT / "workflow" / "sql" / "views.sql"
# The file format the database is written in: DuckDB 2 writes a storage version that DuckDB 1.x
# clients (the CLI of `pip install duckdb-cli`, older Python packages, DBeaver's driver) refuse;
# this one every DuckDB from 1.0 reads (tests/test_db.py opens it with the newest 1.x CLI)
STORAGE_VERSION = "v1.0.0"
# A table whose Parquet files are a cache, kept whole across reruns (KernelGym's results: an
# unchanged candidate is not evaluated again), is read under the cache's name; the table's own name
# is a view of the rows the current results reference (a result of a replaced run is only in the cache).
CACHE_VIEWS = {"evals": "gym_cache"}


REGENERATE = "delete it and run the same snakemake command again: the rule that writes it regenerates it"


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
                raise DatabaseError(f"{error}; {REGENERATE}") from None
            except (OSError, pa.ArrowException) as error:
                raise DatabaseError(f"{path}: not a readable Parquet file of table {table} ({error}); {REGENERATE}") from None


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def build_db(results: Path, db_path: Path, views_sql: Path = DEFAULT_VIEWS_SQL,
             files: Mapping[str, Sequence[str | os.PathLike]] | None = None) -> dict[str, int]:
    """(Re)build `db_path`: one base view per table over `files` (default: every Parquet file
    under `results`), then the derived views of `views_sql`, then the comments views.sql leaves out.

    Every file is checked first, and the database is written to a temporary file and renamed, so
    a failure (or a reader) never meets a half-built one; a good build is copied to
    ``kpipe.last-good.duckdb``. Returns the number of Parquet files behind each base table.
    """
    chosen = files_on_disk(results) if files is None else files
    by_table = {table: [Path(path) for path in chosen.get(table, [])] for table in TABLES}
    check_files(by_table)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = db_path.with_name(db_path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        with duckdb.connect(str(tmp), config={"storage_compatibility_version": STORAGE_VERSION}) as con:
            for table, paths in by_table.items():
                relation = CACHE_VIEWS.get(table, table)
                if paths:
                    names = ", ".join(_sql_string(str(path.resolve())) for path in paths)
                    con.execute(f"CREATE VIEW {relation} AS SELECT * FROM read_parquet([{names}], "
                                "union_by_name = true, hive_partitioning = false)")
                else:
                    empty = schema_of(table).empty_table()  # noqa: F841 (read by DuckDB's replacement scan)
                    con.execute(f"CREATE TABLE {relation} AS SELECT * FROM empty")
                _comment_columns(con, relation, column_descriptions(table))
            for table, cache in CACHE_VIEWS.items():
                con.execute(f"CREATE VIEW {table} AS SELECT * FROM {cache} WHERE key IN "
                            "(SELECT eval_key FROM trajectories WHERE eval_key IS NOT NULL)")
                _comment_columns(con, table, column_descriptions(table))
            con.execute(f"CREATE TABLE {BUILD_TABLE} AS SELECT {_sql_string(str(db_path.parent.resolve()))} AS results")
            con.execute(f"COMMENT ON COLUMN {BUILD_TABLE}.results IS 'absolute path of the results folder whose "
                        "Parquet files the views read (a moved tree needs a rebuild)'")
            con.execute(views_sql.read_text())
            inherit_comments(con)
        os.replace(tmp, db_path)
    finally:
        tmp.unlink(missing_ok=True)
    shutil.copyfile(db_path, db_path.with_name(LAST_GOOD_NAME))
    counts = {table: len(paths) for table, paths in by_table.items()}
    log.info("built %s: Parquet files per table %s", db_path, counts)
    return counts


def _comment_columns(con: duckdb.DuckDBPyConnection, relation: str, descriptions: Mapping[str, str]) -> None:
    for column, text in descriptions.items():
        con.execute(f"COMMENT ON COLUMN {relation}.{column} IS {_sql_string(text)}")


def uncommented_columns(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    """(view or table, column) of every column with no comment."""
    return con.sql("SELECT table_name, column_name FROM duckdb_columns() WHERE NOT internal AND comment IS NULL "
                   "ORDER BY table_name, column_index").fetchall()


def inherit_comments(con: duckdb.DuckDBPyConnection) -> None:
    """A view column views.sql gave no comment takes the meaning of the same-named column of the
    tables and views its SQL names, when they agree on one (turns.run is trajectories.run; turns.status
    is not inherited: trajectories and evals describe it differently). A column whose meaning a view
    changes under the same name (sample_turns.correct) must carry its own comment in views.sql."""
    views = dict(con.sql("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal").fetchall())
    changed = True
    while changed:  # a view reading another view inherits once that one has its comments
        changed = False
        known: dict[str, dict[str, str]] = {}
        for relation, column, text in con.sql("SELECT table_name, column_name, comment FROM duckdb_columns() "
                                              "WHERE NOT internal AND comment IS NOT NULL").fetchall():
            known.setdefault(relation, {})[column] = text
        for view, column in uncommented_columns(con):
            sources = [name for name in known if name != view and re.search(rf"\b{name}\b", views.get(view, ""))]
            meanings = {known[name][column] for name in sources if column in known[name]}
            if len(meanings) == 1:
                con.execute(f'COMMENT ON COLUMN {view}."{column}" IS {_sql_string(meanings.pop())}')
                changed = True


def connect(db_path: Path) -> duckdb.DuckDBPyConnection:
    """Open `db_path` read-only; a database built for another results folder (a moved or copied
    tree) is refused, rather than reading that folder's files."""
    con = duckdb.connect(str(db_path), read_only=True)
    [(built_for,)] = con.execute(f"SELECT results FROM {BUILD_TABLE}").fetchall()
    if Path(built_for) != Path(db_path).resolve().parent:
        con.close()
        raise DatabaseError(f"{db_path} was built for {built_for}; rebuild it here (snakemake, or "
                            "kpipe query --rebuild)")
    return con


# where the workflow writes each config's database: results/runs/<config run>+<RL runs>/ (workflow/rules/inputs.smk)
RUNS_DIR = Path("results") / "runs"


def default_db(results: str | None = None) -> Path:
    """--results DIR, else $KPIPE_DB, else the one run's database under ./results/runs of the current
    directory (the run in hand, not the checkout kpipe was installed from); with several, the caller names one."""
    if results:
        return Path(results) / DB_NAME
    if os.environ.get("KPIPE_DB"):
        return Path(os.environ["KPIPE_DB"])
    found = sorted(RUNS_DIR.glob(f"*/{DB_NAME}"))
    if len(found) > 1:
        raise click.ClickException("databases of several runs: name one with --db or --results "
                                   f"({', '.join(str(path.parent) for path in found)})")
    return found[0] if found else Path("results") / DB_NAME


def locate_db(explicit: str | None, results: str | None = None) -> Path:
    """--db, else :func:`default_db`; an error when there is none."""
    path = Path(explicit) if explicit else default_db(results)
    if not path.exists():
        last_good = path.with_name(LAST_GOOD_NAME)
        hint = (f"; the last build failed? (logs/runs/<run>/build_db.log) the last good database is {last_good} (--db)"
                if last_good.exists() else "")
        raise click.ClickException(f"no database at {path}: run the pipeline (or `kpipe query --rebuild`) first{hint}")
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

    # from Arrow's rows, not pandas': a SQL NULL prints as NULL, not as pandas' nan
    rows = [list(row.values()) for row in result.to_pylist()]
    return tabulate(rows, headers=result.column_names, tablefmt="github", floatfmt=".4g", missingval="NULL")


@click.command("query")
@click.argument("sql", required=False)
@click.option("--file", "sql_file", type=click.Path(exists=True, dir_okay=False), help="read the SQL from a file")
@click.option("--results", type=click.Path(file_okay=False),
              help="the folder whose kpipe.duckdb to query (a run's: results/runs/<config run>+<RL runs>)")
@click.option("--db", help="database path (default: $KPIPE_DB, else the one run's under results/runs of the current directory)")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--rebuild", is_flag=True, help="rebuild the views over every Parquet file beside the database first")
def query_command(sql: str | None, sql_file: str | None, results: str | None, db: str | None, fmt: str,
                  rebuild: bool) -> None:
    """Run SQL read-only against the kpipe DuckDB database.

    Tables: tasks, queries, evals (the KernelGym results of the current trajectories), trajectories,
    train_metrics, gym_cache (KernelGym's whole result cache), plus the views of workflow/sql/views.sql. Example: kpipe query "select level, count(*) from tasks group by level"
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
    except DatabaseError as error:
        raise click.ClickException(str(error)) from None
    except duckdb.Error as error:
        raise click.ClickException(f"query failed: {str(error).splitlines()[0]}") from None
    click.echo(format_table(result, fmt))
    sys.stdout.flush()
