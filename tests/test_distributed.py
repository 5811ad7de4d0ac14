"""KernelGym on a local Ray cluster (CPU): results match the local pool's, duplicates and
cached jobs are evaluated once, and an actor killed mid-task costs a retry, not a result."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import ray

import kpipe  # noqa: E402
from kpipe.data.kernelbench import select_problems, shrink_sizes  # noqa: E402
from kpipe.gym import Protocol  # noqa: E402
from kpipe.gym.bank import solutions_for  # noqa: E402
from kpipe.gym.serve.cache import ResultCache  # noqa: E402
from kpipe.gym.serve.distributed import RayGym, default_actor_count, was_evaluated  # noqa: E402
from kpipe.gym.serve.pool import MAX_ATTEMPTS, lost_result  # noqa: E402
from kpipe.gym.judge.result import REFERENCE_ERROR  # noqa: E402
from kpipe.gym.judge.result import EvalResult  # noqa: E402
from kpipe.gym.confine.sandbox import OPT_OUT_VARIABLE  # noqa: E402

REFERENCE = shrink_sizes(select_problems("main", [1], {1: [19]})[0].code, 48)
LEGIT = next(s.source for s in solutions_for(1, 19) if s.variant == "legit")
PROTOCOL = Protocol(correct_trials=2, perf_trials=3, warmup=1, baseline="eager", device="cpu", timeout_s=20,
                    reject_findings=())

# The candidate walks up its process ancestry (child -> zygote -> pool worker -> Ray actor)
# and SIGKILLs the actor: the whole evaluating process tree of that GPU slot is gone mid-task.
KILL_ACTOR = '''
import os, time
{legit}

def _ray_actor_pid():
    pid = os.getpid()
    while pid > 1:
        pid = int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])
        if open(f"/proc/{{pid}}/cmdline", "rb").read().startswith(b"ray::"):
            return pid
    raise RuntimeError("not running under a Ray actor")


class ModelNew(ModelNew):
    def forward(self, x):
        marker = {marker!r}
        if marker is None or not os.path.exists(marker):
            if marker is not None:
                open(marker, "w").close()
            os.kill(_ray_actor_pid(), 9)
            time.sleep(30)
        return super().forward(x)
'''


def variant(source: str, tag: object) -> str:
    return f"{source}\n# variant {tag}\n"


def status(result: object) -> str:
    return result.status if isinstance(result, EvalResult) else result["status"]


def test_the_stages_evaluator_factory_evaluates_through_a_local_ray_cluster(tmp_path: Path) -> None:
    """`gym.backend: ray` in open_evaluator (what the multi-turn loop of every stage gets): a
    local Ray instance is started, RayGym evaluates with the configured cache, and Ray is
    stopped when the evaluator closes. Runs before the `gym` fixture starts its own instance."""
    from kpipe.agent.evaluator import open_evaluator

    assert not ray.is_initialized()
    cache_path = tmp_path / "cache.sqlite"
    gym_config = {"backend": "ray", "ray_address": None, "actors": 1, "cache": str(cache_path),
                  "protocol": PROTOCOL.to_dict()}
    planted = Path(kpipe.__file__).parent / f"planted_by_ray_{os.getpid()}.py"
    writer = LEGIT + f"\nopen({str(planted)!r}, 'w').write('planted')\n"  # a candidate writing into the kpipe package
    try:
        with open_evaluator(gym_config, progress=False) as evaluator:
            assert isinstance(evaluator, RayGym) and len(evaluator.workers()) == 1
            result, confined = evaluator.evaluate_many([(REFERENCE, LEGIT), (REFERENCE, writer)])
        assert status(result) == "pass", result.diagnostic
        assert status(confined) != "pass" and "PermissionError" in confined.diagnostic  # refused at import: confined
        assert not planted.exists()
    finally:
        planted.unlink(missing_ok=True)
    assert ResultCache(cache_path).get(result.key) is not None
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def gym():
    """Two actors whose candidates run unconfined (the named opt-out, in every Ray worker and in
    this process, whose core evaluations and cache keys the tests compare with): only an
    unconfined candidate can kill its actor, which stands in for every other way an actor is
    lost. The evaluator-factory test above runs through Ray confined."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(OPT_OUT_VARIABLE, "1")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {OPT_OUT_VARIABLE: "1"}})
        try:
            with RayGym(PROTOCOL, actors=2, progress=False) as gym:
                yield gym
        finally:
            ray.shutdown()


