"""Contract test of the HTTP API against its own OpenAPI schema (schemathesis): whatever a
client sends, the service answers without a server error."""

from __future__ import annotations

import atexit
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from kpipe.gym import Protocol
from kpipe.gym.serve.pool import GymPool
from kpipe.gym.serve.service import create_app

PROTOCOL = Protocol(correct_trials=1, perf_trials=2, warmup=0, baseline="eager", device="cpu", timeout_s=20)


class LazyPool:
    """Starts the real pool on first use, so collecting this module starts no workers."""

    pool: GymPool | None = None

    def __getattr__(self, name: str) -> Any:
        if LazyPool.pool is None:
            LazyPool.pool = GymPool(PROTOCOL, workers=1, progress=False)
            atexit.register(LazyPool.pool.close)
        return getattr(LazyPool.pool, name)


schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(LazyPool(), max_request_bytes=1_000_000))  # type: ignore[arg-type]


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=[not_a_server_error])
