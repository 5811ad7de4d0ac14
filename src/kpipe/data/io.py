"""Parquet I/O for kpipe tables: atomic writes and schema-checked reads."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kpipe.data.schemas import TABLES, schema_of


class SchemaError(ValueError):
    """A Parquet file does not hold the table (or version) the reader expects."""


def to_table(rows: Iterable[Mapping[str, Any]], table: str) -> pa.Table:
    """Build an Arrow table of `table`'s schema from dict rows; unknown keys are an error."""
    schema = schema_of(table)
    rows = list(rows)
    names = set(schema.names)
    for row in rows:
        extra = set(row) - names
        if extra:
            raise SchemaError(f"{table}: unknown column(s) {sorted(extra)}")
    columns = {name: [row.get(name) for row in rows] for name in schema.names}
    return pa.Table.from_pydict(columns, schema=schema)


def write_table(data: pa.Table | Iterable[Mapping[str, Any]], path: str | os.PathLike, table: str) -> Path:
    """Write `data` as `table` to `path` atomically.

    The file is written next to its destination and renamed into place, so a killed job
    never leaves a half-written Parquet file that DuckDB or a resumed stage could read.
    """
    schema = schema_of(table)
    arrow = data if isinstance(data, pa.Table) else to_table(data, table)
    if not arrow.schema.equals(schema, check_metadata=False):
        arrow = arrow.select(schema.names).cast(schema)
    arrow = arrow.replace_schema_metadata(schema.metadata)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a unique name rather than mkstemp's file: the Parquet file then gets the umask's permissions
    # (mkstemp's 0600 would survive the rename and lock a shared results folder to one user)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        pq.write_table(arrow, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_schema(schema: pa.Schema, table: str, where: str) -> None:
    """Raise SchemaError unless `schema` is the current schema of `table`."""
    meta = schema.metadata or {}
    found_table = meta.get(b"kpipe.table", b"").decode()
    found_version = meta.get(b"kpipe.schema_version", b"").decode()
    expected = schema_of(table)
    _, version = TABLES[table]
    if found_table != table:
        raise SchemaError(f"{where}: holds table {found_table or '(none)'!r}, expected {table!r}")
    if found_version != str(version):
        raise SchemaError(f"{where}: {table} schema version {found_version!r}, this kpipe reads {version}")
    if not schema.remove_metadata().equals(expected.remove_metadata()):
        raise SchemaError(f"{where}: {table} columns differ from the declared schema")


def read_table(paths: str | os.PathLike | Iterable[str | os.PathLike], table: str) -> pa.Table:
    """Read one or more Parquet files of `table`, checking each file's schema first."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    parts = []
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{table}: no such file {path}")
        check_schema(pq.read_schema(path), table, str(path))
        parts.append(pq.read_table(path))
    if not parts:
        return schema_of(table).empty_table()
    return pa.concat_tables(parts)
