"""Host memory of a pool does not grow with the number of evaluations (CPU, interpreter)."""

from __future__ import annotations

from pathlib import Path

from kpipe.gym import Protocol
from kpipe.gym.serve.pool import GymPool

FIXTURES = Path(__file__).parent / "fixtures" / "gym"
REFERENCE = (FIXTURES / "relu_reference.py").read_text()
LEGIT = (FIXTURES / "relu_legit.py").read_text()
PROTOCOL = Protocol(correct_trials=2, perf_trials=3, warmup=1, baseline="eager", device="cpu", timeout_s=60)
WARM, MORE = 20, 180  # a 200-evaluation batch (issue 14)
SLACK_MB = 40.0  # allocator noise; a per-evaluation leak of a result or a reference run would pass it


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def test_pool_host_memory_does_not_grow_over_many_evaluations() -> None:
    """The judging worker and its zygote hold what they held after a warm-up, however many
    evaluations follow (results, child outputs and reused references are not kept); memory is
    read between evaluations, when the zygote's only child is the next candidate's, started ahead
    (kpipe.gym.confine.zygote.ZygoteLauncher: its sandbox's waiter, init and candidate)."""
    with GymPool(PROTOCOL, workers=1, reuse_reference=True, progress=False) as pool:
        worker = pool.workers()[0]["pid"]

        def held() -> tuple[dict[int, float], list[int]]:
            [zygote] = children(worker)
            return {pid: rss_mb(pid) for pid in (worker, zygote)}, descendants(zygote)

        results = pool.evaluate_many([(REFERENCE, f"{LEGIT}\n# {i}\n") for i in range(WARM)])
        warm, waiting_then = held()
        results += pool.evaluate_many([(REFERENCE, f"{LEGIT}\n# {i}\n") for i in range(WARM, WARM + MORE)])
        after, waiting_now = held()
    assert [r.status for r in results] == ["pass"] * (WARM + MORE)
    assert set(after) == set(warm), (warm, after)
    assert len(waiting_then) == len(waiting_now) == 3 and not set(waiting_then) & set(waiting_now), (waiting_then, waiting_now)
    growth = {pid: after[pid] - warm[pid] for pid in warm}
    assert all(g < SLACK_MB for g in growth.values()), growth
