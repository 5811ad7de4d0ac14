"""The OpenAI-compatible engine against `kpipe serve`'s app with injected faults."""

import random

import httpx
import pytest

from kpipe.llm import make_engine
from kpipe.llm.openai_engine import OpenAIConfig, OpenAIEngine, Price, backoff_delay
from kpipe.llm.server import BackgroundServer, FaultConfig, make_app
from kpipe.llm.types import FINISH_ERROR, ChatRequest, Completion


class Echo:
    """Answers with the last user message, deterministic."""

    def respond(self, request: ChatRequest) -> Completion:
        text = f"echo: {request.messages[-1]['content']}"
        return Completion(text, "stop", prompt_tokens=7, completion_tokens=3)


def requests(n: int) -> list[ChatRequest]:
    return [ChatRequest([{"role": "user", "content": f"q{i}"}], max_tokens=64, seed=i) for i in range(n)]


def engine_for(server: BackgroundServer, **overrides) -> OpenAIEngine:
    settings = dict(model="echo", base_url=server.base_url, api_key_env=None, concurrency=4, max_retries=8,
                    timeout_s=5.0, backoff_base_s=0.01, backoff_max_s=0.05, progress=False)
    settings.update(overrides)
    return OpenAIEngine(OpenAIConfig(**settings))


def stats(server: BackgroundServer) -> dict:
    return httpx.get(server.base_url.removesuffix("/v1") + "/stats").json()


def test_answers_in_order_with_token_and_cost_accounting():
    with BackgroundServer(make_app(Echo(), "echo")) as server:
        engine = engine_for(server, prices={"echo": Price(input_per_m=1e6, output_per_m=2e6)})
        seen = []
        out = engine.generate(requests(6), on_result=lambda i, c: seen.append(i))
    assert [c.text for c in out] == [f"echo: q{i}" for i in range(6)]
    assert sorted(seen) == list(range(6))
    assert engine.usage.requests == 6 and engine.usage.prompt_tokens == 42 and engine.usage.completion_tokens == 18
    assert out[0].cost_usd == pytest.approx(7 * 1.0 + 3 * 2.0)


def test_requests_log_no_line_at_info(caplog):
    """The transport's "HTTP Request: POST ..." line per request stays out of the job's console."""
    import logging

    with caplog.at_level(logging.INFO), BackgroundServer(make_app(Echo(), "echo")) as server:
        engine_for(server).generate(requests(2))
    assert not [record for record in caplog.records if "HTTP Request" in record.getMessage()]


def test_retries_through_429_500_and_timeouts():
    # a delay far past the client's timeout, and a timeout far past an ordinary answer's time, both on a
    # loaded 2-core CI machine: with a delay of 1.0 s against a timeout of 0.4, a client whose event loop
    # stalled 0.6 s found the delayed answer already there and took it (30 faults, 27 retries); with 3.0
    # against 0.4, an ordinary answer once took longer than 0.4 s and cost a retry of its own (38 faults,
    # 39 retries, a fresh-clone .ci/run of c24678b)
    faults = FaultConfig(rate_429=0.3, rate_500=0.2, rate_delay=0.1, delay_s=4.0, seed=3)
    with BackgroundServer(make_app(Echo(), "echo", faults)) as server:
        engine = engine_for(server, timeout_s=1.5)
        out = engine.generate(requests(20))
        seen = stats(server)
    assert [c.text for c in out] == [f"echo: q{i}" for i in range(20)]  # nothing lost, nothing swapped
    assert not any(c.failed for c in out)
    injected = sum(seen["faults"].values())
    assert injected > 0 and engine.usage.retries == injected  # every fault cost exactly one retry
    assert seen["faults"].get("delay", 0) > 0


def test_gives_up_after_max_retries_with_a_recorded_error():
    with BackgroundServer(make_app(Echo(), "echo", FaultConfig(rate_429=1.0))) as server:
        out = engine_for(server, max_retries=2).generate(requests(2))
        assert stats(server)["requests"] == 2 * 3
    assert all(c.finish_reason == FINISH_ERROR and c.attempts == 3 for c in out)
    assert "RateLimitError" in out[0].error


def test_client_errors_are_not_retried():
    bad = [ChatRequest([], max_tokens=8)]  # the server rejects empty messages with 400
    with BackgroundServer(make_app(Echo(), "echo")) as server:
        out = engine_for(server).generate(bad)
        assert stats(server)["requests"] == 0  # refused before it was counted
    assert out[0].failed and out[0].attempts == 1 and "BadRequestError" in out[0].error


def test_truncated_and_codeless_answers_come_back_as_answers():
    faults = FaultConfig(rate_truncate=0.5, rate_codeless=0.5, seed=1)
    with BackgroundServer(make_app(Echo(), "echo", faults)) as server:
        out = engine_for(server).generate(requests(10))
    reasons = {c.finish_reason for c in out}
    assert reasons <= {"length", "stop"} and "length" in reasons
    assert any("echo" not in c.text for c in out if c.finish_reason == "stop")


def test_api_key_comes_from_the_named_variable_and_is_never_shown(monkeypatch):
    monkeypatch.delenv("KPIPE_TEST_KEY", raising=False)
    with pytest.raises(RuntimeError, match="KPIPE_TEST_KEY is not set"):
        OpenAIEngine(OpenAIConfig(model="m", api_key_env="KPIPE_TEST_KEY"))
    monkeypatch.setenv("KPIPE_TEST_KEY", "sk-very-secret")
    engine = make_engine({"kind": "openai", "model": "m", "api_key_env": "KPIPE_TEST_KEY",
                          "prices": {"m": {"input_per_m": 1, "output_per_m": 2}}})
    assert "sk-very-secret" not in repr(engine) and "sk-very-secret" not in repr(engine.config)


def test_backoff_grows_and_is_capped():
    rng = random.Random(0)
    draws = [max(backoff_delay(a, 1.0, 8.0, rng) for _ in range(200)) for a in range(6)]
    assert draws[0] <= 1.0 and draws[2] <= 4.0 and draws[2] > 2.0
    assert all(d <= 8.0 for d in draws)


def test_fault_spec_parsing():
    assert FaultConfig.parse("429=0.1, 500=0.2").rate_500 == 0.2
    with pytest.raises(ValueError, match="unknown fault"):
        FaultConfig.parse("503=0.1")
    with pytest.raises(ValueError, match="sum"):
        FaultConfig.parse("429=0.8,500=0.5")


def test_a_jobs_server_dies_with_the_job_even_when_the_job_is_killed(tmp_path):
    """`serving_in_subprocess` (the offline teacher of distillation and evaluation): a job killed where it cannot clean
    up (SIGKILL; Ctrl-C under load left one) takes its server with it, so no orphan holds the run's output pipe."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from kpipe.infra.process import process_start

    job = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom kpipe.llm.server import served_in_subprocess\n"
        "with served_in_subprocess(['teacher']) as url:\n    print(url, flush=True)\n    time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert job.stdout.readline().startswith("http://")

        def children() -> list[int]:
            found = []
            for entry in os.scandir("/proc"):
                try:
                    if entry.name.isdigit() and open(f"/proc/{entry.name}/stat").read().rsplit(")", 1)[1].split()[1] == str(job.pid):
                        found.append(int(entry.name))
                except (OSError, IndexError):
                    pass
            return found

        (server,) = children()
        assert b"serve" in open(f"/proc/{server}/cmdline", "rb").read()
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.monotonic() + 30
        while process_start(server) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_start(server) is None, "the job's server outlived the job"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
