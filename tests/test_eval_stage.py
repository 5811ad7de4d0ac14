"""The evaluation and STTS drivers with a scripted engine and evaluator: task sharding, model
entries, stage/model labels of the rows, the STTS history strategies, the STTS curve SQL."""

import pytest
from click.testing import CliRunner

from kpipe.agent.history import FullHistory, TopW
from kpipe.agent.loop import AgentTask
from kpipe.data.io import read_table, write_table
from kpipe.data.db import build_db
from kpipe.evaluate.kernelbench import (check_model, engine_spec, eval_tasks, evaluate_shard, models_by_name,
                              sampling_of)
from kpipe.evaluate.cli import eval_cli
from kpipe.llm.types import Completion
from kpipe.evaluate.stts import stts_model_label
from kpipe.report.tables import DEFAULT_SQL_DIR, run_table_sql


class ScriptedEngine:
    """Answers turn t (its t-th call: the loop makes one call per turn) with a kernel whose
    quality is `qualities[(t - 1) % len]`."""

    model = "scripted"

    def __init__(self, qualities):
        self.qualities = qualities
        self.contexts = []
        self.turn = 0

    def generate(self, requests, on_result=None):
        out = []
        self.turn += 1
        for request in requests:
            self.contexts.append(request.messages)
            quality = self.qualities[(self.turn - 1) % len(self.qualities)]
            text = f"Attempt.\n```python\nclass ModelNew:\n    speed = {quality}\n```\n"
            out.append(Completion(text, "stop", prompt_tokens=10, completion_tokens=10))
        return out


class SpeedEvaluator:
    """Correct with the written speed when it is positive; speed 9 marks a hack."""

    def evaluate_many(self, jobs):
        results = []
        for _, candidate in jobs:
            speed = float(candidate.split("speed = ")[1].split("\n")[0])
            results.append({"status": "hacked" if speed == 9 else ("pass" if speed > 0 else "mismatch"),
                            "correct": speed > 0, "hacked": speed == 9, "speedup_eager": speed if speed > 0 else None,
                            "speedup_compile": speed / 2 if speed > 0 else None, "feedback": f"speed {speed}"})
        return results


def write_tasks(path, levels=(1, 1, 1, 2)):
    rows = [{"task_id": f"kb-L{lv}-{i}", "source": "kernelbench", "version": "main", "size_profile": "tiny",
             "split": "eval", "level": lv, "problem_id": i, "name": f"p{i}", "reference_src": f"# ref {i}",
             "reference_hash": str(i)} for i, lv in enumerate(levels, start=1)]
    rows.append({**rows[0], "task_id": "kb-val", "split": "validation", "problem_id": 99})
    write_table(rows, path, "tasks")
    return path


def test_eval_tasks_shards_levels_and_skips_validation(tmp_path):
    tasks = write_tasks(tmp_path / "tasks.parquet")
    all_l1 = [t.task_id for t in eval_tasks(tasks, 1)]
    assert all_l1 == ["kb-L1-1", "kb-L1-2", "kb-L1-3"]
    shards = [[t.task_id for t in eval_tasks(tasks, 1, s, 2)] for s in range(2)]
    assert sorted(sum(shards, [])) == all_l1 and all(shards)
    assert [t.task_id for t in eval_tasks(tasks, 1, max_tasks=2)] == ["kb-L1-1", "kb-L1-2"]
    with pytest.raises(ValueError, match="no evaluation task of level 3"):
        eval_tasks(tasks, 3)
    with pytest.raises(ValueError, match="shard 2 is not in"):
        eval_tasks(tasks, 1, 2, 2)


def test_model_entries_are_checked_and_turned_into_engine_specs():
    models = models_by_name([{"name": "sft", "kind": "pipeline", "source": "sft"},
                             {"name": "rl", "kind": "pipeline", "source": "rl", "rl_run": "drkernel"},
                             {"name": "gpt-5", "kind": "openai", "model": "gpt-5", "api_key_env": "OPENAI_API_KEY"}])
    checkpoint = "results/models/sft-default"
    assert engine_spec(models["sft"], checkpoint) == {"kind": "hf", "path": checkpoint}
    assert engine_spec(models["rl"], checkpoint) == {"kind": "hf", "path": checkpoint}  # rl_run: the DAG's, not the engine's
    assert engine_spec(models["gpt-5"])["kind"] == "openai" and engine_spec(models["gpt-5"])["model"] == "gpt-5"
    for bad, message in [({"name": "a b", "kind": "hf", "path": "x"}, "needs a `name`"),
                         ({"name": "a", "kind": "torch"}, "kind 'torch' is not one of"),
                         ({"name": "a", "kind": "hf"}, "needs a `path`"),
                         ({"name": "a", "kind": "pipeline", "source": "ppo"}, "source: sft"),
                         ({"name": "a", "kind": "pipeline", "source": "sft", "rl_run": "x"}, "`rl_run` names")]:
        with pytest.raises(ValueError, match=message):
            check_model(bad)
    with pytest.raises(ValueError, match="used twice"):
        models_by_name([{"name": "a", "kind": "offline_teacher"}] * 2)
    with pytest.raises(ValueError, match="checkpoint path"):
        engine_spec(models["sft"])


