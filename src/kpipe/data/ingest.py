"""Ingest: the evaluation ``tasks`` and the decontaminated training ``queries``, from config dicts.

The Snakemake rules and ``kpipe data`` call these with the ``kernelbench:`` and ``queries:``
sections of the (schema-validated) config, so both paths build identical tables. The rules'
jobs (``*_job``) read and write the tables: `ingest_tasks`, `ingest_queries` (one source each)
and `decontaminate` (all sources against the tasks).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from kpipe.data.decontam import decontaminate
from kpipe.data.io import read_table, to_table, write_table
from kpipe.data.kernelbench import select_problems, task_rows
from kpipe.data.sources import SourceError, level_ids, load_source

__all__ = ["SourceError", "build_queries", "build_tasks", "decontaminate_job", "ingest_queries_job",
           "ingest_tasks_job", "load_source"]


def build_tasks(kernelbench: Mapping[str, Any]) -> pa.Table:
    """The evaluation tasks: ``version``, ``levels``, ``ids`` (``level_N: [...]``), ``size_cap``."""
    version = kernelbench.get("version", "main")
    levels = list(kernelbench.get("levels", [1, 2, 3]))
    problems = select_problems(version, levels, level_ids(kernelbench.get("ids")))
    if not problems:
        raise ValueError(f"kernelbench: the selection (version {version}, levels {levels}) is empty")
    return to_table(task_rows(problems, "eval", kernelbench.get("size_cap")), "tasks")


def build_queries(queries: Mapping[str, Any], tasks: pa.Table) -> tuple[pa.Table, dict[str, Any]]:
    """All configured sources, normalised, concatenated and decontaminated against `tasks`.

    Returns the queries and the counts for the log: rows per source plus the
    decontamination counts (``kpipe.data.decontam.decontaminate``).
    """
    sources = list(queries.get("sources", []))
    if not sources:
        raise SourceError("queries: no sources configured")
    names = [spec.get("name", spec.get("kind")) for spec in sources]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise SourceError(f"queries: source name(s) {repeated} used more than once")
    loaded = {name: load_source(spec) for name, spec in zip(names, sources)}
    settings = queries.get("decontamination", {})
    table, counts = decontaminate(
        pa.concat_tables(loaded.values()),
        tasks,
        mode=settings.get("mode", "drop"),
        threshold=settings.get("threshold", 0.8),
    )
    return table, {"sources": {name: part.num_rows for name, part in loaded.items()}, **counts}


def ingest_tasks_job(kernelbench: Mapping[str, Any], out_path: str | os.PathLike) -> pa.Table:
    """Rule `ingest_tasks`: the evaluation tasks of the ``kernelbench:`` section -> `out_path`."""
    tasks = build_tasks(kernelbench)
    write_table(tasks, out_path, "tasks")
    print(f"{tasks.num_rows} tasks -> {out_path}")
    return tasks


def ingest_queries_job(source: Mapping[str, Any], out_path: str | os.PathLike) -> pa.Table:
    """Rule `ingest_queries`: one ``queries.sources`` entry in the queries schema -> `out_path`."""
    queries = load_source(source)
    write_table(queries, out_path, "queries")
    print(f"{queries.num_rows} queries from {source.get('name', source.get('kind'))} -> {out_path}")
    return queries


def decontaminate_job(tasks_path: str | os.PathLike, query_paths: Sequence[str | os.PathLike],
                      out_path: str | os.PathLike, counts_path: str | os.PathLike,
                      decontamination: Mapping[str, Any]) -> dict[str, Any]:
    """Rule `decontaminate`: every source's queries against the tasks (``queries.decontamination``),
    the kept ones -> `out_path`, the counts -> `counts_path` (JSON)."""
    tasks = read_table(tasks_path, "tasks")
    queries = pa.concat_tables([read_table(path, "queries") for path in query_paths])
    mode, threshold = decontamination["mode"], decontamination["threshold"]
    kept, counts = decontaminate(queries, tasks, mode=mode, threshold=threshold)
    write_table(kept, out_path, "queries")
    with open(counts_path, "w") as handle:
        json.dump(counts, handle, indent=2)
    print(f"decontamination ({mode}, threshold {threshold}): {counts}")
    return counts
