"""The worker pool: warm forked children classify every fault like fresh interpreters do,
a lost worker is replaced and its job re-queued once then failed with a reason, duplicates
and cached jobs are never evaluated twice."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from kpipe.data.kernelbench import select_problems, shrink_sizes
from kpipe.gym import Protocol
from kpipe.gym.bank import solutions_for
from kpipe.gym.serve.cache import ResultCache
from kpipe.gym.serve.pool import MAX_ATTEMPTS, MAX_CPU_THREADS, GymPool, JobQueue, WorkerState, default_cpu_threads, default_slots
from kpipe.gym.judge.result import REFERENCE_ERROR
from kpipe.gym.judge.result import EvalResult
from kpipe.gym.confine.sandbox import OPT_OUT_VARIABLE
from kpipe.gym.serve.worker import Job

FIXTURES = Path(__file__).parent / "fixtures" / "gym"
REFERENCE = shrink_sizes(select_problems("main", [1], {1: [19]})[0].code, 48)
LEGIT = next(s.source for s in solutions_for(1, 19) if s.variant == "legit")
# faults run for real: the static screen would otherwise reject most of them unexecuted. The timeout is
# what infinite_loop costs; at 6 s a fresh pool's first child once timed out in its start-up on a 2-core
# machine busy with the other test worker's DAG run (CI of 3e131be)
PROTOCOL = Protocol(correct_trials=2, perf_trials=3, warmup=1, baseline="eager", device="cpu", timeout_s=15, reject_findings=())
FAULT_STATUS = {
    "segfault": "crashed",
    "infinite_loop": "timeout",
    "os_exit": "crashed",
    "sys_exit": "crashed",
    "huge_stdout": "pass",
    "runtime_exception": "runtime_error",
    "kill_own_group": "crashed",
    "syntax_error": "compilation_error",
}

KILL_WORKER = '''
import os, time
{legit}

def _worker_pid():
    zygote = os.getppid()
    stat = open(f"/proc/{{zygote}}/stat").read()
    return int(stat.rsplit(")", 1)[1].split()[1])


class ModelNew(ModelNew):
    def forward(self, x):
        marker = {marker!r}
        if marker is None or not os.path.exists(marker):
            if marker is not None:
                open(marker, "w").close()
            os.kill(_worker_pid(), 9)
            time.sleep(30)
        return super().forward(x)
'''


def fault(name: str) -> str:
    return (FIXTURES / "faults" / f"{name}.py").read_text()


def variant(source: str, tag: object) -> str:
    """The same program under a distinct cache key."""
    return f"{source}\n# variant {tag}\n"


@pytest.fixture(scope="module")
def pool() -> GymPool:
    with GymPool(PROTOCOL, workers=2, progress=False) as pool:
        yield pool


@pytest.fixture(scope="module")
def unconfined_pool() -> GymPool:
    """A pool whose candidates run unconfined (the named opt-out): only there can a candidate
    kill its worker or fork server, which stands in for every other way a worker is lost (the
    OOM killer, a bug in the judge)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(OPT_OUT_VARIABLE, "1")
        with GymPool(PROTOCOL, workers=2, progress=False) as pool:
            yield pool


def status(result: object) -> str:
    return result.status if isinstance(result, EvalResult) else result["status"]


def test_every_fault_gets_its_status_and_the_pool_survives(pool: GymPool) -> None:
    names = list(FAULT_STATUS)
    results = pool.evaluate_many([(REFERENCE, LEGIT)] + [(REFERENCE, fault(n)) for n in names])
    assert status(results[0]) == "pass", results[0].diagnostic
    assert {n: status(r) for n, r in zip(names, results[1:])} == FAULT_STATUS
    assert all(w["alive"] and w["restarts"] == 0 for w in pool.workers())
    assert status(pool.evaluate(REFERENCE, variant(LEGIT, "after faults"))) == "pass"


def test_forked_children_match_the_fresh_interpreter_path() -> None:
    from kpipe.gym.judge.evaluation import evaluate

    protocol = Protocol(**{**PROTOCOL.to_dict(), "timeout_s": 120})  # a fresh interpreter starts slowly
    jobs = [(REFERENCE, LEGIT), (REFERENCE, fault("os_exit"))]
    fresh = [evaluate(r, c, protocol) for r, c in jobs]
    with GymPool(protocol, workers=1, progress=False) as pool:
        forked = pool.evaluate_many(jobs)
    for a, b in zip(fresh, forked):
        assert (a.key, a.status, a.correct, a.launched_kernels) == (b.key, b.status, b.correct, b.launched_kernels)


