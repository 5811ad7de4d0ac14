"""Distillation against the offline teacher over HTTP: faults, kill and resume, released data."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kpipe.agent.distill import distill_shard, released_coldstart_rows
from kpipe.agent.loop import AgentTask
from kpipe.data.io import read_table, to_table
from kpipe.llm.openai_engine import OpenAIConfig, OpenAIEngine
from kpipe.llm.server import BackgroundServer, FaultConfig, make_app
from kpipe.llm.teacher import Teacher, TeacherBehaviour

REFERENCE = "import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n\nn = 64\n"


@dataclass(frozen=True)
class Sol:
    task_name: str
    level: int
    problem_id: int
    variant: str
    source: str


SOLUTIONS = [Sol("double", 1, 1, v, f"class ModelNew:\n    variant = '{v}'\n") for v in ("legit", "wrong_index")]


class SlowTeacher(Teacher):
    """The teacher with a fixed think time, so a kill can land mid-shard."""

    def respond(self, request):
        time.sleep(0.1)
        return super().respond(request)


def make_teacher(cls=Teacher):
    return cls(SOLUTIONS, {(1, 1): [REFERENCE]}, TeacherBehaviour())


class CodeEvaluator:
    """Passes the legit variant (speedup 1.2), everything else mismatches."""

    def evaluate_many(self, jobs):
        return [
            {"status": "pass", "correct": True, "hacked": False, "speedup_eager": 1.2, "feedback": "Status: pass"}
            if "'legit'" in candidate
            else {"status": "mismatch", "correct": False, "hacked": False, "feedback": "Status: mismatch"}
            for _, candidate in jobs
        ]


class NoisyEvaluator(CodeEvaluator):
    """Like a real gym: the feedback carries a measured time that differs on every evaluation."""

    def evaluate_many(self, jobs):
        results = super().evaluate_many(jobs)
        return [{**r, "feedback": f"{r['feedback']}\nruntime {random.uniform(1, 2):.6f} ms"} for r in results]


def tasks(n):
    return [AgentTask(f"q{i}", REFERENCE) for i in range(n)]


def server_stats(server):
    return httpx.get(server.base_url.removesuffix("/v1") + "/stats").json()


def test_distillation_survives_faults_and_records_every_query(tmp_path):
    faults = FaultConfig(rate_429=0.15, rate_500=0.1, rate_delay=0.05, rate_truncate=0.1, rate_codeless=0.1,
                         delay_s=1.0, seed=7)
    with BackgroundServer(make_app(make_teacher(), "teacher", faults)) as server:
        engine = OpenAIEngine(OpenAIConfig(model="teacher", base_url=server.base_url, api_key_env=None,
                                           concurrency=4, max_retries=10, timeout_s=0.5, backoff_base_s=0.01,
                                           backoff_max_s=0.05, progress=False))
        summary = distill_shard(tasks(8), engine, CodeEvaluator(), tmp_path / "part-0.parquet",
                                tmp_path / "cache.jsonl", n_turns=5, progress=False)
        injected = server_stats(server)["faults"]
    rows = read_table(tmp_path / "part-0.parquet", "trajectories").to_pylist()
    keys = [(r["task_id"], r["sample"], r["turn"]) for r in rows]
    assert len(keys) == len(set(keys)) == 8 * 5  # every query, every turn, once
    assert {r["stage"] for r in rows} == {"coldstart"}
    statuses = {r["status"] for r in rows}
    assert "format_error" in statuses and "pass" in statuses
    assert injected.get("429") and injected.get("500") and injected.get("delay")
    assert [t.requests for t in summary] == [8] * 5
    assert sum(t.cached for t in summary) == 0
    # the teacher learns from feedback: more correct turns at the end than at the start
    assert summary[-1].correct > summary[0].correct


SHARD_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_agent_distill import NoisyEvaluator, tasks
from kpipe.agent.distill import distill_shard
from kpipe.llm.openai_engine import OpenAIConfig, OpenAIEngine

engine = OpenAIEngine(OpenAIConfig(model="teacher", base_url={url!r}, api_key_env=None, concurrency=2,
                                   progress=False))
distill_shard(tasks(6), engine, NoisyEvaluator(), {out!r}, {cache!r}, n_turns=5, progress=False)
"""


