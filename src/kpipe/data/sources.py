"""Training-query sources, each read in its own published schema and normalised into ``queries``.

Every source is a local Parquet/JSONL file (or a directory of them) or, where the optional
``datasets`` package is installed and the hub is reachable, a hub dataset id. Each loader
checks the columns it needs, including nested types, before touching a row, so a wrong or
truncated download fails with one ``SourceError`` line naming the source, the path and the
problem instead of a traceback from deep inside.

Column names and types below were confirmed on 2026-11-21 from:

- ``hkust-nlp/drkernel-rl-data`` -- its dataset card (README.md, commit f715c60):
  ``data_source: string``, ``prompt: list<struct<role, content>>``, ``ability: string``,
  ``reward_model: struct<ground_truth: string, style: string>`` (ground_truth = the PyTorch
  reference), ``extra_info: struct<entry_point, level, module_name, ops, original_prompt,
  repo_name, type, uuid>``; the card's example shows ``uuid`` = ``"cuda_llm_763652"``,
  ``level`` = ``"0"`` (a string) and ``ops`` = a JSON-encoded list of op names.
- ``hkust-nlp/drkernel-coldstart-8k`` -- its dataset card (commit cba0ef0) and hub viewer:
  ``messages: list<struct<role: string, content: string>>`` (10 messages), ``uuid: int64``,
  ``entry_point``, ``repo_name``, ``module_name: string``, ``final_speedup: double``,
  ``num_rounds: int64``, ``original_python_code: string`` (KernelBench format, class
  ``Model``), ``best_round: int64``, ``timestamp: double``, ``conversion_mode: string``,
  ``enable_thinking: bool``.
- ``GPUMODE/KernelBook`` -- code that loads it with ``datasets`` and reads its columns
  (an analysis script found by code search, and the KernelGYM-derived loaders): ``python_code``
  (PyTorch module named ``entry_point`` plus ``get_inputs()`` and ``get_init_inputs()``
  returning ``[args, kwargs]``), ``triton_code``, ``original_triton_code``, ``entry_point``,
  ``repo_name``, ``module_name``, ``synthetic``, ``licenses``, ``stars``, ``sha``,
  ``repo_link``, ``uuid``.
- ``ByteDance-Seed/cudaLLM-data`` -- no dataset card text was found; the columns come from
  code that reads ``rl_cuda_llm_0424.parquet`` (the prime-environments ``cuda_llm`` verifier
  env: ``prompt`` chat list, ``py_code``, ``level``, ``type``, ``ops``, ``ability``,
  ``data_source``) and from a KernelGYM sampling script that reads ``sft_cuda_llm_r1.parquet``
  through ``py_code`` or ``reward_model.ground_truth``. The loader therefore takes the
  reference from ``py_code`` and falls back to ``reward_model.ground_truth``; the types of
  ``level`` and ``ops`` are not documented, so both integers and strings are accepted.
  ``sft_cuda_llm_r1.parquet`` (kind ``cudallm_sft``: the paper's cold-start queries, "8K kernel-generation
  queries from CUDALLM-SFT", Dr. Kernel §4.1) is described by that script's docstring as ``messages``,
  ``py_code`` (or ``original_python_code``) and ``reward_model`` (``{ground_truth, entry_point}``); the
  loader takes the first of those three references that a row has, and no id column is known, so a
  row's id is its reference's hash.

Each source feeds the stages its config entry names (``stages``: ``distill`` and/or ``rl``; both by
default), recorded per query in the ``stages`` column: the paper distils its cold start from the SFT
file and trains RL on the RL file (``config/paper.yaml``); `training_queries` reads one stage's queries.
"""

from __future__ import annotations

import ast
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from tqdm import tqdm

from kpipe.data.io import read_table, to_table
from kpipe.data.kernelbench import select_problems, shrink_sizes
from kpipe.data.source_text import source_hash

log = logging.getLogger(__name__)

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class SourceError(ValueError):
    """A query source is missing, unreadable, empty or not in its published schema."""


