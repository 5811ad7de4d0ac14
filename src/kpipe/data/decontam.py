"""Decontamination: training queries must not duplicate, or nearly duplicate, an evaluation task.

Two tests, cheapest first:

- **exact**: the query's normalised-source hash (comments, docstrings and layout removed,
  ``kpipe.data.source_text``) equals a task's;
- **near**: Jaccard similarity of the two programs' token-shingle sets reaches a threshold.
  Tokens are normalised so that the edits that leave a task the same task do not hide it:
  numbers become one token (changed sizes), local names become one token (renamed
  variables), while attribute names (``torch.matmul``, ``nn.Conv2d``) and Python keywords
  stay, because they are what distinguishes one task from another.

KernelBench problems share a template (``class Model(nn.Module)``, ``__init__``,
``get_inputs``, ``get_init_inputs``) that makes two unrelated problems share ~70% of their
shingles. Shingles found in more than ``BOILERPLATE_FRACTION`` of the vendored KernelBench
problems are therefore removed before comparing, so similarity measures the computation;
the reference set is fixed (not the evaluation selection), so results do not depend on how
many tasks are evaluated.

Similarity is exact Jaccard (no MinHash approximation), computed with an inverted index of
the tasks' shingles: ~72k queries x 250 tasks take seconds.
"""

from __future__ import annotations

import builtins
import functools
import keyword
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from kpipe.data.kernelbench import VERSIONS, load_problems
from kpipe.data.sources import STAGES

MODES = ("drop", "flag")
SHINGLE_SIZE = 5
BOILERPLATE_FRACTION = 0.05
QUERY_CHUNK = 4096  # queries matched per vectorised step (bounds memory to ~chunk x tasks)

_COMMENT = re.compile(r"#[^\n]*")
_TRIPLE_QUOTED = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'')
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|\*\*|//|[^\s\w]")
_KEPT_NAMES = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"torch", "nn", "F", "self", "super"}
_NUMBER, _NAME = "0", "v"
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier for combining token hashes


def tokens(src: str) -> list[str]:
    """Normalised tokens of a Python source: numbers and local names abstracted, attributes kept."""
    text = _TRIPLE_QUOTED.sub(" ", _COMMENT.sub("", src))
    out, previous = [], ""
    for token in _TOKEN.findall(text):
        if token[0].isdigit():
            token = _NUMBER
        elif (token[0].isalpha() or token[0] == "_") and previous != "." and token not in _KEPT_NAMES:
            token = _NAME
        out.append(token)
        previous = token
    return out


def _combine(hashed: np.ndarray, size: int) -> np.ndarray:
    """Hash of every window of `size` consecutive token hashes (wrapping uint64 arithmetic)."""
    count = max(len(hashed) - size + 1, 0)
    grams = np.zeros(count, dtype=np.uint64)
    for offset in range(size):
        grams = grams * _MIX + hashed[offset : offset + count]
    return grams