def test_default_actor_count_is_one_per_gpu_or_per_two_cpus() -> None:
    assert default_actor_count({"GPU": 16.0, "CPU": 256.0}, use_gpus=True, cpus_per_actor=1) == 16
    assert default_actor_count({"CPU": 8.0}, use_gpus=False, cpus_per_actor=1) == 4
    assert default_actor_count({"CPU": 1.0}, use_gpus=False, cpus_per_actor=1) == 1


def test_only_real_evaluations_are_cacheable() -> None:
    from concurrent.futures import Future

    from kpipe.gym.serve.worker import Job

    lost = lost_result(Job(1, REFERENCE, LEGIT, "k", Future(), losses=["gone"]), PROTOCOL, "cpu")
    assert not was_evaluated(lost) and not was_evaluated({"status": REFERENCE_ERROR})


def test_results_match_the_core_and_come_back_in_order(gym: RayGym) -> None:
    from kpipe.gym.judge.evaluation import evaluate

    broken = "import triton\nclass ModelNew:\n    pass\n"
    jobs = [(REFERENCE, LEGIT), (REFERENCE, broken), ("class Model(:\n", LEGIT), (REFERENCE, variant(LEGIT, 1))]
    results = gym.evaluate_many(jobs)
    assert [status(r) for r in results] == ["pass", "format_error", REFERENCE_ERROR, "pass"]
    direct = evaluate(REFERENCE, broken, PROTOCOL)
    assert (results[1].key, results[1].status) == (direct.key, direct.status)
    infos = gym.workers()
    assert len({i["pid"] for i in infos}) == 2 and {i["device_kind"] for i in infos} == {gym.device_kind}


def test_duplicates_and_cached_jobs_are_evaluated_once(gym: RayGym, tmp_path: Path) -> None:
    gym.cache = ResultCache(tmp_path / "cache.sqlite")
    try:
        jobs = [(REFERENCE, variant(LEGIT, f"dup {i % 2}")) for i in range(6)]
        done_before = sum(i["done"] for i in gym.workers())
        first = gym.evaluate_many(jobs)
        assert sum(i["done"] for i in gym.workers()) - done_before == 2
        again = gym.evaluate_many(jobs)
        assert sum(i["done"] for i in gym.workers()) - done_before == 2
        assert [r.key for r in first] == [r.key for r in again] and all(status(r) == "pass" for r in again)
    finally:
        gym.cache = None


def test_an_actor_killed_mid_task_costs_a_retry_not_a_result(gym: RayGym, tmp_path: Path) -> None:
    once = KILL_ACTOR.format(legit=LEGIT, marker=str(tmp_path / "killed-once"))
    always = KILL_ACTOR.format(legit=LEGIT, marker=None)
    pids_before = {i["pid"] for i in gym.workers()}
    retried, lost, after = gym.evaluate_many([(REFERENCE, once), (REFERENCE, always), (REFERENCE, variant(LEGIT, 2))])
    assert (tmp_path / "killed-once").exists()  # the first attempt really ran and died
    assert status(retried) == "pass", retried.diagnostic
    assert status(lost) == "crashed"
    assert f"lost {MAX_ATTEMPTS} times" in lost.diagnostic and lost.diagnostic.count("Actor") == MAX_ATTEMPTS
    assert status(after) == "pass"
    deadline = time.monotonic() + 120
    while not all(i["alive"] for i in gym.workers()) and time.monotonic() < deadline:
        time.sleep(1)
    infos = gym.workers()  # Ray restarted the killed actors: every slot is back, in new processes
    assert all(i["alive"] for i in infos) and {i["pid"] for i in infos} != pids_before
