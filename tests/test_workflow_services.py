"""The run's services (kpipe.workflow.services), which the Snakefile starts in `onstart` and stops in
`onsuccess`/`onerror`: which services a config asks for, how the jobs find them, and that stopping
ends what the run started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kpipe.gym.serve import run_service
from kpipe.infra.process import process_start
from kpipe.workflow.services import RunServices, ServiceError, check_devices


def config(service: str = "auto", backend: str = "pool", device: str = "auto") -> dict:
    return {"device": device, "gym": {"service": service, "backend": backend}}


@pytest.mark.parametrize(("settings", "runs_here", "shared"), [
    (config(), True, True),
    (config(), False, False),  # a cluster's jobs run elsewhere: each evaluates in its own pool
    (config(service="off"), True, False),
    (config(backend="local"), True, False),
])
def test_the_shared_kernelgym_service_is_what_the_config_and_machine_ask_for(tmp_path, settings, runs_here, shared):
    assert RunServices.of_run(settings, tmp_path, ["GPU-0"], runs_here).shared_gym is shared


def test_started_services_are_found_by_the_jobs_and_stopping_ends_them(tmp_path, monkeypatch):
    monkeypatch.delenv(run_service.RUN_ENV, raising=False)
    services = RunServices.of_run(config(), tmp_path / ".gym", ["GPU-0", "GPU-1"], runs_here=True)
    services.start()
    run = run_service.workflow_run()
    assert run is not None and (run.directory, run.gpus, run.owner) == ((tmp_path / ".gym").resolve(),
                                                                       ("GPU-0", "GPU-1"), os.getpid())
    # a service the run's first evaluating job started (its record names this process as the owner)
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / ".gym").mkdir()
        run_service.write_record(tmp_path / ".gym" / "service-x.json", {
            "pid": service.pid, "started": process_start(service.pid), "owner": os.getpid(),
            "host": socket.gethostname()})
        assert services.stop() == [service.pid]
        assert service.wait(timeout=30) is not None and run_service.workflow_run() is None
        assert not (tmp_path / ".gym" / "service-x.json").exists()
    finally:
        if service.poll() is None:
            service.kill()


def test_a_run_without_a_shared_service_tells_its_jobs_none(tmp_path, monkeypatch):
    monkeypatch.setenv(run_service.RUN_ENV, '{"stale": true}')
    RunServices.of_run(config(service="off"), tmp_path, [], runs_here=True).start()
    assert run_service.RUN_ENV not in os.environ


def test_a_cuda_run_on_a_machine_without_a_gpu_stops_before_any_job():
    with pytest.raises(ServiceError, match="device: cuda"):
        check_devices(config(device="cuda"), [], runs_here=True)
    check_devices(config(device="cuda"), [], runs_here=False)  # a login node: the executor places the jobs
    check_devices(config(device="cuda"), ["GPU-0"], runs_here=True)
