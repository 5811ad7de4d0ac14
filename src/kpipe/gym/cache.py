"""The KernelGym result cache: one SQLite file (WAL mode) of results keyed by ``eval_key``.

The key hashes (reference, candidate, protocol, device kind), so an identical evaluation is
free wherever it comes from: a duplicate in a batch, a rerun of a killed stage, another
stage. SQLite in WAL mode lets many processes (batch jobs of a Snakemake run, the HTTP
service) read while one writes; writers wait on a busy timeout instead of failing. The
first result stored under a key wins: equal keys describe the same evaluation.

Only real results are stored: a job that lost its worker twice is answered ``crashed``
but not cached, so the next run tries it again.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from kpipe.gym.result import EvalResult

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
