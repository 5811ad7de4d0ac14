"""The Arrow schema of every kpipe table, declared once.

Each Parquet file carries its table name and schema version in its metadata; readers check
both (``kpipe.data.io.read_table``), so a file written by an older layout fails loudly
instead of silently producing wrong joins in DuckDB.

Bump a table's version whenever its fields change.
"""

from __future__ import annotations

import pyarrow as pa

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


def _schema(columns: list[tuple[str, pa.DataType, str]]) -> pa.Schema:
    """A schema whose fields carry their meaning (field metadata `description`): the one place it
    is written; the database turns it into DuckDB column comments."""
    return pa.schema([pa.field(name, kind, metadata={"description": text}) for name, kind, text in columns])


TASKS = _schema(
    [
        ("task_id", pa.string(), 'evaluation task id: "kb-<version>-L<level>-<problem_id>", e.g. "kb-main-L1-19"'),
        ("source", pa.string(), 'where the task comes from: "kernelbench"'),
        ("version", pa.string(), 'KernelBench problem set: "main" (v0.1 sizes) | "v0"'),
        ("size_profile", pa.string(), '"full" | "tiny" (module-level sizes capped by kernelbench.size_cap)'),
        ("split", pa.string(), '"eval" | "validation"'),
        ("level", pa.int32(), "KernelBench level (1, 2, 3)"),
        ("problem_id", pa.int32(), "KernelBench problem id within its level"),
        ("name", pa.string(), "KernelBench problem name"),
        ("reference_src", pa.string(), "the PyTorch reference program"),
        ("reference_hash", pa.string(), "hash of the normalised reference source"),
    ]
)

QUERIES = _schema(
    [
        ("query_id", pa.string(), 'training query id: "<source>-<source_id>"'),
        ("source", pa.string(), "cudallm | cudallm_sft | drkernel_rl | drkernel_coldstart | kernelbook | kernelbench"),
        ("source_id", pa.string(), "the row's id in its source"),
        ("level", pa.int32(), "KernelBench-style level; null where the source has none"),
        ("name", pa.string(), "name of the reference module"),
        ("reference_src", pa.string(), "PyTorch reference in KernelBench format"),
        ("reference_hash", pa.string(), "hash of the normalised reference source"),
        ("contaminated", pa.bool_(), "duplicates or near-duplicates an evaluation task"),
        ("contaminated_with", pa.string(), "task_id of the closest evaluation task"),
        ("similarity", pa.float64(), "near-duplicate score against that task, in [0, 1]"),
        ("stages", pa.list_(pa.string()), "the training stages that use the query: distill (cold start), rl (config queries.sources[].stages)"),
    ]
)

# One row per KernelGym evaluation.
EVALS = _schema(
    [
        ("key", pa.string(), "content hash of (reference, candidate, protocol, device kind): identical evaluations are free; trajectories.eval_key joins it"),
        ("reference_hash", pa.string(), "hash of the reference program"),
        ("candidate_hash", pa.string(), "hash of the candidate program"),
        ("status", pa.string(), "KernelGym verdict: one of kpipe.gym.judge.result.STATUSES (pass, mismatch, compilation_error, runtime_error, timeout, hacked, ...)"),
        ("correct", pa.bool_(), "outputs matched the reference on every correctness trial and in eval() mode, by allclose and the relative-norm check (kpipe's verdict)"),
        ("kb_correct", pa.bool_(), "KernelBench's verdict alone: allclose (atol = rtol = 1e-2) on the correctness trials, without kpipe's relative-norm (0.05) and eval()-mode checks; null where no output was compared"),
        ("hacked", pa.bool_(), "rejected as reward hacking (hack_reasons say why)"),
        ("hack_reasons", pa.list_(pa.string()), "why the candidate counts as hacked"),
        ("findings", pa.list_(pa.string()), "static-screen finding codes (kpipe.gym.protocol.FINDING_CODES)"),
        ("diagnostic", pa.string(), "error text or other diagnostic of the evaluation"),
        ("feedback", pa.string(), "the feedback text a policy sees"),
        ("candidate_ms", pa.float64(), "candidate time per call in ms, on the judge's clock (the least of its timing windows, kpipe.gym.judge.evaluation.judge_windows)"),
        ("eager_ms", pa.float64(), "PyTorch eager reference time per call in ms"),
        ("compile_ms", pa.float64(), "torch.compile reference time per call in ms"),
        ("speedup_eager", pa.float64(), "eager_ms / candidate_ms"),
        ("speedup_compile", pa.float64(), "compile_ms / candidate_ms"),
        ("pr", pa.float64(), "profiling ratio (paper Eq. 7): device time of the launched Triton kernels / of all GPU kernels"),
        ("launched_kernels", pa.list_(pa.string()), "kernels the candidate launched"),
        ("timing_kind", pa.string(), '"cuda" | "cpu" (Triton-interpreter timings)'),
        ("device", pa.string(), "the device the evaluation ran on"),
        ("device_id", pa.string(), 'the GPU the candidate ran on: "GPU-<uuid> <pci address>" | "cpu"'),
        ("timed_spans", pa.list_(pa.list_(pa.float64())), "[start, end] Unix seconds of each timing window on the judge's clock"),
        ("torch_version", pa.string(), "torch version of the evaluation"),
        ("triton_version", pa.string(), "Triton version of the evaluation"),
        ("protocol_version", pa.string(), "KernelGym protocol version"),
        ("protocol", pa.string(), "the evaluation protocol as JSON"),
        ("wall_s", pa.float64(), "wall-clock seconds of the evaluation"),
    ]
)

