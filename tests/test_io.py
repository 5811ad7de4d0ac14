import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kpipe.data.io import SchemaError, read_table, to_table, write_table
from kpipe.data.schemas import TABLES, schema_of


def metric_rows(n=3):
    return [{"run": "r", "stage": "sft", "iteration": 0, "step": i, "name": "loss", "value": 1.0 / (i + 1)} for i in range(n)]


def test_round_trip_keeps_schema_and_rows(tmp_path):
    path = write_table(metric_rows(), tmp_path / "m" / "part-0.parquet", "train_metrics")
    table = read_table(path, "train_metrics")
    assert table.num_rows == 3
    assert table.schema.equals(schema_of("train_metrics"), check_metadata=False)
    assert table.column("value").to_pylist() == [1.0, 0.5, 1.0 / 3]


def test_unknown_column_is_rejected():
    with pytest.raises(SchemaError, match="unknown column"):
        to_table([{"run": "r", "lossy": 1}], "train_metrics")


def test_reading_a_file_of_another_table_fails(tmp_path):
    path = write_table(metric_rows(), tmp_path / "x.parquet", "train_metrics")
    with pytest.raises(SchemaError, match="holds table 'train_metrics', expected 'tasks'"):
        read_table(path, "tasks")


def test_foreign_parquet_without_metadata_fails(tmp_path):
    path = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"a": [1]}), path)
    with pytest.raises(SchemaError, match="holds table '\\(none\\)'"):
        read_table(path, "tasks")


def test_old_schema_version_fails(tmp_path):
    path = tmp_path / "old.parquet"
    table = schema_of("train_metrics").empty_table().replace_schema_metadata({"kpipe.table": "train_metrics", "kpipe.schema_version": "0"})
    pq.write_table(table, path)
    with pytest.raises(SchemaError, match="schema version '0'"):
        read_table(path, "train_metrics")


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    target = tmp_path / "t.parquet"

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", explode)
    with pytest.raises(OSError):
        write_table(metric_rows(), target, "train_metrics")
    assert list(tmp_path.iterdir()) == []


def test_every_table_has_a_versioned_schema():
    for name in TABLES:
        meta = schema_of(name).metadata
        assert meta[b"kpipe.table"] == name.encode()
        assert int(meta[b"kpipe.schema_version"]) >= 1


def test_written_files_take_the_umasks_permissions(tmp_path):
    """Not mkstemp's 0600: results shared by a group on a cluster stay readable."""
    import os

    previous = os.umask(0o022)
    try:
        path = write_table([], tmp_path / "evals.parquet", "evals")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o644