def test_a_model_entry_sampling_goes_on_top_of_the_stage_sampling():
    stage = {"sampling": {"max_tokens": 128, "temperature": 0.7}}
    teacher = {"name": "teacher", "kind": "offline_teacher", "sampling": {"max_tokens": 4096}}
    assert sampling_of(stage, teacher) == sampling_of({"sampling": {"max_tokens": 4096, "temperature": 0.7}})
    assert sampling_of(stage, {"name": "m", "kind": "offline_teacher"}).max_tokens == 128
    assert "sampling" not in engine_spec(teacher)  # the entry's, not the engine's


def test_evaluate_shard_writes_eval_rows_labelled_with_the_config_name(tmp_path):
    tasks = [AgentTask("kb-L1-1", "# ref"), AgentTask("kb-L1-2", "# ref")]
    out = tmp_path / "part-0.parquet"
    evaluate_shard(tasks, ScriptedEngine([0, 1.5, 9]), SpeedEvaluator(), out, model_name="tiny-sft", run="r",
                   n_samples=2, n_turns=3)
    frame = read_table(out, "trajectories").to_pandas()
    assert len(frame) == 2 * 2 * 3 and set(frame["stage"]) == {"eval"} and set(frame["model"]) == {"tiny-sft"}
    by_turn = frame.groupby("turn")[["correct", "hacked"]].sum()
    assert by_turn.loc[1].tolist() == [0, 0] and by_turn.loc[2].tolist() == [4, 0] and by_turn.loc[3].tolist() == [4, 4]


def test_stts_strategies_bound_the_context_and_label_the_rows(tmp_path):
    tasks = [AgentTask("kb-L1-1", "# ref")]
    full, top = ScriptedEngine([1.1, 0, 2.0, 0, 1.3, 0]), ScriptedEngine([1.1, 0, 2.0, 0, 1.3, 0])
    evaluate_shard(tasks, full, SpeedEvaluator(), tmp_path / "full.parquet",
                   model_name=stts_model_label("m", "full", 2), stage="stts", policy=FullHistory(), n_samples=1,
                   n_turns=6)
    evaluate_shard(tasks, top, SpeedEvaluator(), tmp_path / "top.parquet",
                   model_name=stts_model_label("m", "top_w", 2), stage="stts", policy=TopW(w=2), n_samples=1,
                   n_turns=6)
    assistant_turns = [sum(m["role"] == "assistant" for m in c) for c in top.contexts]
    assert assistant_turns == [0, 1, 2, 2, 2, 2]  # at most w earlier turns in the prompt
    assert [sum(m["role"] == "assistant" for m in c) for c in full.contexts] == [0, 1, 2, 3, 4, 5]
    last = top.contexts[-1]
    kept = [m["content"] for m in last if m["role"] == "assistant"]
    assert "speed = 2.0" in kept[0] and "speed = 1.3" in kept[1]  # the two best of turns 1..5, in order
    labels = set(read_table(tmp_path / "top.parquet", "trajectories").to_pandas()["model"])
    assert labels == {"m@top_w(w=2)"} and stts_model_label("m", "full", 4) == "m@full"
    with pytest.raises(ValueError, match="unknown STTS strategy"):
        stts_model_label("m", "kevin", 4)


def test_stts_curves_from_rows(tmp_path):
    results = tmp_path / "results"
    write_tasks(results / "tasks" / "tasks.parquet")
    tasks = [AgentTask("kb-L1-1", "# ref"), AgentTask("kb-L1-2", "# ref")]
    evaluate_shard(tasks, ScriptedEngine([1.3, 0, 1.0]), SpeedEvaluator(),
                   results / "trajectories" / "stage=stts" / "part-0.parquet", model_name="m@top_w(w=4)",
                   stage="stts", policy=TopW(w=4), n_samples=1, n_turns=3)
    build_db(results, results / "kpipe.duckdb")
    curves = run_table_sql(results / "kpipe.duckdb", DEFAULT_SQL_DIR / "stts_curves.sql")
    assert set(curves["model"]) == {"m"} and set(curves["strategy"]) == {"top_w(w=4)"}
    fast = curves.set_index(["history", "T"])["fast_1_2"]
    assert fast[("last", 1)] == 100.0 and fast[("last", 2)] == 0.0 and fast[("last", 3)] == 0.0
    assert fast[("best", 3)] == 100.0  # best of history keeps turn 1's 1.3x