# One row per turn of a multi-turn episode, whatever the stage.
TRAJECTORIES = _schema(
    [
        ("run", pa.string(), "run name (config `run`, or an rl.runs ablation)"),
        ("stage", pa.string(), "coldstart | rl | rl_val (RL validation: run, iteration = RL's) | eval | budget | stts"),
        ("iteration", pa.int32(), "RL iteration: of the rollout or validated checkpoint (rl, rl_val), of the evaluated RL checkpoint (eval, stts, budget of a source: rl model); 0 otherwise"),
        ("task_id", pa.string(), "tasks.task_id or queries.query_id"),
        ("sample", pa.int32(), "trajectory number within its task"),
        ("turn", pa.int32(), "turn number, 1-based"),
        ("model", pa.string(), "the model that answered (STTS: <model>@<strategy>)"),
        ("prompt_messages", pa.list_(MESSAGE), "the exact context the model saw"),
        ("response", pa.string(), "the model's full answer"),
        ("finish_reason", pa.string(), "why generation stopped (stop, length)"),
        ("code", pa.string(), "the extracted candidate program; null on format errors"),
        ("prompt_tokens", pa.int32(), "tokens of the prompt"),
        ("completion_tokens", pa.int32(), "tokens of the response"),
        ("response_token_ids", pa.list_(pa.int32()), "response token ids, for RL; null for API models"),
        ("response_logprobs", pa.list_(pa.float32()), "rollout log-probabilities of the response tokens"),
        ("eval_key", pa.string(), "join key into evals.key"),
        ("status", pa.string(), "KernelGym verdict of the turn's candidate"),
        ("correct", pa.bool_(), "the candidate was correct (kpipe's verdict: evals.correct)"),
        ("kb_correct", pa.bool_(), "KernelBench's verdict alone (evals.kb_correct): allclose without kpipe's extra checks; null where no output was compared"),
        ("hacked", pa.bool_(), "the candidate was rejected as reward hacking"),
        ("speedup_eager", pa.float64(), "speedup over PyTorch eager"),
        ("speedup_compile", pa.float64(), "speedup over torch.compile"),
        ("pr", pa.float64(), "profiling ratio (paper Eq. 7) of the candidate"),
        ("feedback", pa.string(), "the feedback shown to the model after this turn"),
        ("reward", pa.float64(), "the turn's reward"),
        ("return_to_go", pa.float64(), "discounted sum of this and later turns' rewards"),
        ("advantage", pa.float64(), "the turn's advantage in the RL update"),
        ("kept", pa.bool_(), "the turn was used for training"),
        ("rejected_by", pa.string(), "the filter that dropped the turn from training"),
        ("gen_s", pa.float64(), "seconds spent generating the turn"),
        ("eval_s", pa.float64(), "seconds spent evaluating the turn"),
    ]
)

# Long format: new metrics need no schema change; DuckDB pivots them for the tables.
TRAIN_METRICS = _schema(
    [
        ("run", pa.string(), "run name"),
        ("stage", pa.string(), "sft | rl | val"),
        ("iteration", pa.int32(), "RL iteration (0 for SFT)"),
        ("step", pa.int64(), "optimizer or rollout step"),
        ("name", pa.string(), "metric name (e.g. loss, reward_mean)"),
        ("value", pa.float64(), "metric value"),
    ]
)

TABLES: dict[str, tuple[pa.Schema, int]] = {
    "tasks": (TASKS, 1),
    "queries": (QUERIES, 2),
    "evals": (EVALS, 3),
    "trajectories": (TRAJECTORIES, 2),
    "train_metrics": (TRAIN_METRICS, 1),
}


def schema_of(table: str) -> pa.Schema:
    """The schema of `table`, with its name and version stamped into the metadata."""
    if table not in TABLES:
        raise KeyError(f"unknown table {table!r}; known: {', '.join(TABLES)}")
    schema, version = TABLES[table]
    return schema.with_metadata({"kpipe.table": table, "kpipe.schema_version": str(version)})


def column_descriptions(table: str) -> dict[str, str]:
    """Column name -> meaning, for `table`."""
    return {field.name: field.metadata[b"description"].decode() for field in schema_of(table)}