def test_a_lost_worker_is_replaced_and_its_job_retried_once(unconfined_pool: GymPool, tmp_path: Path) -> None:
    pool = unconfined_pool
    once = KILL_WORKER.format(legit=LEGIT, marker=str(tmp_path / "killed-once"))
    always = KILL_WORKER.format(legit=LEGIT, marker=None)
    restarts_before = sum(w["restarts"] for w in pool.workers())
    retried, lost = pool.evaluate_many([(REFERENCE, once), (REFERENCE, always)])
    assert status(retried) == "pass"  # the second attempt ran on a fresh worker
    assert status(lost) == "crashed"
    assert f"lost {MAX_ATTEMPTS} times" in lost.diagnostic and "died" in lost.diagnostic
    assert sum(w["restarts"] for w in pool.workers()) - restarts_before == 1 + MAX_ATTEMPTS
    assert status(pool.evaluate(REFERENCE, variant(LEGIT, "after losses"))) == "pass"


KILL_ZYGOTE = LEGIT + "\nimport os\n\nclass ModelNew(ModelNew):\n    def forward(self, x):\n        os.kill(os.getppid(), 9)\n        return super().forward(x)\n"


def test_a_confined_candidate_cannot_signal_its_parent(pool: GymPool) -> None:
    """Its parent is the sandbox's pid 1, outside its Landlock domain: the kill is refused."""
    restarts_before = sum(w["restarts"] for w in pool.workers())
    results = pool.evaluate_many([(REFERENCE, KILL_ZYGOTE), (REFERENCE, variant(LEGIT, "after a refused kill"))])
    assert [status(r) for r in results] == ["runtime_error", "pass"]
    assert "PermissionError" in results[0].diagnostic
    assert sum(w["restarts"] for w in pool.workers()) == restarts_before


def test_an_unconfined_candidate_that_kills_the_fork_server_is_one_crashed_result(unconfined_pool: GymPool) -> None:
    results = unconfined_pool.evaluate_many([(REFERENCE, KILL_ZYGOTE), (REFERENCE, variant(LEGIT, "after zygote"))])
    assert [status(r) for r in results] == ["crashed", "pass"]


def test_duplicates_and_cached_jobs_are_evaluated_once(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path / "cache.sqlite")
    jobs = [(REFERENCE, variant(LEGIT, i % 2)) for i in range(6)]
    with GymPool(PROTOCOL, workers=1, cache=cache, progress=False) as pool:
        first = pool.evaluate_many(jobs)
        assert pool.workers()[0]["done"] == 2
        again = pool.evaluate_many(jobs)
        assert pool.workers()[0]["done"] == 2
    assert [r.key for r in first] == [r.key for r in again]
    assert len({r.key for r in first}) == 2 and len(cache) == 2


def test_a_broken_reference_is_a_reference_error_not_an_exception(pool: GymPool) -> None:
    broken = REFERENCE.replace("def forward(self, x", "def forward(self, x, missing", 1)
    good, bad = pool.evaluate_many([(REFERENCE, variant(LEGIT, "ref ok")), (broken, LEGIT)])
    assert status(good) == "pass"
    assert bad["status"] == REFERENCE_ERROR and "reference" in bad["feedback"]


def test_bad_usage_is_refused() -> None:
    with pytest.raises(RuntimeError, match="could not start"):
        GymPool(Protocol(device="cuda"), workers=1, progress=False)


