"""KernelBench evaluation (paper §6.1): a model from config x a level x a shard of its tasks,
n samples x T turns through the one multi-turn loop (`kpipe.agent.loop.run_episodes`), written
as `trajectories` rows with stage="eval" (STTS, `kpipe.evaluate.stts`, is the same job with another
history policy and more turns; the RL validation of `validation_job` is the same job on an RL
iteration's checkpoint, with stage="rl_val"; Kevin's test-time budget of `budget_job` runs it
once per split of a budget of kernels into trajectories × turns, with stage="budget").

One evaluation measures the candidate against both eager PyTorch and `torch.compile`
(protocol `baseline: both`), so Table 1 and Table 2 come from the same rows.

Models (`models:` in config, each a named entry; `kind` says how to reach it):
- `hf` / `vllm`: a local checkpoint (`path`), generated in process;
- `openai`: any OpenAI-compatible endpoint (API models, `vllm serve`, SGLang) — `model`,
  `base_url`, `api_key_env`, ... as `kpipe.llm.make_engine` takes them;
- `offline_teacher`: the bank-backed offline teacher (`kpipe serve teacher`), started for the job;
- `pipeline`: this pipeline's own checkpoint (`source: sft | rl`); Snakemake resolves its path.
A checkpoint model (`hf`, `vllm`, `pipeline`) with `serve: vllm` is served instead: the job
starts `vllm serve` on its GPUs (`vllm_server:` holds `VLLMServerConfig` fields, e.g.
`tensor_parallel_size`), generates through the `openai` engine (the entry's other keys are its
`OpenAIConfig` fields, e.g. `concurrency`) and stops the server when it ends.
The `model` column of every row is the entry's `name`, so tables group by the config's names.

Resumable: evaluation results are cached by (protocol, reference, candidate) and API answers
by request hash, so a killed shard reruns without paying again; local models regenerate (their
weights may have changed under the same path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kpipe.agent.evaluator import CachedEvaluator, Evaluator
from kpipe.agent.history import FullHistory, HistoryPolicy, make_policy
from kpipe.agent.loop import AgentTask, Sampling, clipped_speedup_reward, run_episodes
from kpipe.data.io import read_table, write_table
from kpipe.llm.types import Engine

if TYPE_CHECKING:
    from kpipe.llm.vllm_server import VLLMServerConfig

log = logging.getLogger(__name__)
STAGE = "eval"
VALIDATION_STAGE = "rl_val"  # RL iteration checkpoints on the validation tasks (config rl.validation)
BUDGET_STAGE = "budget"  # Kevin's test-time budget splits (config eval_budget)
MODEL_KINDS = ("hf", "vllm", "openai", "offline_teacher", "pipeline")
API_KINDS = ("openai", "offline_teacher")  # answers cost money or time: cache them
CHECKPOINT_KINDS = ("hf", "vllm", "pipeline")  # a local checkpoint: may be served with `serve: vllm`
SERVERS = ("vllm",)
NOT_ENGINE_KEYS = ("name", "kind", "source", "rl_run", "engine", "serve", "vllm_server", "sampling", "history")  # the entry's, not the engine's
SERVER_SET_CLIENT_KEYS = {"model", "base_url", "api_key_env", "progress"}  # set by the job for a served model
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
# Paper §6.1: 8 samples, 3 turns, 8,192 generated tokens per turn, 32,768 in all.
PAPER_EVAL = {"samples": 8, "turns": 3, "max_context_tokens": 32768,
              "sampling": {"max_tokens": 8192, "temperature": 1.0, "top_p": 0.95}}
# Which RL checkpoint a `source: rl` model is (config eval.checkpoint, stts.checkpoint): the last iteration's,
# or the validated iteration's with the best validation at its last turn (paper Figure 4: "we select
# checkpoints based on turn 3 performance"; rl.validation.turns is 3 there), written by `selection_job`
CHECKPOINT_CHOICES = ("last", "best_val")
# the selection's score: Fast@1 at that turn (the figure whose caption says it), ties broken by Fast@1.2
SELECTION_METRICS = (1.0, 1.2)
ITERATION_RE = re.compile(r"iter=(\d+)$")


def check_model(entry: Mapping[str, Any]) -> None:
    """Raise ValueError with one line unless `entry` is a usable `models:` entry."""
    name = entry.get("name")
    if not isinstance(name, str) or not MODEL_NAME_RE.match(name):
        raise ValueError(f"models: entry {dict(entry)!r} needs a `name` of letters, digits, '_', '.', '-'")
    kind = entry.get("kind")
    if kind not in MODEL_KINDS:
        raise ValueError(f"models.{name}: kind {kind!r} is not one of {', '.join(MODEL_KINDS)}")
    if kind in ("hf", "vllm") and not entry.get("path"):
        raise ValueError(f"models.{name}: kind {kind} needs a `path` to a local checkpoint")
    if kind == "openai" and not entry.get("model"):
        raise ValueError(f"models.{name}: kind openai needs the served `model` name")
    if kind == "pipeline" and entry.get("source") not in ("sft", "rl"):
        raise ValueError(f"models.{name}: kind pipeline needs `source: sft` or `source: rl`")
    if "rl_run" in entry and (kind != "pipeline" or entry.get("source") != "rl"):
        raise ValueError(f"models.{name}: `rl_run` names the RL run of a `kind: pipeline, source: rl` model")
    serve = entry.get("serve")
    if serve is not None and (serve not in SERVERS or kind not in CHECKPOINT_KINDS):
        raise ValueError(f"models.{name}: `serve: {serve}` needs serve: {' | '.join(SERVERS)} and a checkpoint kind "
                         f"({', '.join(CHECKPOINT_KINDS)}), got kind {kind}")
    if "vllm_server" in entry and serve != "vllm":
        raise ValueError(f"models.{name}: `vllm_server` settings need `serve: vllm`")
    if serve == "vllm":
        model_gpus(entry)  # a bad server setting fails here, when the DAG is built, not on a GPU node
        from kpipe.llm.openai_engine import OpenAIConfig

        client_keys = {f.name for f in dataclasses.fields(OpenAIConfig)} - SERVER_SET_CLIENT_KEYS
        unknown = sorted(set(entry) - {*NOT_ENGINE_KEYS, "path"} - client_keys)
        if unknown:
            raise ValueError(f"models.{name}: served by vllm, so its other keys are the openai client's; "
                             f"unknown: {', '.join(unknown)} (allowed: {', '.join(sorted(client_keys))})")


def models_by_name(entries: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The `models:` list as name -> entry, checked (names are unique path segments)."""
    named: dict[str, Mapping[str, Any]] = {}
    for entry in entries:
        check_model(entry)
        if entry["name"] in named:
            raise ValueError(f"models: the name {entry['name']!r} is used twice")
        named[entry["name"]] = entry
    return named


