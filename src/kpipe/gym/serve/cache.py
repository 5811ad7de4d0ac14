"""The KernelGym result cache: one SQLite file (WAL mode) of results keyed by ``eval_key``.

The key hashes (reference, candidate, protocol, device kind), so an identical evaluation is
free wherever it comes from: a duplicate in a batch, a rerun of a killed stage, another
stage. SQLite in WAL mode lets many processes (batch jobs of a Snakemake run, the HTTP
service) read while one writes; writers wait on a busy timeout instead of failing. The
first result stored under a key wins: equal keys describe the same evaluation.

Only real results are stored: a job that lost its worker twice is answered ``crashed``
but not cached, so the next run tries it again.

The pipeline's stages keep only a result's key (``eval_key``) and a few of its fields in their
``trajectories`` rows; ``export_evals`` writes the whole cache as the ``evals`` table that key
joins to.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from kpipe.data.io import write_table
from kpipe.gym.judge.result import EvalResult

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 60.0
SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    result TEXT NOT NULL,
    stored_at REAL NOT NULL
)
"""
DEFAULT_CACHE_ENV = "KPIPE_GYM_CACHE"
DEFAULT_CACHE_PATH = Path("results") / "gym" / "cache.sqlite"


def default_cache_path() -> Path:
    """``$KPIPE_GYM_CACHE`` or ``results/gym/cache.sqlite`` (shared by every stage of a run)."""
    return Path(os.environ.get(DEFAULT_CACHE_ENV) or DEFAULT_CACHE_PATH)


class ResultCache:
    """A process- and thread-safe persistent map ``key -> EvalResult``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with self._connection() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(SCHEMA)

    def _connection(self) -> sqlite3.Connection:
        """One connection per thread (sqlite3 connections must not cross threads)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    def get(self, key: str) -> EvalResult | None:
        row = self._connection().execute("SELECT result FROM results WHERE key = ?", (key,)).fetchone()
        return EvalResult.from_row(json.loads(row[0])) if row else None

    def get_many(self, keys: Iterable[str]) -> dict[str, EvalResult]:
        """The cached results among `keys` (missing keys are absent)."""
        unique = list(dict.fromkeys(keys))
        found: dict[str, EvalResult] = {}
        conn = self._connection()
        for start in range(0, len(unique), 500):  # SQLite caps the number of bound parameters
            chunk = unique[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for key, text in conn.execute(f"SELECT key, result FROM results WHERE key IN ({marks})", chunk):
                found[key] = EvalResult.from_row(json.loads(text))
        return found

    def results(self) -> Iterator[EvalResult]:
        """Every stored result, in key order (so an export of the same cache is the same file)."""
        for (text,) in self._connection().execute("SELECT result FROM results ORDER BY key"):
            yield EvalResult.from_row(json.loads(text))

    def put(self, result: EvalResult) -> bool:
        """Store `result` under its key; False if the key was already there (first one wins)."""
        cursor = self._connection().execute(
            "INSERT OR IGNORE INTO results (key, status, result, stored_at) VALUES (?, ?, ?, ?)",
            (result.key, result.status, result.to_json(), time.time()),
        )
        return cursor.rowcount == 1

    def __contains__(self, key: str) -> bool:
        return self._connection().execute("SELECT 1 FROM results WHERE key = ?", (key,)).fetchone() is not None

    def __len__(self) -> int:
        return int(self._connection().execute("SELECT COUNT(*) FROM results").fetchone()[0])

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def export_evals(cache_path: str | os.PathLike[str] | None, output: str | os.PathLike[str]) -> int:
    """Write every result of the cache at `cache_path` to `output` as the ``evals`` table; the row count.

    One row per key (the cache's primary key, the ``eval_key`` of ``trajectories``). `output` is
    rewritten whole, so exporting again replaces the rows instead of adding to them. No cache
    (`cache_path` None, as with ``gym.cache: null``, or no file: a backend that keeps none here)
    gives an empty table, without creating one.
    """
    if cache_path is None or not Path(cache_path).exists():
        write_table([], output, "evals")
        return 0
    cache = ResultCache(cache_path)
    try:
        rows = [result.to_row() for result in cache.results()]
    finally:
        cache.close()
    write_table(rows, output, "evals")
    log.info("wrote %s: %d evaluations from the result cache %s", output, len(rows), cache_path)
    return len(rows)