def shingle_sets(sources: Sequence[str], size: int = SHINGLE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Unique token-`size`-gram hashes of many sources at once, flat: (hashes, owning source index).

    Batched because per-source numpy calls, not the arithmetic, dominate at 72k sources.
    Hashes are stable across runs and machines (pandas' keyed SipHash of the token text).
    """
    token_lists = [tokens(src) for src in sources]
    lengths = np.array([len(toks) for toks in token_lists], dtype=np.int64)
    hashed = pd.util.hash_array(np.array([t for toks in token_lists for t in toks], dtype=object))
    grams = _combine(hashed, size)
    ends = np.cumsum(lengths)
    owner = np.repeat(np.arange(len(sources)), lengths)[: len(grams)]
    complete = np.arange(len(grams)) + size <= ends[owner] if len(grams) else np.zeros(0, bool)
    grams, owner = grams[complete], owner[complete]
    order = np.lexsort((grams, owner))
    grams, owner = grams[order], owner[order]
    first = np.ones(len(grams), dtype=bool)
    first[1:] = (grams[1:] != grams[:-1]) | (owner[1:] != owner[:-1])
    return grams[first], owner[first]


@functools.lru_cache(maxsize=4)
def boilerplate(size: int = SHINGLE_SIZE, fraction: float = BOILERPLATE_FRACTION) -> np.ndarray:
    """Shingles present in more than `fraction` of all vendored KernelBench problems (sorted)."""
    codes = [p.code for version in VERSIONS for p in load_problems(version)]
    grams, _ = shingle_sets(codes, size)
    values, counts = np.unique(grams, return_counts=True)
    return values[counts > fraction * len(codes)]


def content_shingle_sets(sources: Sequence[str], size: int = SHINGLE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """`shingle_sets` without the KernelBench template; a source left with nothing keeps all its shingles."""
    grams, owner = shingle_sets(sources, size)
    template = np.isin(grams, boilerplate(size))
    emptied = np.setdiff1d(owner, owner[~template])
    keep = ~template | np.isin(owner, emptied)
    return grams[keep], owner[keep]


class TaskIndex:
    """An inverted index from shingle to the evaluation tasks that contain it."""

    def __init__(self, task_sources: Sequence[str], size: int = SHINGLE_SIZE) -> None:
        grams, owner = content_shingle_sets(task_sources, size)
        self.size = size
        self.set_sizes = np.bincount(owner, minlength=len(task_sources))
        order = np.argsort(grams, kind="stable")
        self.vocabulary, starts = np.unique(grams[order], return_index=True)
        self.owners = owner[order]
        self.starts = np.append(starts, len(grams))

    def best_matches(self, sources: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """For each source: (index of its most similar task, that Jaccard similarity of shingle sets)."""
        n_queries, n_tasks = len(sources), len(self.set_sizes)
        grams, query_of = content_shingle_sets(sources, self.size)
        sizes = np.bincount(query_of, minlength=n_queries)
        position = np.minimum(np.searchsorted(self.vocabulary, grams), max(len(self.vocabulary) - 1, 0))
        hit = self.vocabulary[position] == grams if len(self.vocabulary) else np.zeros(len(grams), bool)
        query_of, position = query_of[hit], position[hit]
        spans = self.starts[position + 1] - self.starts[position]
        pair_query = np.repeat(query_of, spans)
        first = np.repeat(self.starts[position], spans)
        within = np.arange(len(first)) - np.repeat(np.cumsum(spans) - spans, spans)
        pair_task = self.owners[first + within]
        overlap = np.bincount(pair_query * n_tasks + pair_task, minlength=n_queries * n_tasks)
        overlap = overlap.reshape(n_queries, n_tasks)
        union = sizes[:, None] + self.set_sizes[None, :] - overlap
        similarity = np.divide(overlap, union, out=np.zeros(overlap.shape), where=union > 0)
        best = similarity.argmax(axis=1)
        return best, similarity[np.arange(n_queries), best]


def decontaminate(
    queries: pa.Table,
    tasks: pa.Table,
    mode: str = "drop",
    threshold: float = 0.8,
    shingle_size: int = SHINGLE_SIZE,
) -> tuple[pa.Table, dict[str, Any]]:
    """Mark every query against the evaluation `tasks`; drop or keep-flagged the contaminated ones.

    Queries repeating an earlier query's normalised source are merged into it in both modes (they
    would weight one problem twice in training), the copy kept carrying every copy's stages
    (`merge_repeated_references`). Returns the table and the counts for the log:
    ``total, training_duplicates, exact_duplicates, near_duplicates, kept`` and ``lost_by_source``.
    """
    if mode not in MODES:
        raise ValueError(f"decontamination mode {mode!r}: choose one of {', '.join(MODES)}")
    if not 0 < threshold <= 1:
        raise ValueError(f"decontamination threshold {threshold}: must be in (0, 1]")
    total = queries.num_rows
    sources_before = queries["source"].to_pylist()
    queries = merge_repeated_references(queries)

    task_ids = tasks["task_id"].to_pylist()
    task_of_hash = dict(zip(tasks["reference_hash"].to_pylist(), task_ids))
    query_hashes = queries["reference_hash"].to_pylist()
    exact = np.array([h in task_of_hash for h in query_hashes], dtype=bool)
    best_task: list[str | None] = [task_of_hash.get(h) for h in query_hashes]
    similarity = np.where(exact, 1.0, 0.0)

    if len(task_ids) and queries.num_rows:
        index = TaskIndex(tasks["reference_src"].to_pylist(), shingle_size)
        sources = queries["reference_src"].to_pylist()
        for start in tqdm(range(0, len(sources), QUERY_CHUNK), desc="decontaminate", unit="chunk", leave=False):
            chunk = range(start, min(start + QUERY_CHUNK, len(sources)))
            best, score = index.best_matches(sources[chunk.start : chunk.stop])
            for offset, i in enumerate(chunk):
                if not exact[i] and score[offset] > 0:  # no shared shingle: no closest task
                    best_task[i], similarity[i] = task_ids[best[offset]], score[offset]

    contaminated = exact | (similarity >= threshold)
    near = contaminated & ~exact
    queries = (
        queries.set_column(queries.schema.get_field_index("contaminated"), "contaminated", pa.array(contaminated))
        .set_column(
            queries.schema.get_field_index("contaminated_with"),
            "contaminated_with",
            pa.array(best_task, pa.string()),
        )
        .set_column(
            queries.schema.get_field_index("similarity"),
            "similarity",
            pa.array(similarity if len(task_ids) else [None] * queries.num_rows, pa.float64()),
        )
    )
    lost = losses_by_source(sources_before, queries["source"].to_pylist(), exact, near)
    if mode == "drop":
        queries = queries.filter(pa.array(~contaminated))
    counts = {
        "mode": mode,
        "threshold": threshold,
        "total": total,
        "training_duplicates": total - len(query_hashes),
        "exact_duplicates": int(exact.sum()),
        "near_duplicates": int(near.sum()),
        "kept": queries.num_rows,
        "lost_by_source": lost,
    }
    return queries, counts


def merge_repeated_references(queries: pa.Table) -> pa.Table:
    """One row per normalised reference: the first copy, carrying the stages of every copy.

    A reference found in two sources (the SFT file and the RL file of cudaLLM share some) is one
    problem, trained on once per stage; keeping only the first copy's stages silently took every such
    query out of RL, whose file comes second.
    """
    if not queries.num_rows:
        return queries
    hashes = queries["reference_hash"].to_pylist()
    stages = queries["stages"].to_pylist()
    first_row: dict[str, int] = {}
    merged: dict[str, set[str]] = {}
    for row, (digest, row_stages) in enumerate(zip(hashes, stages)):
        first_row.setdefault(digest, row)
        merged.setdefault(digest, set()).update(row_stages or STAGES)
    keep = sorted(first_row.values())
    table = queries.take(pa.array(keep))
    column = table.schema.get_field_index("stages")
    kept_stages = [[stage for stage in STAGES if stage in merged[hashes[row]]] for row in keep]
    return table.set_column(column, table.schema.field(column), pa.array(kept_stages, table.schema.field(column).type))


def losses_by_source(sources_before: list[str], sources_kept: list[str], exact: np.ndarray,
                     near: np.ndarray) -> dict[str, dict[str, int]]:
    """How many queries each source lost, and why: a repeat of an earlier query's reference
    (``repeated``, its stages merged into the copy kept), or contamination (``exact``, ``near``)."""
    lost: dict[str, dict[str, int]] = {}
    for source in dict.fromkeys(sources_before):
        repeated = sources_before.count(source) - sources_kept.count(source)
        lost[source] = {
            "repeated": repeated,
            "exact": int(sum(e for e, s in zip(exact, sources_kept) if s == source)),
            "near": int(sum(n for n, s in zip(near, sources_kept) if s == source)),
        }
    return lost
