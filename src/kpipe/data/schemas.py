"""The Arrow schema of every kpipe table, declared once.

Each Parquet file carries its table name and schema version in its metadata; readers check
both (``kpipe.data.io.read_table``), so a file written by an older layout fails loudly
instead of silently producing wrong joins in DuckDB.

Bump a table's version whenever its fields change.
"""

from __future__ import annotations

import pyarrow as pa

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])

TASKS = pa.schema(
    [
        ("task_id", pa.string()),  # e.g. "kb-main-L1-19"
        ("source", pa.string()),  # "kernelbench"
        ("version", pa.string()),  # KernelBench problem set: "main" (v0.1 sizes) | "v0"
        ("size_profile", pa.string()),  # "full" | "tiny" (module-level sizes capped)
        ("split", pa.string()),  # "eval" | "validation"
        ("level", pa.int32()),
        ("problem_id", pa.int32()),
        ("name", pa.string()),
        ("reference_src", pa.string()),
        ("reference_hash", pa.string()),  # hash of the normalised source
    ]
)

QUERIES = pa.schema(
    [
        ("query_id", pa.string()),  # "<source>-<source_id>"
        ("source", pa.string()),  # cudallm | drkernel_rl | drkernel_coldstart | kernelbook | kernelbench
        ("source_id", pa.string()),
        ("level", pa.int32()),  # null where the source has none
        ("name", pa.string()),
        ("reference_src", pa.string()),  # PyTorch reference in KernelBench format
        ("reference_hash", pa.string()),
        ("contaminated", pa.bool_()),  # duplicates / near-duplicates an evaluation task
        ("contaminated_with", pa.string()),  # task_id of the closest evaluation task
        ("similarity", pa.float64()),  # near-duplicate score against that task, in [0, 1]
    ]
)

# One row per KernelGym evaluation; `key` is the content hash of
# (reference, candidate, protocol, device kind) that makes identical evaluations free.
EVALS = pa.schema(
    [
        ("key", pa.string()),
        ("reference_hash", pa.string()),
        ("candidate_hash", pa.string()),
        ("status", pa.string()),
        ("correct", pa.bool_()),
        ("hacked", pa.bool_()),
        ("hack_reasons", pa.list_(pa.string())),
        ("findings", pa.list_(pa.string())),
        ("diagnostic", pa.string()),
        ("feedback", pa.string()),
        ("candidate_ms", pa.float64()),
        ("candidate_ms_iqr", pa.float64()),
        ("eager_ms", pa.float64()),
        ("eager_ms_iqr", pa.float64()),
        ("compile_ms", pa.float64()),
        ("compile_ms_iqr", pa.float64()),
        ("speedup_eager", pa.float64()),
        ("speedup_compile", pa.float64()),
        ("gpu_drift", pa.float64()),  # measured candidate median / candidate_ms: the GPU's drift divided out (kgym-4 on; kgym-6: with the back-to-back scaling)
        ("pr", pa.float64()),
        ("launched_kernels", pa.list_(pa.string())),
        ("timing_kind", pa.string()),  # "cuda" | "cpu" (interpreter timings)
        ("device", pa.string()),
        ("device_id", pa.string()),  # the GPU the candidate ran on: "GPU-<uuid> <pci address>" | "cpu"
        ("timed_spans", pa.list_(pa.list_(pa.float64()))),  # [start, end] Unix s of each timed region
        ("torch_version", pa.string()),
        ("triton_version", pa.string()),
        ("protocol_version", pa.string()),
        ("protocol", pa.string()),  # the protocol as JSON
        ("wall_s", pa.float64()),
    ]
)

# One row per turn of a multi-turn episode, whatever the stage.
TRAJECTORIES = pa.schema(
    [
        ("run", pa.string()),
        ("stage", pa.string()),  # coldstart | rl | eval | stts | rl_val (RL validation: run, iteration = RL's)
        ("iteration", pa.int32()),
        ("task_id", pa.string()),  # tasks.task_id or queries.query_id
        ("sample", pa.int32()),
        ("turn", pa.int32()),  # 1-based
        ("model", pa.string()),
        ("prompt_messages", pa.list_(MESSAGE)),  # the exact context the model saw
        ("response", pa.string()),
        ("finish_reason", pa.string()),
        ("code", pa.string()),  # extracted candidate; null on format errors
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("response_token_ids", pa.list_(pa.int32())),  # for RL; null for API models
        ("response_logprobs", pa.list_(pa.float32())),  # rollout log-probabilities
        ("eval_key", pa.string()),  # join key into `evals`
        ("status", pa.string()),
        ("correct", pa.bool_()),
        ("hacked", pa.bool_()),
        ("speedup_eager", pa.float64()),
        ("speedup_compile", pa.float64()),
        ("pr", pa.float64()),
        ("feedback", pa.string()),
        ("reward", pa.float64()),
        ("return_to_go", pa.float64()),
        ("advantage", pa.float64()),
        ("kept", pa.bool_()),
        ("rejected_by", pa.string()),  # filter that dropped the turn from training
        ("gen_s", pa.float64()),
        ("eval_s", pa.float64()),
    ]
)

# Long format: new metrics need no schema change; DuckDB pivots them for the tables.
TRAIN_METRICS = pa.schema(
    [
        ("run", pa.string()),
        ("stage", pa.string()),  # sft | rl | val
        ("iteration", pa.int32()),
        ("step", pa.int64()),
        ("name", pa.string()),
        ("value", pa.float64()),
    ]
)

TABLES: dict[str, tuple[pa.Schema, int]] = {
    "tasks": (TASKS, 1),
    "queries": (QUERIES, 1),
    "evals": (EVALS, 2),
    "trajectories": (TRAJECTORIES, 1),
    "train_metrics": (TRAIN_METRICS, 1),
}


def schema_of(table: str) -> pa.Schema:
    """The schema of `table`, with its name and version stamped into the metadata."""
    if table not in TABLES:
        raise KeyError(f"unknown table {table!r}; known: {', '.join(TABLES)}")
    schema, version = TABLES[table]
    return schema.with_metadata({"kpipe.table": table, "kpipe.schema_version": str(version)})
