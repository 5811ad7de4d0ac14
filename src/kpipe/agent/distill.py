"""Cold-start distillation (paper §4.1): a teacher model refines kernels over 5 turns with
KernelGym feedback; every turn becomes a `trajectories` row with stage="coldstart".

Resumable: answers are cached by request hash as they arrive, evaluation results by
(protocol, reference, candidate), and the output Parquet is written once, atomically, at
the end. A rerun after a kill replays the cached answers and evaluations — so it rebuilds
exactly the prompts the killed run sent, and sends none of them again — and writes the one
file: no request is paid twice, no row is duplicated.

Also: `released_coldstart_rows`, to start from the authors' released 5-turn trajectories
(`hkust-nlp/drkernel-coldstart-8k`) instead of paying for distillation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from tabulate import tabulate

from kpipe.agent.evaluator import CachedEvaluator, Evaluator
from kpipe.agent.history import FullHistory, HistoryPolicy
from kpipe.agent.loop import AgentTask, Sampling, TurnRecord, clipped_speedup_reward, run_episodes
from kpipe.data.io import write_table
from kpipe.llm.cache import CachedEngine, ResponseCache
from kpipe.llm.extract import extract_code
from kpipe.llm.types import Engine

log = logging.getLogger(__name__)
STAGE = "coldstart"
RELEASED_SOURCE = "drkernel_coldstart"


@dataclass
class TurnSummary:
    """What one turn cost and produced, across the shard."""

    turn: int
    requests: int = 0
    cached: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    correct: int = 0
    mean_reward: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)

    def add(self, records: list[TurnRecord]) -> None:
        statuses: Counter[str] = Counter(self.statuses)
        for record in records:
            self.requests += 1
            self.cached += record.completion.cached
            self.failed += record.completion.failed
            self.prompt_tokens += record.completion.prompt_tokens
            self.completion_tokens += record.completion.completion_tokens
            self.cost_usd += record.completion.cost_usd
            self.correct += bool(record.row["correct"])
            statuses[record.row["status"] or "unknown"] += 1
        self.statuses = dict(statuses)
        self.mean_reward = sum(r.row["reward"] for r in records) / max(1, len(records))


def summary_table(turns: Sequence[TurnSummary]) -> str:
    """The per-turn summary as a text table (logged at the end of a shard)."""
    rows = [
        [t.turn, t.requests, t.cached, t.failed, t.prompt_tokens, t.completion_tokens, f"{t.cost_usd:.4f}",
         t.correct, f"{t.mean_reward:.3f}", ", ".join(f"{k}={v}" for k, v in sorted(t.statuses.items()))]
        for t in turns
    ]
    headers = ["turn", "requests", "cached", "failed", "prompt_tok", "completion_tok", "cost_usd", "correct",
               "mean_reward", "statuses"]
    return tabulate(rows, headers=headers)


def distill_shard(
    tasks: Sequence[AgentTask],
    engine: Engine,
    evaluator: Evaluator,
    out_path: str | os.PathLike,
    cache_path: str | os.PathLike,
    *,
    run: str = "default",
    n_turns: int = 5,
    n_samples: int = 1,
    policy: HistoryPolicy = FullHistory(),
    sampling: Sampling = Sampling(),
    reward_fn: Callable[[Any], float] = clipped_speedup_reward,
    seed: int = 0,
    eval_namespace: str = "",
    progress: bool = True,
) -> list[TurnSummary]:
    """Distill `tasks` into `out_path` (trajectories Parquet) and `<out_path>.summary.json`.

    `cache_path` holds the answers; `<cache_path>.evals.jsonl` the evaluations (namespaced by
    `eval_namespace`, e.g. the protocol's JSON)."""
    cached_engine = CachedEngine(engine, ResponseCache(cache_path))
    evaluator = CachedEvaluator(evaluator, f"{cache_path}.evals.jsonl", eval_namespace)
    summaries: dict[int, TurnSummary] = {}

    def on_turn(turn: int, records: list[TurnRecord]) -> None:
        summaries.setdefault(turn, TurnSummary(turn)).add(records)

    rows = run_episodes(
        tasks, cached_engine, evaluator, policy, n_samples=n_samples, max_turns=n_turns, sampling=sampling,
        reward_fn=reward_fn, run=run, stage=STAGE, seed=seed, on_turn=on_turn, progress=progress,
        overlap=True,  # the teacher decodes elsewhere (an API or the offline server): judge while it answers
    )
    write_table(rows, out_path, "trajectories")
    ordered = [summaries[t] for t in sorted(summaries)]
    summary_path = Path(f"{out_path}.summary.json")
    summary_path.write_text(json.dumps({"sent": cached_engine.sent, "cache_hits": cached_engine.hits,
                                        "turns": [asdict(t) for t in ordered]}, indent=2))
    log.info("distillation of %d tasks x %d samples:\n%s", len(tasks), n_samples, summary_table(ordered))
    return ordered


def released_coldstart_rows(path: str | os.PathLike, run: str = "released") -> list[dict[str, Any]]:
    """`trajectories` rows from the released cold-start Parquet (one row per assistant turn).

    The release has no per-turn evaluation: status, correct and rewards stay null; the
    feedback of turn t is the user message that follows it (none after the last turn);
    `final_speedup` is recorded as `speedup_eager` on the `best_round` turn (1-based).
    task_id is "drkernel_coldstart-<uuid>" (the `queries` id scheme).
    """
    table = pq.read_table(path)
    required = {"messages", "final_speedup", "best_round", "original_python_code"}
    missing = required - set(table.column_names)
    if missing:
        raise ValueError(f"{path}: not the released cold-start data, missing column(s) {sorted(missing)}")
    rows = []
    for index, record in enumerate(table.to_pylist()):
        messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
        task_id = f"{RELEASED_SOURCE}-{record.get('uuid', index)}"
        assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for turn, position in enumerate(assistant_at, start=1):
            response = messages[position]["content"]
            following = messages[position + 1]["content"] if position + 1 < len(messages) else None
            rows.append({
                "run": run, "stage": STAGE, "iteration": 0, "task_id": task_id, "sample": 0, "turn": turn,
                "model": "hkust-nlp/drkernel-coldstart-8k",
                "prompt_messages": messages[:position],
                "response": response,
                "finish_reason": "stop",
                "code": extract_code(response).code,
                "feedback": following,
                "speedup_eager": record["final_speedup"] if turn == record["best_round"] else None,
            })
    return rows


OFFLINE_TEACHER_MODEL = "kpipe-teacher"


def shard_tasks(queries_path: str | os.PathLike, shard: int, num_shards: int, max_queries: int | None = None
                ) -> list[AgentTask]:
    """Shard `shard` of `num_shards` of the non-contaminated queries of the sources that feed distillation
    (ordered by id, every num_shards-th one), after keeping the first `max_queries` of them."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    from kpipe.data.sources import training_queries

    rows = training_queries(queries_path, "distill")
    rows = rows[:max_queries] if max_queries is not None else rows
    return [AgentTask(r["query_id"], r["reference_src"]) for r in rows[shard::num_shards]]


def offline_teacher_args(offline: Mapping[str, Any]) -> list[str]:
    """`kpipe serve teacher` arguments for the `distill.offline` config section."""
    args = ["teacher", "--model-name", OFFLINE_TEACHER_MODEL,
            "--p-first-legit", str(offline.get("p_first_legit", 0.3)), "--p-fix", str(offline.get("p_fix", 0.7))]
    if offline.get("faults"):
        args += ["--faults", offline["faults"], "--fault-delay-s", str(offline.get("fault_delay_s", 5.0))]
    return args


def coldstart_released_job(path: str | os.PathLike, out_path: str | os.PathLike, run: str) -> int:
    """Rule `coldstart_released`: the released cold-start trajectories as `run`'s coldstart stage."""
    rows = released_coldstart_rows(path, run=run)
    write_table(rows, out_path, "trajectories")
    print(f"{len(rows)} released cold-start turns -> {out_path}")
    return len(rows)


def distill_job(queries_path: str | os.PathLike, out_path: str | os.PathLike, cache_path: str | os.PathLike,
                settings: Mapping[str, Any], *, shard: int = 0, num_shards: int = 1, run: str = "default",
                gym: Mapping[str, Any] | None = None, progress: bool = True) -> list[TurnSummary]:
    """One distillation shard as the `distill` config section describes it (see docs/generation.md).

    teacher: offline -> `kpipe serve teacher` is started for this job and stopped after it;
    teacher: api -> the OpenAI-compatible endpoint of `engine` (key from `engine.api_key_env`).
    `gym` is the config's `gym` section: the protocol and the evaluator backend.
    """
    from kpipe.agent.evaluator import open_evaluator, reference_reuse

    teacher = settings.get("teacher", "offline")
    if teacher not in ("offline", "api"):
        raise ValueError(f"distill.teacher must be 'offline' or 'api', got {teacher!r}")
    # eager baseline only, as RL (kpipe.train.rl.gym_protocol): the feedback and reward of a cold-start
    # turn use the eager speedup, and a torch.compile reference would be compiled for every task
    gym = dict(gym or {})
    gym["protocol"] = {**gym.get("protocol", {}), "baseline": "eager"}
    reuse = reference_reuse(settings.get("reuse_reference"))
    with contextlib.ExitStack() as stack:
        if teacher == "offline":  # its server comes up while the run's KernelGym service starts
            from kpipe.llm.server import serving_in_subprocess

            teacher_url = stack.enter_context(serving_in_subprocess(offline_teacher_args(settings.get("offline", {}))))
        # the evaluator before the rest of the job's imports: the run's KernelGym service, when this job
        # starts it, takes seconds on a GPU host, and distillation is the run's critical path
        evaluator = stack.enter_context(open_evaluator(gym, reuse_reference=reuse, progress=progress))
        from kpipe.agent.history import make_policy
        from kpipe.gym import Protocol
        from kpipe.llm import make_engine

        engine_spec = {"kind": "openai", "progress": progress, **settings.get("engine", {})}
        if teacher == "offline":
            engine_spec.update(model=OFFLINE_TEACHER_MODEL, base_url=teacher_url(), api_key_env=None, prices={})
        return distill_shard(
            shard_tasks(queries_path, shard, num_shards, settings.get("max_queries")), make_engine(engine_spec),
            evaluator, out_path, cache_path, run=run, n_turns=int(settings.get("turns", 5)),
            n_samples=int(settings.get("samples", 1)),
            policy=make_policy(settings.get("history", "full"), int(settings.get("window", 4))),
            sampling=Sampling(**settings.get("sampling", {})), seed=int(settings.get("seed", 0)), progress=progress,
            eval_namespace=Protocol.from_dict(gym["protocol"]).to_json())