def eval_tasks(tasks_path: str | os.PathLike, level: int, shard: int = 0, num_shards: int = 1,
               max_tasks: int | None = None) -> list[AgentTask]:
    """Shard `shard` of `num_shards` of the evaluation tasks of `level` (split "eval", by
    problem id, every num_shards-th one), after keeping the first `max_tasks`."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    rows = [r for r in read_table(tasks_path, "tasks").to_pylist() if r["level"] == level and r["split"] == "eval"]
    if not rows:
        raise ValueError(f"{tasks_path}: no evaluation task of level {level}")
    rows.sort(key=lambda r: (r["problem_id"], r["task_id"]))
    rows = rows[:max_tasks] if max_tasks is not None else rows
    return [AgentTask(r["task_id"], r["reference_src"]) for r in rows[shard::num_shards]]


def resolved_checkpoint(checkpoint: str | os.PathLike) -> str:
    """A pipeline checkpoint's directory: the path itself, or the one a `selection_job` file chose."""
    if str(checkpoint).endswith(".json"):
        return json.loads(Path(checkpoint).read_text())["checkpoint"]
    return str(checkpoint)


def checkpoint_iteration(checkpoint: str | None) -> int:
    """The RL iteration of a pipeline checkpoint (its `iter=<k>` directory), 0 for any other model: the
    `iteration` of the rows that evaluate it, so a table row says which checkpoint it is."""
    match = ITERATION_RE.search(resolved_checkpoint(checkpoint).rstrip("/")) if checkpoint else None
    return int(match.group(1)) if match else 0


