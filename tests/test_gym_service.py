"""The HTTP service and its client, over a real socket: one evaluation, a batch polled to
the end, results by key, 4xx with reasons for bad input, bearer tokens, and a fault soak of
200 candidates through the service (every one answered, nothing lost or duplicated)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from kpipe.data.kernelbench import select_problems, shrink_sizes
from kpipe.gym import Protocol
from kpipe.gym.bank import solutions_for
from kpipe.gym.serve.client import GymClient, GymServiceError
from kpipe.gym.judge.result import eval_key
from kpipe.gym.serve.pool import GymPool
from kpipe.gym.serve.service import create_app, is_loopback

FAULTS = Path(__file__).parent / "fixtures" / "gym" / "faults"
REFERENCE = shrink_sizes(select_problems("main", [1], {1: [19]})[0].code, 48)
LEGIT = next(s.source for s in solutions_for(1, 19) if s.variant == "legit")
# the timeout bounds the soak's infinite loops; it must also leave a loaded CI machine room
PROTOCOL = Protocol(correct_trials=2, perf_trials=3, warmup=1, baseline="eager", device="cpu", timeout_s=15, reject_findings=())
TOKEN = "s3cret"
SOAK_FAULTS = {  # a quarter of the soak misbehaves, cycling through these
    "segfault": "crashed", "infinite_loop": "timeout", "os_exit": "crashed", "sys_exit": "crashed",
    "huge_stdout": "pass", "runtime_exception": "runtime_error", "kill_own_group": "crashed",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[str, GymPool]]:
    with GymPool(PROTOCOL, workers=2, progress=False) as pool:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(pool, token=TOKEN, max_request_bytes=300_000),
                                               host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", pool
        server.should_exit = True
        thread.join()


@pytest.fixture
def client(service: tuple[str, GymPool]) -> Iterator[GymClient]:
    with GymClient(service[0], token=TOKEN, poll_s=0.2, progress=False) as client:
        yield client


def test_one_evaluation_and_its_result_by_key(client: GymClient) -> None:
    result = client.evaluate(REFERENCE, LEGIT)
    assert result.status == "pass" and result.launched_kernels
    assert client.result(result.key)["result"]["status"] == "pass"
    assert client.result("0" * 64) is None


def test_past_the_deadline_the_answer_is_pending_then_polled(service: tuple[str, GymPool]) -> None:
    url, _ = service
    slow = (FAULTS / "infinite_loop.py").read_text() + "\n# deadline\n"
    response = httpx.post(f"{url}/v1/evaluate", json={"reference_src": REFERENCE, "candidate_src": slow, "deadline_s": 0.5},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert response.status_code == 202 and response.json()["state"] == "pending"
    with GymClient(url, token=TOKEN, poll_s=0.2, progress=False) as client:
        assert client.evaluate(REFERENCE, slow).status == "timeout"


def test_bad_requests_get_4xx_with_a_reason(service: tuple[str, GymPool], client: GymClient) -> None:
    url, _ = service
    auth = {"Authorization": f"Bearer {TOKEN}"}
    not_kernelbench = httpx.post(f"{url}/v1/evaluate", json={"reference_src": "x = 1", "candidate_src": LEGIT}, headers=auth)
    assert not_kernelbench.status_code == 422 and "get_inputs" in not_kernelbench.json()["detail"]
    assert httpx.post(f"{url}/v1/evaluate", json={"reference_src": REFERENCE}, headers=auth).status_code == 422
    huge = httpx.post(f"{url}/v1/batches", json={"jobs": [{"reference_src": REFERENCE, "candidate_src": "#" * 150_000}] * 3}, headers=auth)
    assert huge.status_code == 413
    assert httpx.get(f"{url}/v1/workers").status_code == 401
    assert httpx.get(f"{url}/v1/workers", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/v1/batches/nope", headers=auth).status_code == 404
    with pytest.raises(GymServiceError, match="422"):
        client.evaluate("class Model: pass", LEGIT)


def test_a_reference_that_fails_to_run_is_a_reference_error(client: GymClient) -> None:
    broken = REFERENCE.replace("def forward(self, x", "def forward(self, x, missing", 1)
    good, bad = client.evaluate_many([(REFERENCE, LEGIT + "\n# ok\n"), (broken, LEGIT)])
    assert good.status == "pass" and bad["status"] == "reference_error"


def test_a_clients_priority_reaches_the_pools_queue() -> None:
    """GymClient(priority=...) sends it with every job, single or batched, and the service queues
    them at it (the run's critical path goes first; kpipe.gym.serve.pool.JobQueue)."""
    from concurrent.futures import Future

    from fastapi.testclient import TestClient

    class RecordingPool:
        cache = None

        def __init__(self) -> None:
            self.priorities: list[int] = []

        def key(self, reference: str, candidate: str) -> str:
            return f"{len(reference)}-{len(candidate)}"

        def submit(self, reference: str, candidate: str, priority: int = 0) -> Future:
            self.priorities.append(priority)
            answer: Future = Future()
            answer.set_result({"status": "reference_error", "diagnostic": "not run"})  # what the pool says of a bad reference
            return answer

    pool = RecordingPool()
    client = GymClient("http://testserver", priority=10, progress=False)
    client.http = TestClient(create_app(pool))  # type: ignore[arg-type]
    client.submit_batch([(REFERENCE, LEGIT), (REFERENCE, LEGIT + "\n# 2")])
    with pytest.raises(GymServiceError, match="reference_src failed to run"):
        client.evaluate(REFERENCE, LEGIT)
    assert pool.priorities == [10, 10, 10]
    assert GymClient("http://testserver").priority == 0
    bad = client.http.post("/v1/batches", json={"jobs": [{"reference_src": REFERENCE, "candidate_src": LEGIT}], "priority": 10**6})
    assert bad.status_code == 422


def test_non_loopback_needs_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


@pytest.mark.slow  # minutes on a loaded 2-core machine
def test_fault_soak_of_200_candidates_through_the_service(service: tuple[str, GymPool], client: GymClient) -> None:
    names = list(SOAK_FAULTS)
    jobs, expected = [], []
    for i in range(200):
        if i % 4 == 3:
            name = names[(i // 4) % len(names)]
            jobs.append((REFERENCE, (FAULTS / f"{name}.py").read_text() + f"\n# soak {i}\n"))
            expected.append(SOAK_FAULTS[name])
        else:
            jobs.append((REFERENCE, f"{LEGIT}\n# soak {i}\n"))
            expected.append("pass")
    client.batch_size = 40  # the test server caps bodies at 300 kB
    started = time.monotonic()
    results = client.evaluate_many(jobs)
    print(f"\nfault soak: 200 candidates ({len(names)} fault kinds) in {time.monotonic() - started:.1f} s on 2 workers")
    assert [r.key for r in results] == [eval_key(ref, cand, PROTOCOL, "cpu") for ref, cand in jobs]
    wrong = [(i, r.status, r.diagnostic[:200]) for i, (r, e) in enumerate(zip(results, expected)) if r.status != e]
    assert not wrong, wrong[:5]
    health = client.health()
    assert health["status"] == "ok" and health["workers_alive"] == 2 and health["pending"] == 0


def test_every_endpoint_refuses_and_logs_a_request_without_the_token(caplog: pytest.LogCaptureFixture) -> None:
    """A run's service answers only its jobs (issue 52, class 1): no endpoint, health included,
    answers a client that does not send the per-run token, and each refusal leaves a warning that
    names the request and why, never the token it was given."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    idle_pool = SimpleNamespace(workers=lambda: [], pending=lambda: 0, device_kind="cpu", protocol=PROTOCOL, reuse_reference=False)
    app = create_app(idle_pool, token=TOKEN)  # type: ignore[arg-type]
    requests = [("GET", "/v1/health", None), ("GET", "/v1/workers", None), ("GET", "/v1/batches/1", None),
                ("GET", f"/v1/results/{'0' * 64}", None), ("POST", "/v1/batches", {"jobs": []}),
                ("POST", "/v1/evaluate", {"reference_src": REFERENCE, "candidate_src": LEGIT})]
    with TestClient(app) as http, caplog.at_level("WARNING", logger="kpipe.gym.serve.service"):
        for method, path, body in requests:
            for headers, why in (({}, "no bearer token"), ({"Authorization": "Bearer guessed-token"}, "a wrong bearer token"),
                                 ({"Authorization": TOKEN}, "no bearer token")):
                caplog.clear()
                answer = http.request(method, path, json=body, headers=headers)
                assert answer.status_code == 401, (method, path, headers, answer.text)
                refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
                assert refusals == [f"KernelGym service refused {method} {path} from testclient: {why}"], (method, path, headers)
                assert "guessed-token" not in caplog.text
        assert http.get("/v1/health", headers={"Authorization": f"Bearer {TOKEN}"}).json()["status"] == "ok"