def test_kill_and_resume_resends_nothing_and_duplicates_nothing(tmp_path):
    out, cache = tmp_path / "part-0.parquet", tmp_path / "cache.jsonl"
    with BackgroundServer(make_app(make_teacher(SlowTeacher), "teacher")) as server:
        script = tmp_path / "shard.py"
        script.write_text(SHARD_SCRIPT.format(tests=str(Path(__file__).parent), url=server.base_url, out=str(out),
                                              cache=str(cache)))
        first = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
        deadline = time.monotonic() + 60
        while not (cache.exists() and len(cache.read_text().splitlines()) >= 10):
            assert first.poll() is None and time.monotonic() < deadline, "shard ended before it could be killed"
            time.sleep(0.02)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        time.sleep(0.5)  # let the server finish the requests that were in flight
        at_kill = server_stats(server)
        assert not out.exists()
        answered_before = len(cache.read_text().splitlines())
        subprocess.run([sys.executable, str(script)], check=True, timeout=120)
        seen = server_stats(server)
    assert 10 <= answered_before < 30
    # the rerun sent exactly the requests whose answers the killed run had not received
    assert seen["requests"] - at_kill["requests"] == 30 - answered_before
    assert seen["distinct_answered"] == 30
    in_flight_at_kill = at_kill["answered"] - answered_before
    assert 0 <= in_flight_at_kill <= 2  # concurrency 2: only those can be answered twice
    rows = read_table(out, "trajectories").to_pylist()
    assert len({(r["task_id"], r["sample"], r["turn"]) for r in rows}) == len(rows) == 30
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    assert summary["cache_hits"] >= answered_before and summary["sent"] == 30 - summary["cache_hits"]


def test_released_coldstart_data_becomes_trajectories(tmp_path):
    messages = []
    for turn in range(1, 6):
        messages.append({"role": "user", "content": "task" if turn == 1 else f"feedback {turn - 1}"})
        messages.append({"role": "assistant", "content": f"```python\nclass ModelNew:\n    t = {turn}\n```"})
    table = pa.table({"messages": [messages], "uuid": [17], "final_speedup": [1.7], "best_round": [3],
                      "original_python_code": ["class Model: pass"], "num_rounds": [5]})
    pq.write_table(table, tmp_path / "coldstart.parquet")
    rows = released_coldstart_rows(tmp_path / "coldstart.parquet")
    to_table(rows, "trajectories")
    assert [r["turn"] for r in rows] == [1, 2, 3, 4, 5]
    assert {r["task_id"] for r in rows} == {"drkernel_coldstart-17"}
    assert len(rows[2]["prompt_messages"]) == 5 and rows[2]["feedback"] == "feedback 3"
    assert rows[4]["feedback"] is None and "t = 5" in rows[4]["code"]
    assert [r["speedup_eager"] for r in rows] == [None, None, 1.7, None, None]
    pq.write_table(table.drop(["best_round"]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="best_round"):
        released_coldstart_rows(tmp_path / "bad.parquet")


def test_cached_evaluator_replays_results_per_namespace(tmp_path):
    from kpipe.agent.evaluator import CachedEvaluator

    class Counting(NoisyEvaluator):
        calls = 0

        def evaluate_many(self, jobs):
            Counting.calls += len(jobs)
            return super().evaluate_many(jobs)

    path = tmp_path / "evals.jsonl"
    jobs = [("ref", "class ModelNew:\n    variant = 'legit'\n"), ("ref", "bad"), ("ref", "bad")]
    first = CachedEvaluator(Counting(), path, "p1").evaluate_many(jobs)
    assert Counting.calls == 2 and first[1] == first[2]  # identical jobs in a batch: evaluated once
    again = CachedEvaluator(Counting(), path, "p1").evaluate_many(jobs)
    assert again == first and Counting.calls == 2  # replayed from disk, noise and all
    CachedEvaluator(Counting(), path, "p2").evaluate_many(jobs[:1])
    assert Counting.calls == 3  # another protocol is another evaluation


def test_distill_job_with_the_offline_teacher_and_kernelgym(tmp_path):
    """The default pipeline's path: `kpipe serve teacher` in a subprocess, the real evaluator on the CPU."""
    from kpipe.agent.distill import distill_job
    from kpipe.data.io import write_table
    from kpipe.data.kernelbench import load_problems, shrink_sizes

    relu = next(p for p in load_problems("main") if (p.level, p.problem_id) == (1, 19))
    code = shrink_sizes(relu.code, 40)
    write_table([{"query_id": "kernelbench-relu", "source": "kernelbench", "source_id": "relu", "level": 1,
                  "name": relu.name, "reference_src": code, "reference_hash": "x", "contaminated": False}],
                tmp_path / "queries.parquet", "queries")
    settings = {"teacher": "offline", "turns": 2, "reuse_reference": True, "offline": {"p_first_legit": 1.0}}
    protocol = {"correct_trials": 1, "perf_trials": 2, "warmup": 0, "device": "cpu", "baseline": "eager",
                "profile": False}
    summary = distill_job(tmp_path / "queries.parquet", tmp_path / "part-0.parquet", tmp_path / "cache.jsonl",
                          settings, gym={"protocol": protocol, "backend": "local"}, progress=False)
    rows = read_table(tmp_path / "part-0.parquet", "trajectories").to_pylist()
    assert [r["status"] for r in rows] == ["pass", "pass"]  # the bank's legit ReLU passes KernelGym
    assert rows[0]["model"] == "kpipe-teacher" and rows[0]["eval_key"]
    assert [t.requests for t in summary] == [1, 1]