def test_slots_are_the_given_gpus_or_cpu_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert default_slots(None) == ["0", "0", "1", "1", "2", "2", "3", "3"]  # two workers per GPU
    assert default_slots(None, ["2"]) == ["2", "2"]  # one RL process per GPU evaluates on its own
    assert default_slots(1, ["1", "3"], per_gpu=1) == ["1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert default_slots(2) == [None, None]


def test_each_worker_gets_its_share_of_the_cores_up_to_the_cap() -> None:
    assert default_cpu_threads(2, cores=16) == 8  # a 1x H200 host's two workers
    assert default_cpu_threads(8, cores=64) == 8  # a 4x H200 host's eight
    assert default_cpu_threads(2, cores=64) == MAX_CPU_THREADS == 16  # not 32 each: slower (pool.py)
    assert default_cpu_threads(4, cores=2) == 1


def queued(*references: str) -> list[Job]:
    return [Job(i, reference, f"candidate {i}", f"key {i}", Future()) for i, reference in enumerate(references)]


def test_a_free_worker_takes_the_highest_priority_waiting_before_its_own_tasks() -> None:
    """A Snakemake run's critical path (distillation, the RL iterations: priority 10) is served
    before the evaluations only its report waits for, even by a worker that has run their
    references; within a priority the usual order holds, and an identical job asked for again at a
    higher priority is raised to it."""
    jobs = JobQueue(affinity=True)
    for job in queued("A", "B", "A", "B"):
        jobs.put(job)
    urgent = Job(9, "C", "candidate 9", "key 9", Future(), priority=10)
    jobs.put(urgent)
    worker = WorkerState(slot=0, gpu="0", references={"A"})
    assert jobs.get(worker, [worker]) is urgent  # before its own task A, though C is new to it
    worker.busy_reference = None
    assert jobs.get(worker, [worker]).job_id == 0  # then its own task's, oldest first
    worker.busy_reference = None
    jobs.promote("key 3", 5)  # B's second job, asked for again at 5
    assert jobs.get(worker, [worker]).job_id == 3
    fifo = JobQueue(affinity=False)
    for job in queued("A", "B"):
        fifo.put(job)
    fifo.promote("key 1", 1)
    assert [fifo.get(worker, [worker]).job_id for _ in range(2)] == [1, 0]


def test_the_pools_own_work_imports_no_torch() -> None:
    """The pool keys every job it is given and sends it with a reply timeout: a caller without
    torch (``kpipe gym eval-batch``, the benchmarks) must not import it for either. It did, on
    the first job: 3 s on an H200 host in which every worker sat idle with the batch queued."""
    import subprocess
    import sys

    probe = ("import sys; from kpipe.gym import Protocol; from kpipe.gym.serve.pool import GymPool\n"
             "pool = GymPool.__new__(GymPool); pool.protocol, pool.device_kind = Protocol(), 'cpu'\n"
             "assert len(pool.key('ref', 'cand')) == 64 and pool._reply_timeout() > 0\n"
             "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_with_reuse_a_worker_takes_its_own_tasks_then_new_ones_then_the_oldest() -> None:
    """A one-pass batch cycling through tasks runs each task's reference about once per pool."""
    jobs = JobQueue(affinity=True)
    for job in queued("A", "B", "C", "A", "B", "C", "A"):
        jobs.put(job)
    first, second = WorkerState(slot=0, gpu="0"), WorkerState(slot=1, gpu="0")
    workers = [first, second]
    assert jobs.get(first, workers).reference == "A"
    assert jobs.get(second, workers).reference == "B"  # A is being run by the first worker
    assert (second.busy_with, second.busy_reference) == ("key 1", "B")
    first.busy_reference, first.references = None, {"A"}
    assert [jobs.get(first, workers).job_id for _ in range(2)] == [3, 6]  # its own task's, oldest first
    first.busy_reference = None
    assert jobs.get(first, workers).reference == "C"  # a task nobody has run
    first.references.add("C")
    second.busy_reference, second.references = None, {"B"}
    assert [jobs.get(second, workers).job_id for _ in range(2)] == [4, 5]  # its own B, then the oldest left
    for job in queued("A", "C", "C"):
        jobs.put(job)
    second.busy_reference = None
    assert jobs.get(second, workers).reference == "C"  # helps with the task that has the most waiting
    assert [jobs.get(first, workers).reference for _ in range(2)] == ["A", "C"]
    jobs.stop(2)
    assert jobs.get(first, workers) is None and jobs.get(second, workers) is None


def test_without_reuse_the_queue_is_first_in_first_out() -> None:
    jobs = JobQueue(affinity=False)
    for job in queued("A", "B", "A"):
        jobs.put(job)
    worker = WorkerState(slot=0, gpu=None, references={"A"})
    assert [jobs.get(worker, [worker]).job_id for _ in range(3)] == [0, 1, 2]
    jobs.put(queued("C")[0])
    jobs.stop(1)
    assert jobs.get(worker, [worker]).reference == "C"  # jobs queued before the stop are served
    assert jobs.get(worker, [worker]) is None


def test_a_job_to_run_alone_waits_for_its_gpu_to_be_free_and_holds_the_others_off() -> None:
    """Issue 62, row 11: a reference that ran out of GPU memory beside other evaluations is retried
    alone on its GPU; the GPU's other workers take nothing while it waits or runs, other GPUs go on."""
    jobs = JobQueue(affinity=False)
    first, second, elsewhere = (WorkerState(slot=0, gpu="0", alive=True), WorkerState(slot=1, gpu="0", alive=True),
                                WorkerState(slot=2, gpu="1", alive=True))
    workers = [first, second, elsewhere]
    for job in queued("A", "B", "C", "D"):
        jobs.put(job)
    assert jobs.get(first, workers).job_id == 0 and jobs.get(second, workers).job_id == 1
    retried = jobs.get(first, workers)  # ... it ran out of memory: queued again to run alone on GPU 0
    jobs.done(first)
    retried.alone, retried.alone_on = True, "0"
    jobs.put(retried)
    assert jobs._takeable(first, workers) == []  # the second worker is still busy on GPU 0
    assert jobs.get(elsewhere, workers).job_id == 3  # another GPU is not held off
    jobs.done(second)
    assert jobs._takeable(second, workers) == [0]  # GPU 0 is free: only the job to run alone
    assert jobs.get(second, workers) is retried and second.busy_alone
    assert jobs._takeable(first, workers) == []  # held off while it runs
    jobs.done(second)
    jobs.stop(3)
    assert [jobs.get(worker, workers) for worker in workers] == [None, None, None]


# a reference that runs out of memory the first time it runs (while the other evaluations of its batch
# run beside it), then passes: the injected fault of a GPU whose memory another worker held
RUNS_OUT_OF_MEMORY_ONCE = '''
try:
    open({marker!r}, "x").close()
except OSError:
    pass  # it ran before (or this is the candidate's process, which loads the reference too, out of the marker's reach)
else:
    raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (injected by the test)")
'''


def test_a_reference_out_of_memory_is_retried_alone_and_every_row_is_answered(tmp_path: Path) -> None:
    injected = RUNS_OUT_OF_MEMORY_ONCE.format(marker=str(tmp_path / "ran-out-once")) + REFERENCE
    broken = REFERENCE.replace("def forward(self, x", "def forward(self, x, missing", 1)
    jobs = [(REFERENCE, variant(LEGIT, "beside")), (injected, LEGIT), (broken, LEGIT), (REFERENCE, variant(LEGIT, "after"))]
    with GymPool(PROTOCOL, workers=2, progress=False, reuse_reference=False) as pool:
        results = pool.evaluate_many(jobs)
    assert [status(result) for result in results] == ["pass", "pass", REFERENCE_ERROR, "pass"], [getattr(r, "diagnostic", r) for r in results]
    assert (tmp_path / "ran-out-once").exists()


def test_only_what_ran_out_of_memory_beside_others_is_retried_alone() -> None:
    pool = GymPool.__new__(GymPool)
    first, second, alone = WorkerState(slot=0, gpu="0"), WorkerState(slot=1, gpu="0"), WorkerState(slot=2, gpu="1")
    pool.states = [first, second, alone]
    job = queued("A")[0]
    out_of_memory = "the reference program failed (torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)"
    assert pool._ran_out_beside_others(job, first, REFERENCE_ERROR, out_of_memory)
    assert pool._ran_out_beside_others(job, first, "ok", {"status": "oom"})  # a candidate that ran out
    assert not pool._ran_out_beside_others(job, first, REFERENCE_ERROR, "the reference program failed (NameError: x)")
    assert not pool._ran_out_beside_others(job, first, "ok", {"status": "mismatch"})
    assert not pool._ran_out_beside_others(job, alone, REFERENCE_ERROR, out_of_memory)  # nobody beside it on GPU 1
    job.alone = True
    assert not pool._ran_out_beside_others(job, first, REFERENCE_ERROR, out_of_memory)  # it ran alone: its answer