# --- Arrow type predicates: what a column must hold -------------------------------------


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_int_or_text(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or _is_text(kind) or pa.types.is_null(kind)


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _is_messages(kind: pa.DataType) -> bool:
    """list<struct<role: string, content: string>>: a chat history."""
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    item = kind.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(name in names and _is_text(names[name]) for name in ("role", "content"))


def _is_text_list_or_text(kind: pa.DataType) -> bool:
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    return _is_text(kind) or (is_list and _is_text(kind.value_type)) or pa.types.is_null(kind)


@dataclass(frozen=True)
class Column:
    """A column (``a.b`` reaches into a struct) that must exist with a type `check` accepts."""

    path: str
    check: Callable[[pa.DataType], bool]
    expected: str
    required: bool = True


def _column_type(schema: pa.Schema, path: str) -> pa.DataType | None:
    """The type at a dotted path through struct fields, or None where the path does not exist."""
    head, *rest = path.split(".")
    if head not in schema.names:
        return None
    kind = schema.field(head).type
    for name in rest:
        if not pa.types.is_struct(kind) or kind.get_field_index(name) < 0:
            return None
        kind = kind.field(name).type
    return kind


def schema_problems(schema: pa.Schema, columns: Iterable[Column]) -> list[str]:
    """What is wrong with `schema` for these columns: one phrase per missing or mistyped column."""
    problems = []
    for column in columns:
        kind = _column_type(schema, column.path)
        if kind is None:
            if column.required:
                problems.append(f"missing column {column.path!r} ({column.expected})")
        elif not column.check(kind):
            problems.append(f"column {column.path!r} is {kind}, expected {column.expected}")
    return problems


# --- Reading files ------------------------------------------------------------------------


def data_files(path: Path) -> list[Path]:
    """The Parquet/JSONL files a source path names: the file itself or a directory's files."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
    return [path]


def _read_file(path: Path) -> pa.Table:
    if path.suffix == ".parquet":
        return pq.read_table(path)
    if path.suffix in (".jsonl", ".json"):
        return pa_json.read_json(path)
    raise ValueError(f"unsupported file type {path.suffix!r} (expected one of {', '.join(DATA_SUFFIXES)})")


def read_local(path: str | Path, where: str) -> pa.Table:
    """All rows of a local source; any read failure becomes a SourceError naming `where`."""
    path = Path(path)
    if not path.exists():
        raise SourceError(f"{where}: no such file or directory {path}")
    files = data_files(path)
    if not files:
        raise SourceError(f"{where}: directory {path} holds no {'/'.join(DATA_SUFFIXES)} files")
    tables = []
    for file in files:
        try:
            tables.append(_read_file(file))
        except (OSError, ValueError, pa.ArrowException) as error:
            raise SourceError(f"{where}: cannot read {file}: {error}") from None
    try:
        return pa.concat_tables(tables, promote_options="default")
    except pa.ArrowException as error:
        raise SourceError(f"{where}: files under {path} disagree in schema: {error}") from None


def read_hub(hub_id: str, hub_file: str | None, where: str) -> pa.Table:
    """A hub dataset through ``datasets`` (optional: the `hub` extra), else a SourceError."""
    hint = "download the dataset files and pass `path:` instead"
    try:
        import datasets
    except ImportError:
        raise SourceError(
            f"{where}: hub dataset {hub_id!r} needs the `datasets` package (pip install 'kpipe[hub]'), "
            f"which is not installed; {hint}"
        ) from None
    try:
        dataset = datasets.load_dataset(hub_id, data_files=hub_file, split="train")
    except Exception as error:  # network, auth, missing file: all mean "use a local copy"
        reason = f"{type(error).__name__}: {error}"
        raise SourceError(f"{where}: cannot load hub dataset {hub_id!r}: {reason}; {hint}") from None
    return dataset.data.table


# --- Normalising rows ------------------------------------------------------------------------


def parse_level(value: Any) -> int | None:
    """A level from an int, a numeric string ("0") or nothing; anything else is no level."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def name_from_ops(ops: Any) -> str | None:
    """A short name from an op list (a list or its JSON text): ["torch.abs", "nn.Conv2d"] -> "abs_Conv2d"."""
    if isinstance(ops, str):
        try:
            ops = json.loads(ops)
        except json.JSONDecodeError:
            return ops.strip() or None
    if not isinstance(ops, list) or not ops:
        return None
    return "_".join(str(op).rsplit(".", 1)[-1] for op in ops)


def kernelbook_reference(code: str, entry_point: str) -> str:
    """A KernelBook module as a KernelBench reference (class ``Model``, ``Model(*get_init_inputs())``).

    KernelBook builds ``entry_point(*args, **kwargs)`` from ``get_init_inputs() -> [args,
    kwargs]``; appending a ``Model`` subclass that takes ``(args, kwargs)`` gives the
    KernelBench calling convention without rewriting the scraped module itself.
    """
    base = entry_point
    if entry_point == "Model":
        base = "KernelBookModel"
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Model":
                node.name = base
            elif isinstance(node, ast.Name) and node.id == "Model":
                node.id = base
        code = ast.unparse(tree)
    adapter = (
        f"\n\n\nclass Model({base}):\n"
        "    def __init__(self, init_args, init_kwargs):\n"
        "        super().__init__(*init_args, **init_kwargs)\n"
    )
    return code.rstrip() + adapter


def defines_class(code: str, name: str) -> bool:
    """Whether `code` parses and defines a top-level class `name`."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(node, ast.ClassDef) and node.name == name for node in tree.body)


def query_row(kind: str, source_id: str, reference: str, level: int | None, name: str | None) -> dict[str, Any]:
    """One undecontaminated ``queries`` row."""
    return {
        "query_id": f"{kind}-{source_id}",
        "source": kind,
        "source_id": source_id,
        "level": level,
        "name": name,
        "reference_src": reference,
        "reference_hash": source_hash(reference),
        "contaminated": False,
        "contaminated_with": None,
        "similarity": None,
    }


def _get(row: Mapping[str, Any], path: str) -> Any:
    value: Any = row
    for name in path.split("."):
        value = value.get(name) if isinstance(value, Mapping) else None
    return value


def _cudallm_row(row: Mapping[str, Any]) -> dict[str, Any] | None:
    reference = row.get("py_code") or _get(row, "reward_model.ground_truth")
    if not reference:
        return None
    source_id = str(row["uuid"]) if row.get("uuid") is not None else source_hash(reference)
    name = name_from_ops(row.get("ops")) or row.get("type") or None
    return query_row("cudallm", source_id, reference, parse_level(row.get("level")), name)


def _cudallm_sft_row(row: Mapping[str, Any]) -> dict[str, Any] | None:
    reference = row.get("py_code") or row.get("original_python_code") or _get(row, "reward_model.ground_truth")
    if not reference:
        return None
    source_id = str(row["uuid"]) if row.get("uuid") is not None else source_hash(reference)
    name = _get(row, "reward_model.entry_point") or row.get("entry_point") or None
    return query_row("cudallm_sft", source_id, reference, parse_level(row.get("level")), name)


def _drkernel_rl_row(row: Mapping[str, Any]) -> dict[str, Any] | None:
    reference = _get(row, "reward_model.ground_truth")
    uuid = _get(row, "extra_info.uuid")
    if not reference or uuid is None:
        return None
    name = name_from_ops(_get(row, "extra_info.ops")) or _get(row, "extra_info.module_name")
    return query_row("drkernel_rl", str(uuid), reference, parse_level(_get(row, "extra_info.level")), name)


def _drkernel_coldstart_row(row: Mapping[str, Any]) -> dict[str, Any] | None:
    reference = row.get("original_python_code")
    if not reference or row.get("uuid") is None:
        return None
    return query_row("drkernel_coldstart", str(row["uuid"]), reference, None, row.get("entry_point"))


def _kernelbook_row(row: Mapping[str, Any]) -> dict[str, Any] | None:
    code, entry_point = row.get("python_code"), row.get("entry_point")
    if not code or not entry_point or row.get("uuid") is None or not defines_class(code, entry_point):
        return None
    return query_row("kernelbook", str(row["uuid"]), kernelbook_reference(code, entry_point), None, entry_point)


@dataclass(frozen=True)
class SourceKind:
    """A published dataset: where it lives on the hub, the columns it must have, how rows map."""

    kind: str
    hub_id: str
    hub_file: str | None
    columns: tuple[Column, ...]
    to_query: Callable[[Mapping[str, Any]], dict[str, Any] | None]
    reads: tuple[str, ...]  # top-level columns `to_query` uses (chats and Triton code are left unread)
    any_of: tuple[str, ...] = field(default=())  # at least one of these columns must exist
    description: str = ""


TEXT, MESSAGES = "string", "list<struct<role: string, content: string>>"

KINDS: dict[str, SourceKind] = {
    "cudallm": SourceKind(
        kind="cudallm",
        hub_id="ByteDance-Seed/cudaLLM-data",
        hub_file="rl_cuda_llm_0424.parquet",
        columns=(
            Column("py_code", _is_text, TEXT, required=False),
            Column("reward_model.ground_truth", _is_text, TEXT, required=False),
            Column("prompt", _is_messages, MESSAGES, required=False),
            Column("level", _is_int_or_text, "integer or string", required=False),
            Column("ops", _is_text_list_or_text, "string or list<string>", required=False),
            Column("type", _is_text, TEXT, required=False),
        ),
        any_of=("py_code", "reward_model.ground_truth"),
        to_query=_cudallm_row,
        reads=("py_code", "reward_model", "uuid", "ops", "type", "level"),
        description="cudaLLM RL queries (paper: the RL queries); reference = py_code",
    ),
    "cudallm_sft": SourceKind(
        kind="cudallm_sft",
        hub_id="ByteDance-Seed/cudaLLM-data",
        hub_file="sft_cuda_llm_r1.parquet",
        columns=(
            Column("py_code", _is_text, TEXT, required=False),
            Column("original_python_code", _is_text, TEXT, required=False),
            Column("reward_model.ground_truth", _is_text, TEXT, required=False),
            Column("reward_model.entry_point", _is_text, TEXT, required=False),
            Column("messages", _is_messages, MESSAGES, required=False),
            Column("level", _is_int_or_text, "integer or string", required=False),
        ),
        any_of=("py_code", "original_python_code", "reward_model.ground_truth"),
        to_query=_cudallm_sft_row,
        reads=("py_code", "original_python_code", "reward_model", "uuid", "entry_point", "level"),
        description="cudaLLM SFT queries (paper: the 8K cold-start queries); reference = py_code",
    ),
    "drkernel_rl": SourceKind(
        kind="drkernel_rl",
        hub_id="hkust-nlp/drkernel-rl-data",
        hub_file=None,
        columns=(
            Column("prompt", _is_messages, MESSAGES),
            Column("reward_model.ground_truth", _is_text, TEXT),
            Column("extra_info.uuid", _is_int_or_text, "string"),
            Column("extra_info.level", _is_int_or_text, "string or integer"),
            Column("extra_info.ops", _is_text_list_or_text, "string (JSON list)", required=False),
        ),
        to_query=_drkernel_rl_row,
        reads=("reward_model", "extra_info"),
        description="released Dr. Kernel RL queries (71,996); reference = reward_model.ground_truth",
    ),
    "drkernel_coldstart": SourceKind(
        kind="drkernel_coldstart",
        hub_id="hkust-nlp/drkernel-coldstart-8k",
        hub_file=None,
        columns=(
            Column("messages", _is_messages, MESSAGES),
            Column("original_python_code", _is_text, TEXT),
            Column("uuid", _is_int_or_text, "int64"),
            Column("final_speedup", _is_number, "double"),
            Column("best_round", _is_number, "int64"),
        ),
        to_query=_drkernel_coldstart_row,
        reads=("original_python_code", "uuid", "entry_point"),
        description="released Dr. Kernel cold-start trajectories (8,920); reference = original_python_code",
    ),
    "kernelbook": SourceKind(
        kind="kernelbook",
        hub_id="GPUMODE/KernelBook",
        hub_file=None,
        columns=(
            Column("python_code", _is_text, TEXT),
            Column("entry_point", _is_text, TEXT),
            Column("uuid", _is_int_or_text, "int64 or string"),
            Column("triton_code", _is_text, TEXT, required=False),
        ),
        to_query=_kernelbook_row,
        reads=("python_code", "entry_point", "uuid"),
        description="KernelBook PyTorch modules (18,162), wrapped into KernelBench's Model convention",
    ),
}

KERNELBENCH_DESCRIPTION = "vendored KernelBench problems (version/levels/ids, optional size cap) as training queries"
STAGES = ("distill", "rl")  # the stages that train on queries: cold-start distillation and RL


def describe(spec: Mapping[str, Any]) -> str:
    """How a source config is named in errors: its name, kind and where it is read from."""
    place = spec.get("path") or spec.get("hub") or "vendored data"
    return f"query source {spec.get('name', spec.get('kind'))!r} ({spec.get('kind')}, {place})"


def level_ids(ids: Mapping[Any, list[int]] | None) -> dict[int, list[int]]:
    """Config ids (``level_1: [...]``, or plain integer keys) as {level: ids}."""
    out = {}
    for key, values in (ids or {}).items():
        level = parse_level(str(key).removeprefix("level_"))
        if level is None:
            raise SourceError(f"ids: key {key!r} is not a level (use level_1, level_2, level_3)")
        out[level] = list(values)
    return out


def kernelbench_queries(spec: Mapping[str, Any]) -> pa.Table:
    """KernelBench problems as training queries (the offline default's stand-in for cudaLLM)."""
    version = spec.get("version", "main")
    try:
        problems = select_problems(version, list(spec.get("levels", [1, 2])), level_ids(spec.get("ids")))
    except ValueError as error:
        raise SourceError(f"{describe(spec)}: {error}") from None
    size_cap = spec.get("size_cap")
    rows = []
    for problem in problems[: spec.get("limit")]:
        row = query_row("kernelbench", problem.task_id.removeprefix("kb-"), problem.code, problem.level, problem.name)
        if size_cap:  # the hash stays that of the original problem, as for tasks
            row["reference_src"] = shrink_sizes(problem.code, size_cap)
        rows.append(row)
    if not rows:
        raise SourceError(f"{describe(spec)}: the selection is empty")
    return to_table(rows, "queries")


def raw_table(spec: Mapping[str, Any]) -> pa.Table:
    """The source's rows in its own schema: from `path` where it exists, else from `hub`."""
    kind = KINDS[spec["kind"]]
    where = describe(spec)
    path, hub = spec.get("path"), spec.get("hub")
    if path and (Path(path).exists() or not hub):
        return read_local(path, where)
    if hub:
        if path:
            where = f"{where} (local path {path} does not exist)"
        return read_hub(hub, spec.get("hub_file") or kind.hub_file, where)
    raise SourceError(f"{where}: give `path:` (a local Parquet/JSONL file or directory) or `hub:` ({kind.hub_id})")


def normalise(table: pa.Table, kind: SourceKind, where: str, limit: int | None = None) -> pa.Table:
    """Check `table` against the kind's schema, then map its rows into ``queries``."""
    problems = schema_problems(table.schema, kind.columns)
    if kind.any_of and all(_column_type(table.schema, path) is None for path in kind.any_of):
        problems.append(f"none of the columns {', '.join(map(repr, kind.any_of))} is present")
    if problems:
        raise SourceError(f"{where}: not in the {kind.kind} schema: {'; '.join(problems)}")
    if table.num_rows == 0:
        raise SourceError(f"{where}: no rows")
    if limit:
        table = table.slice(0, limit)
    table = table.select([name for name in kind.reads if name in table.schema.names])
    rows, skipped = [], 0
    for row in tqdm(table.to_pylist(), desc=f"normalise {kind.kind}", unit="row", leave=False):
        query = kind.to_query(row)
        if query is None:
            skipped += 1
        else:
            rows.append(query)
    if skipped:
        log.warning("%s: skipped %d of %d rows without a usable reference", where, skipped, table.num_rows)
    if not rows:
        raise SourceError(f"{where}: none of its {table.num_rows} rows has a usable reference")
    return to_table(rows, "queries")


def load_source(spec: Mapping[str, Any]) -> pa.Table:
    """One configured source (``name, kind, path | hub [, hub_file], limit, stages``...) as ``queries`` rows."""
    stages = list(spec.get("stages") or STAGES)
    if not set(stages) <= set(STAGES):
        raise SourceError(f"{describe(spec)}: stages {stages} must be among {', '.join(STAGES)}")
    if spec.get("kind") == "kernelbench":
        table = kernelbench_queries(spec)
    elif spec.get("kind") in KINDS:
        table = normalise(raw_table(spec), KINDS[spec["kind"]], describe(spec), spec.get("limit"))
    else:
        known = ", ".join(["kernelbench", *KINDS])
        raise SourceError(f"{describe(spec)}: unknown kind {spec.get('kind')!r}; known: {known}")
    column = table.schema.get_field_index("stages")
    return table.set_column(column, table.schema.field(column), pa.array([stages] * table.num_rows,
                                                                           table.schema.field(column).type))


def training_queries(queries_path: str | os.PathLike, stage: str) -> list[dict[str, Any]]:
    """The non-contaminated queries a training stage (`STAGES`) uses, ordered by id: distillation's
    cold start and RL each read the sources that name them."""
    if stage not in STAGES:
        raise ValueError(f"training_queries: stage {stage!r} is not one of {', '.join(STAGES)}")
    rows = [r for r in read_table(queries_path, "queries").to_pylist()
            if not r["contaminated"] and stage in (r["stages"] or STAGES)]
    if not rows:
        raise ValueError(f"{queries_path}: no non-contaminated query of a source with stage {stage} "
                         "(queries.sources[].stages)")
    return sorted(rows, key=lambda r: r["query_id"])
