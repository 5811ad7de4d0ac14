"""Ingest: the evaluation ``tasks`` and the decontaminated training ``queries``, from config dicts.

The Snakemake rules and ``kpipe data`` call these with the ``kernelbench:`` and ``queries:``
sections of the (schema-validated) config, so both paths build identical tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from kpipe.data.decontam import decontaminate
from kpipe.data.io import to_table
from kpipe.data.kernelbench import select_problems, task_rows
from kpipe.data.sources import SourceError, level_ids, load_source

__all__ = ["SourceError", "build_queries", "build_tasks", "load_source"]


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