def checkpoint_path(entry: Mapping[str, Any], checkpoint: str | None) -> str:
    """Where a checkpoint model's weights are: its `path`, or for `pipeline` the resolved one."""
    if entry["kind"] != "pipeline":
        return entry["path"]
    if checkpoint is None:
        raise ValueError(f"models.{entry['name']}: a pipeline model needs its checkpoint path")
    return resolved_checkpoint(checkpoint)


def engine_spec(entry: Mapping[str, Any], checkpoint: str | None = None, progress: bool = True) -> dict[str, Any]:
    """The `kpipe.llm.make_engine` spec of a `models:` entry (not for offline_teacher nor served)."""
    spec = {k: v for k, v in entry.items() if k not in NOT_ENGINE_KEYS}
    kind = entry["kind"]
    if kind == "pipeline":
        return {**spec, "kind": entry.get("engine", "hf"), "path": checkpoint_path(entry, checkpoint)}
    if kind in ("hf", "vllm"):
        return {**spec, "kind": kind}
    return {**spec, "kind": "openai", "progress": progress}


def served_config(entry: Mapping[str, Any], checkpoint: str | None = None) -> VLLMServerConfig:
    """The `VLLMServerConfig` of a `serve: vllm` entry; requests name the model by the entry's name."""
    from kpipe.llm.vllm_server import VLLMServerConfig

    return VLLMServerConfig.from_settings(checkpoint_path(entry, checkpoint), entry["name"],
                                          entry.get("vllm_server") or {}, f"models.{entry['name']}.vllm_server")