def test_cli_rejects_bad_model_spec(tmp_path):
    tasks = write_tasks(tmp_path / "tasks.parquet")
    result = CliRunner().invoke(eval_cli, ["kernelbench", "--tasks", str(tasks), "--out", str(tmp_path / "o.parquet"),
                                           "--model", "x=torch:/nowhere", "--level", "1"])
    assert result.exit_code == 2 and "NAME=hf:PATH" in result.output


def test_cli_evaluates_a_local_checkpoint_and_runs_stts(tmp_path):
    from kpipe.train.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "nano", size="nano", seed=0)
    tasks = write_tasks(tmp_path / "tasks.parquet")
    settings = tmp_path / "settings.yaml"
    settings.write_text("eval: {samples: 1, turns: 2, max_tasks: 1, sampling: {max_tokens: 8}}\n"
                        "stts: {samples: 1, max_turns: 3, max_tasks: 1, sampling: {max_tokens: 8}}\n")
    common = ["--tasks", str(tasks), "--model", f"nano=hf:{model}", "--level", "1", "--settings", str(settings)]
    result = CliRunner().invoke(eval_cli, ["kernelbench", *common, "--out", str(tmp_path / "eval.parquet")])
    assert result.exit_code == 0, result.output
    rows = read_table(tmp_path / "eval.parquet", "trajectories").to_pandas()
    assert len(rows) == 2 and set(rows["model"]) == {"nano"} and set(rows["stage"]) == {"eval"}
    result = CliRunner().invoke(eval_cli, ["stts", *common, "--strategy", "best_window", "--window", "2",
                                           "--out", str(tmp_path / "stts.parquet")])
    assert result.exit_code == 0, result.output
    rows = read_table(tmp_path / "stts.parquet", "trajectories").to_pandas()
    assert sorted(rows["turn"]) == [1, 2, 3] and set(rows["model"]) == {"nano@best_window(w=2)"}


class ProfiledEvaluator(SpeedEvaluator):
    """As SpeedEvaluator, with a PR per speed: the faster kernel (1.5x) is the lazier one (PR 0)."""

    PR = {1.5: 0.0, 1.2: 0.9}

    def evaluate_many(self, jobs):
        results = super().evaluate_many(jobs)
        for result in results:
            result["pr"] = self.PR.get(result["speedup_eager"])
        return results


def test_stts_ranks_turns_by_the_reward_with_its_pr_term(tmp_path, monkeypatch):
    """Paper §6.3: "the top-w turns with the highest rewards"; DR. KERNEL's reward is Eq. 8, with C·PR. Turn 1
    (1.5x, PR 0: Eq. 1 gives 2.5, Eq. 8 2.5) loses to turn 2 (1.2x, PR 0.9: Eq. 1 2.2, Eq. 8 3.1)."""
    from kpipe.agent.loop import clipped_speedup_reward, profiled_reward
    from kpipe.evaluate import stts
    from kpipe.train.algos import reward_paper

    for speed, pr in ((1.5, 0.0), (1.2, 0.9), (4.0, 0.5)):
        result = {"correct": True, "hacked": False, "speedup_eager": speed, "pr": pr}
        assert profiled_reward(result) == pytest.approx(reward_paper(True, False, speed, pr, use_pr=True))
    assert profiled_reward({"correct": True, "hacked": True, "speedup_eager": 2.0, "pr": 1.0}) == 0.0
    assert profiled_reward({"correct": True, "hacked": False, "speedup_eager": 2.0, "pr": None}) == 3.0

    tasks = [AgentTask("kb-L1-1", "# ref")]
    for reward_fn, kept in ((profiled_reward, "speed = 1.2"), (clipped_speedup_reward, "speed = 1.5")):
        engine = ScriptedEngine([1.5, 1.2, 0])
        rows = evaluate_shard(tasks, engine, ProfiledEvaluator(), tmp_path / "top.parquet", model_name="m@top_w(w=1)",
                              stage="stts", policy=TopW(w=1), n_samples=1, n_turns=3, reward_fn=reward_fn)
        (earlier,) = [m["content"] for m in engine.contexts[-1] if m["role"] == "assistant"]
        assert kept in earlier
    assert [r["reward"] for r in rows] == pytest.approx([2.5, 2.2, 0.0])  # the last pass: Eq. 1's

    seen = {}
    monkeypatch.setattr(stts, "run_model_shard", lambda *args, **kwargs: seen.update(kwargs) or [])
    monkeypatch.setattr(stts, "eval_tasks", lambda *args, **kwargs: tasks)
    stts.stts_job("t", "o", "c", {"name": "m", "kind": "hf", "path": "x"}, {"window": 4}, strategy="top_w", level=1)
    assert seen["reward_fn"] is profiled_reward
