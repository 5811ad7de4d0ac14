"""The result cache: first result under a key wins, and several processes writing at once
lose nothing."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from kpipe.gym.cache import ResultCache
from kpipe.gym.result import EvalResult


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
