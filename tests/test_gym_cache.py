"""The result cache: first result under a key wins, several processes writing at once
lose nothing, and its export is the `evals` table."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from kpipe.data.io import read_table
from kpipe.gym.serve.cache import ResultCache, export_evals
from kpipe.gym.judge.result import EvalResult


def result(key: str, status: str = "pass") -> EvalResult:
    return EvalResult(key=key, reference_hash="r", candidate_hash=key, status=status, correct=status == "pass",
                      launched_kernels=["k"], speedup_eager=1.5)


def test_round_trip_and_first_writer_wins(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path / "c.sqlite")
    assert cache.get("a") is None and "a" not in cache
    assert cache.put(result("a"))
    assert not cache.put(result("a", "mismatch"))
    assert cache.get("a") == result("a")
    assert set(cache.get_many(["a", "b", "a"])) == {"a"}


def write_many(path: str, start: int, count: int) -> None:
    cache = ResultCache(path)
    for i in range(start, start + count):
        cache.put(result(f"k{i}"))


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "c.sqlite")
    context = multiprocessing.get_context("spawn")
    # overlapping ranges: every key is written by two processes at about the same time
    workers = [context.Process(target=write_many, args=(path, 50 * i, 100)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    cache = ResultCache(path)
    assert len(cache) == 250
    assert set(cache.get_many(f"k{i}" for i in range(250))) == {f"k{i}" for i in range(250)}


def test_export_writes_each_cached_result_once_as_an_evals_row(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path / "c.sqlite")
    cache.put(result("b", "mismatch"))
    cache.put(result("a"))
    output = tmp_path / "evals" / "gym_cache.parquet"
    assert export_evals(cache.path, output) == 2
    assert [EvalResult.from_row(row) for row in read_table(output, "evals").to_pylist()] == [result("a"), result("b", "mismatch")]
    cache.put(result("c"))
    assert export_evals(cache.path, output) == 3  # the file is replaced: no row twice
    assert [row["key"] for row in read_table(output, "evals").to_pylist()] == ["a", "b", "c"]


def test_export_without_a_cache_is_an_empty_evals_table(tmp_path: Path) -> None:
    missing = tmp_path / "none.sqlite"
    assert export_evals(missing, tmp_path / "a.parquet") == 0 and not missing.exists()
    assert export_evals(None, tmp_path / "b.parquet") == 0
    assert read_table([tmp_path / "a.parquet", tmp_path / "b.parquet"], "evals").num_rows == 0
