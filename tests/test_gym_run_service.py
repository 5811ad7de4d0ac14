"""kpipe.gym.serve.run_service: which service record a job may use (the lifecycle runs in real Snakemake
runs: tests/test_workflow_gym_service.py)."""

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kpipe.gym import Protocol
from kpipe.gym.serve.run_service import WorkflowRun, serve_command, service_settings, why_unusable, workflow_run
from kpipe.infra.process import process_start

SETTINGS = service_settings(Protocol.from_dict({"perf_trials": 5}), True, None, None, False)


@pytest.fixture
def health_server():
    """An HTTP server whose /v1/health reports `reported` (a stand-in for a service)."""
    reported = {"status": "ok", "protocol": SETTINGS["protocol"], "reuse_reference": True}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(reported).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", reported
    server.shutdown()


def record(url, **changes):
    """A record of a live service of this process's run (this process stands in for it)."""
    return {"url": url, "pid": os.getpid(), "started": process_start(os.getpid()), "owner": os.getpid(),
            "host": socket.gethostname(), "token": "", "settings": SETTINGS, **changes}


RUN = WorkflowRun(directory=None, owner=os.getpid(), gpus=(), host=socket.gethostname())


def test_a_live_service_of_this_run_with_the_jobs_settings_is_used(health_server):
    url, _ = health_server
    assert why_unusable(record(url), SETTINGS, RUN) is None


def test_a_record_of_another_run_or_a_gone_process_is_not_used(health_server):
    url, _ = health_server
    assert "another run" in why_unusable(record(url, owner=1), SETTINGS, RUN)
    assert "another run" in why_unusable(record(url, host="elsewhere"), SETTINGS, RUN)
    assert "is gone" in why_unusable(record(url, started=1), SETTINGS, RUN)  # the pid now names another process
    assert "no health answer" in why_unusable(record("http://127.0.0.1:9"), SETTINGS, RUN)


def test_a_service_of_other_settings_is_not_used(health_server):
    url, reported = health_server
    other = service_settings(Protocol.from_dict({"perf_trials": 6}), True, None, None, False)
    assert "other settings" in why_unusable(record(url), other, RUN)
    reported["protocol"] = other["protocol"]  # the record says one protocol, the service runs another
    assert "reports other settings" in why_unusable(record(url), SETTINGS, RUN)
    reported["protocol"], reported["reuse_reference"] = SETTINGS["protocol"], False
    assert "reports other settings" in why_unusable(record(url), SETTINGS, RUN)


def test_outside_a_workflow_run_there_is_no_run_service():
    assert workflow_run({}) is None


def test_workers_per_gpu_reach_the_service_and_tell_services_apart(tmp_path):
    four = service_settings(Protocol.from_dict({"perf_trials": 5}), True, None, None, False, per_gpu=4)
    run = WorkflowRun(directory=tmp_path, owner=os.getpid(), gpus=("0",), host=socket.gethostname())
    command = serve_command(run, four, tmp_path / "record.json")
    assert command[command.index("--per-gpu") + 1] == "4"
    assert "--per-gpu" not in serve_command(run, SETTINGS, tmp_path / "record.json")
    assert "other settings" in why_unusable(record("http://127.0.0.1:9"), four, RUN)