def served_client(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The `OpenAIConfig` fields of a `serve: vllm` entry: its keys that are not the entry's own."""
    return {k: v for k, v in entry.items() if k not in (*NOT_ENGINE_KEYS, "path")}


def model_gpus(entry: Mapping[str, Any]) -> int:
    """GPUs an eval/STTS job of this model holds: its vLLM server's (tensor x data parallel)
    when served, else one (in-process generation and KernelGym share it)."""
    if entry.get("serve") != "vllm":
        return 1
    return served_config(entry, checkpoint="(resolved by the job)").gpus  # the path does not change the count


@contextlib.contextmanager
def opened_engine(entry: Mapping[str, Any], checkpoint: str | None = None, progress: bool = True
                  ) -> Iterator[Engine]:
    """The engine of a `models:` entry for the duration of a block (the offline teacher's server
    lives as long as the block, and so does the `vllm serve` of a `serve: vllm` entry)."""
    from kpipe.llm import make_engine

    if entry["kind"] == "offline_teacher":
        from kpipe.agent.distill import OFFLINE_TEACHER_MODEL, offline_teacher_args
        from kpipe.llm.server import served_in_subprocess

        with served_in_subprocess(offline_teacher_args(entry.get("offline", {}))) as base_url:
            yield make_engine({"kind": "openai", "model": OFFLINE_TEACHER_MODEL, "base_url": base_url,
                               "api_key_env": None, "progress": progress})
        return
    if entry.get("serve") == "vllm":
        from kpipe.llm.vllm_server import served_engine

        with served_engine(served_config(entry, checkpoint), progress=progress, **served_client(entry)) as engine:
            yield engine
        return
    yield make_engine(engine_spec(entry, checkpoint, progress))


def sampling_of(settings: Mapping[str, Any], entry: Mapping[str, Any] | None = None) -> Sampling:
    """The stage's sampling, with the model entry's own `sampling` keys on top (an API teacher's
    answers need far more tokens than a tiny local policy's)."""
    return Sampling(**{**settings.get("sampling", {}), **(entry or {}).get("sampling", {})})


def evaluate_shard(tasks: Sequence[AgentTask], engine: Engine, evaluator: Evaluator, out_path: str | os.PathLike,
                   *, model_name: str, run: str = "default", stage: str = STAGE, iteration: int = 0,
                   policy: HistoryPolicy = FullHistory(), n_samples: int = 8, n_turns: int = 3,
                   sampling: Sampling = Sampling(), seed: int = 0, max_context_tokens: int | None = None,
                   progress: bool = True, reward_fn: Callable[[Any], float] = clipped_speedup_reward
                   ) -> list[dict[str, Any]]:
    """Run the multi-turn loop on `tasks` and write its rows (model = `model_name`) to `out_path`;
    `reward_fn` scores each turn (its rows' `reward`, and what a history policy ranks turns by)."""
    rows = run_episodes(tasks, engine, evaluator, policy, n_samples=n_samples, max_turns=n_turns, sampling=sampling,
                        run=run, stage=stage, iteration=iteration, seed=seed, max_context_tokens=max_context_tokens,
                        progress=progress, reward_fn=reward_fn)
    for row in rows:
        row["model"] = model_name
    write_table(rows, out_path, "trajectories")
    return rows


@contextlib.contextmanager
def opened_model(entry: Mapping[str, Any], settings: Mapping[str, Any], cache_path: str | os.PathLike,
                 gym: Mapping[str, Any] | None, checkpoint: str | None, progress: bool
                 ) -> Iterator[tuple[Engine, Evaluator]]:
    """A model's engine and the cached evaluator for a block (what an eval, an STTS, a budget and
    an RL validation job open once): API answers and evaluations are cached under `cache_path`.

    `gym` is the config's `gym` section (protocol and evaluator backend)."""
    from kpipe.agent.evaluator import open_evaluator
    from kpipe.gym import Protocol
    from kpipe.llm.cache import CachedEngine, ResponseCache

    gym = dict(gym or {})
    gym_protocol = Protocol.from_dict(dict(gym.get("protocol", {})))
    with contextlib.ExitStack() as stack:
        backend = stack.enter_context(open_evaluator(
            gym, reuse_reference=bool(settings.get("reuse_reference", False)), progress=progress))
        evaluator = CachedEvaluator(backend, f"{cache_path}.evals.jsonl", gym_protocol.to_json())
        engine = stack.enter_context(opened_engine(entry, checkpoint, progress))
        if entry["kind"] in API_KINDS:
            engine = CachedEngine(engine, ResponseCache(cache_path))
        yield engine, evaluator


def run_model_shard(tasks: Sequence[AgentTask], entry: Mapping[str, Any], settings: Mapping[str, Any],
                    out_path: str | os.PathLike, cache_path: str | os.PathLike, *, model_label: str, stage: str,
                    policy: HistoryPolicy, n_turns: int, run: str, gym: Mapping[str, Any] | None,
                    checkpoint: str | None, progress: bool, iteration: int = 0,
                    reward_fn: Callable[[Any], float] = clipped_speedup_reward) -> list[dict[str, Any]]:
    """What an eval, an STTS and an RL validation job share: engine, cached evaluator, the loop,
    the Parquet file."""
    with opened_model(entry, settings, cache_path, gym, checkpoint, progress) as (engine, evaluator):
        rows = evaluate_shard(
            tasks, engine, evaluator, out_path, model_name=model_label, run=run, stage=stage, iteration=iteration,
            policy=policy, n_samples=int(settings.get("samples", 8)), n_turns=n_turns, sampling=sampling_of(settings, entry),
            seed=int(settings.get("seed", 0)), max_context_tokens=settings.get("max_context_tokens"),
            progress=progress, reward_fn=reward_fn)
    correct = sum(bool(r["correct"]) and not r["hacked"] for r in rows)
    log.info("%s %s: %d tasks, %d turns written to %s (%d correct)", stage, model_label, len(tasks), len(rows),
             out_path, correct)
    return rows


def inference_history(entry: Mapping[str, Any]) -> HistoryPolicy:
    """The history a model infers with across evaluation turns (its entry's `history`, default full):
    Kevin-32B replaces earlier turns' reasoning by their summaries, and with 16K-token turns in a
    32K context its 8 turns only fit that way."""
    return make_policy(entry.get("history", "full"))


def eval_job(tasks_path: str | os.PathLike, out_path: str | os.PathLike, cache_path: str | os.PathLike,
             entry: Mapping[str, Any], settings: Mapping[str, Any], *, level: int, shard: int = 0,
             num_shards: int = 1, run: str = "default", gym: Mapping[str, Any] | None = None,
             checkpoint: str | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """One evaluation shard as the `eval` config section describes it (docs/evaluation.md)."""
    check_model(entry)
    tasks = eval_tasks(tasks_path, level, shard, num_shards, settings.get("max_tasks"))
    return run_model_shard(tasks, entry, settings, out_path, cache_path, model_label=entry["name"], stage=STAGE,
                           policy=inference_history(entry), n_turns=int(settings.get("turns", 3)), run=run, gym=gym,
                           checkpoint=checkpoint, progress=progress, iteration=checkpoint_iteration(checkpoint))


def validated_iterations(iterations: int, every: int) -> list[int]:
    """The RL iterations whose checkpoints get a validation job (the curves of paper Figures 4, 5
    and 8): k with k % every == every - 1 (every 10 -> 9, 19, ...) and always the last one, so a
    curve ends at the model that is evaluated; every = 0 turns validation off."""
    if iterations < 1 or every < 0:
        raise ValueError(f"validated_iterations: need iterations >= 1 and every >= 0, got {iterations} and {every}")
    if every == 0:
        return []
    return sorted({*range(every - 1, iterations, every), iterations - 1})


def validation_job(tasks_path: str | os.PathLike, out_path: str | os.PathLike, cache_path: str | os.PathLike,
                   checkpoint: str, settings: Mapping[str, Any], rl_settings: Mapping[str, Any], *, run: str,
                   iteration: int, gym: Mapping[str, Any] | None = None,
                   progress: bool = True) -> list[dict[str, Any]]:
    """One RL iteration's checkpoint on the validation tasks (config `rl.validation`): the eval
    job's loop, evaluator and rows, with stage="rl_val", the RL `run` and `iteration`, and the
    run's rollout engine (`rl_settings`: the run's `rl` section, ablation included)."""
    from kpipe.train.rl_config import RLConfig

    engine = RLConfig.from_dict(dict(rl_settings)).engine
    entry = {"name": f"rl-{run}", "kind": "pipeline", "source": "rl", "engine": engine}
    tasks = eval_tasks(tasks_path, int(settings["level"]), max_tasks=settings.get("max_tasks"))
    return run_model_shard(tasks, entry, settings, out_path, cache_path, model_label=entry["name"],
                           stage=VALIDATION_STAGE, policy=FullHistory(), n_turns=int(settings.get("turns", 3)), run=run,
                           gym=gym, checkpoint=checkpoint, progress=progress, iteration=iteration)


def select_iteration(scores: Mapping[int, Sequence[float]]) -> int:
    """The validated RL iteration `best_val` evaluates: the best validation score (Fast@1, then Fast@1.2,
    at the validation's last turn: `SELECTION_METRICS`), ties going to the later iteration."""
    if not scores:
        raise ValueError("select_iteration: no validated iteration to choose from")
    return max(scores, key=lambda iteration: (*scores[iteration], iteration))


def validation_scores(paths: Sequence[str | os.PathLike], turn: int) -> dict[int, tuple[float, ...]]:
    """Per validated iteration: Fast@p (`SELECTION_METRICS`, percent, kpipe's definition: hacked counts as
    incorrect; every trajectory in the denominator) of its rl_val rows at `turn`."""
    from kpipe.data import metrics

    frame = read_table(list(paths), "trajectories").to_pandas()
    if frame.empty:
        raise ValueError(f"no validation rows in {', '.join(map(str, paths))}")
    table = metrics.fast_p_by_turn(frame, ps=SELECTION_METRICS, by=["iteration"])
    at_turn = table[table["turn"] == turn].set_index("iteration")
    return {int(iteration): tuple(100.0 * float(at_turn.loc[iteration, f"fast@{p:g}"]) if iteration in at_turn.index
                                  else 0.0 for p in SELECTION_METRICS)
            for iteration in sorted(frame["iteration"].unique())}


def selection_job(validation_paths: Sequence[str | os.PathLike], checkpoints: Mapping[int, str],
                  out_path: str | os.PathLike, *, run: str, turn: int) -> dict[str, Any]:
    """Rule `select_checkpoint`: the checkpoint `best_val` evaluates, of RL run `run`, from its validation
    files; writes the choice, its score and every validated iteration's score to `out_path` (JSON), which
    the evaluation jobs resolve (`resolved_checkpoint`) and the tables quote."""
    scores = validation_scores(validation_paths, turn)
    unknown = sorted(set(scores) - set(checkpoints))
    if unknown:
        raise ValueError(f"validation rows of iteration(s) {unknown} have no checkpoint among {sorted(checkpoints)}")
    chosen = select_iteration(scores)
    last = max(checkpoints)
    labels = [f"fast_{p:g}".replace(".", "_") for p in SELECTION_METRICS]
    selection = {"run": run, "choice": "best_val", "iteration": chosen, "checkpoint": checkpoints[chosen],
                 "turn": turn, "metric": labels[0], "score": scores[chosen][0],
                 "last_iteration": last, "last_score": scores[last][0] if last in scores else None,
                 "scores": {str(iteration): dict(zip(labels, values)) for iteration, values in scores.items()}}
    with open(out_path, "w") as handle:
        json.dump(selection, handle, indent=1, sort_keys=True)
    log.info("best_val of RL run %s: iteration %d (%s %.1f at turn %d; last iteration %d: %s)", run, chosen,
             labels[0], scores[chosen][0], turn, last, selection["last_score"])
    return selection


def budget_splits(kernels: int, turns: Sequence[int]) -> list[tuple[int, int]]:
    """(trajectories, turns) of each split of a budget of `kernels` generated kernels per task
    (Kevin §5.4: 128 as 128×1, 32×4 and 16×8); each turn count must divide the budget."""
    if kernels < 1 or not turns or any(t < 1 or kernels % t for t in turns):
        raise ValueError(f"eval_budget: every turn count of {list(turns)} must divide kernels = {kernels}")
    return [(kernels // t, t) for t in sorted(set(turns))]


def budget_job(tasks_path: str | os.PathLike, out_path: str | os.PathLike, cache_path: str | os.PathLike,
               entry: Mapping[str, Any], settings: Mapping[str, Any], *, level: int, shard: int = 0,
               num_shards: int = 1, run: str = "default", gym: Mapping[str, Any] | None = None,
               checkpoint: str | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """Kevin's test-time budget (config `eval_budget`) for one model, level and shard: every split
    of `settings["kernels"]` into trajectories × turns through the evaluation's loop, with one
    engine and evaluator for all; rows stage="budget", model "<name>@<trajectories>x<turns>".
    The splits share the sampling seed, so sample i starts alike in each (a cached API model pays
    for the shared turns once) and splits differ by how the budget is spent, not by the draw."""
    check_model(entry)
    tasks = eval_tasks(tasks_path, level, shard, num_shards, settings.get("max_tasks"))
    rows: list[dict[str, Any]] = []
    with opened_model(entry, settings, cache_path, gym, checkpoint, progress) as (engine, evaluator):
        for trajectories, turns in budget_splits(int(settings["kernels"]), settings["turns"]):
            split = run_episodes(tasks, engine, evaluator, inference_history(entry), n_samples=trajectories, max_turns=turns,
                                 sampling=sampling_of(settings, entry), run=run, stage=BUDGET_STAGE,
                                 iteration=checkpoint_iteration(checkpoint),
                                 seed=int(settings.get("seed", 0)),
                                 max_context_tokens=settings.get("max_context_tokens"), progress=progress)
            rows.extend({**row, "model": f"{entry['name']}@{trajectories}x{turns}"} for row in split)
    write_table(rows, out_path, "trajectories")
    log.info("budget %s L%d: %d tasks, %d turns written to %s", entry["name"], level, len(tasks), len(rows), out_path)
    return rows
