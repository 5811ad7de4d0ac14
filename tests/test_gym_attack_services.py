"""Hostile candidates that go after the run's own services (issue 52, class 1): they read the
run's variables from their environment, read the run's KernelGym record and connect to its
service, connect to a pathname and an abstract UNIX socket listening outside their sandbox, and
signal a process outside it. Each runs for real through ``kpipe gym eval`` (a fresh interpreter per
child) and ``kpipe gym eval-batch`` (the pool's zygote), with an honest kernel after every attack.

Every attack is an honest ReLU kernel that answers NaN once it got hold of anything: a thwarted
attack therefore passes (its code ran and reached nothing), one that succeeds fails, and the test
also asks the outside: no listener accepted a connection and the outside process still runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gym_attack_runs import DEVICE, LEGIT, evaluate_each_then_honest, evaluate_fresh

PROTOCOL = {"correct_trials": 2, "perf_trials": 3, "warmup": 0, "baseline": "eager", "timeout_s": 120, "reject_findings": [],
            "device": DEVICE}
RUN_TOKEN = "run-token-that-no-candidate-may-read"
# what a run's job holds (kpipe.gym.serve.run_service, Slurm, Snakemake) and a candidate must not
RUN_VARIABLES = {"KPIPE_GYM_RUN": "{run}", "KPIPE_GYM_TOKEN": RUN_TOKEN, "KPIPE_WARM_START": "kpipe-warm-start-test",
                 "KPIPE_WARM_START_TOKEN": RUN_TOKEN, "SLURM_JOB_ID": "4242", "SNAKEMAKE_PROFILE": "cluster",
                 "OPENAI_API_KEY": RUN_TOKEN}

# each attack sets REACHED to what it got hold of; the shared ending answers NaN when that is anything
ENDING = '''
_honest_forward = ModelNew.forward


def _forward(self, x):
    return torch.full_like(x, float("nan")) if REACHED else _honest_forward(self, x)


ModelNew.forward = _forward
'''
ATTACKS = {
    "reads_the_runs_environment": '''
import os
REACHED = [name for name in os.environ if name.startswith(("KPIPE_", "SLURM_", "SNAKEMAKE")) or "TOKEN" in name or "KEY" in name]
REACHED += [name for name, value in os.environ.items() if "{token}" in value]
''',
    "reads_the_runs_record_and_calls_its_service": '''
import glob, json, os, socket
REACHED = []
for path in glob.glob("{run}/service-*.json"):  # the record's place, named by $KPIPE_GYM_RUN in a job
    try:
        REACHED.append(json.load(open(path))["token"])
    except OSError:
        pass
try:  # the service's URL, as a job knows it
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as connection:
        connection.sendall(b"GET /v1/health HTTP/1.0\\r\\n\\r\\n")
        REACHED.append(connection.recv(100))
except OSError:
    pass
''',
    "connects_to_a_pathname_socket_outside": '''
import socket
REACHED = []
for path in ("{pathname}", "{elsewhere}"):  # in the temporary directory, and outside every directory the cover hides
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(2)
            client.connect(path)
            client.sendall(b"run: kpipe anything")
            REACHED.append(path)
    except OSError:
        pass
''',
    "connects_to_an_abstract_socket_outside": '''
import socket
REACHED = []
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(2)
        client.connect("\\0{abstract}")
        client.sendall(b"run: kpipe anything")
        REACHED.append("{abstract}")
except OSError:
    pass
''',
    "signals_processes_outside": '''
import os, signal
REACHED = []
targets = {{{outside}, os.getppid()}} | {{int(p) for p in os.listdir("/proc") if p.isdigit()}}
for pid in sorted(targets - {{0, 1, os.getpid()}}):  # its judge, a process named to it, whatever /proc shows
    try:
        os.kill(pid, signal.SIGTERM)
        REACHED.append(pid)
    except OSError:
        pass
''',
}


@dataclass
class Outside:
    """What listens and runs outside the candidates' sandboxes, and whether anything reached it."""

    run: Path
    pathname: socket.socket
    elsewhere: socket.socket
    abstract: socket.socket
    service: socket.socket
    process: subprocess.Popen[bytes]

    def formats(self) -> dict[str, object]:
        return {"run": self.run, "token": RUN_TOKEN, "port": self.service.getsockname()[1],
                "pathname": self.pathname.getsockname(), "elsewhere": self.elsewhere.getsockname(),
                "abstract": self.abstract.getsockname()[1:].decode(),
                "outside": self.process.pid}

    def reached(self) -> list[str]:
        """The listeners that accepted a connection, and the outside process if it ended."""
        reached = []
        for name, listener in (("pathname", self.pathname), ("elsewhere", self.elsewhere), ("abstract", self.abstract),
                               ("service", self.service)):
            try:
                listener.accept()[0].close()
                reached.append(name)
            except BlockingIOError:
                pass
        return reached + (["outside process"] if self.process.poll() is not None else [])


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Outside]:
    run = tmp_path / "gym"
    run.mkdir(mode=0o700)
    (run / "service-0.json").write_text(json.dumps({"url": "http://127.0.0.1:1", "token": RUN_TOKEN}))
    (run / "service-0.json").chmod(0o600)
    pathname = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pathname.bind(str(tmp_path / "run.sock"))
    # a socket outside the directories the sandbox covers with a tmpfs (kpipe.gym.confine.sandbox.SOCKET_DIRS)
    home = Path(tempfile.mkdtemp(prefix=".kpipe-sock-", dir=Path.home()))
    elsewhere = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    elsewhere.bind(str(home / "run.sock"))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0kpipe-test-{os.getpid()}-{tmp_path.name}")
    service = socket.create_server(("127.0.0.1", 0))
    for listener in (pathname, elsewhere, abstract, service):
        listener.listen()
        listener.setblocking(False)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        yield Outside(run, pathname, elsewhere, abstract, service, process)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
        for listener in (pathname, elsewhere, abstract, service):
            listener.close()
        shutil.rmtree(home)


def attack_sources(outside: Outside) -> dict[str, str]:
    return {name: LEGIT + source.format(**outside.formats()) + ENDING for name, source in ATTACKS.items()}


def run_environment(outside: Outside) -> dict[str, str]:
    """A job's environment: the run's variables beside the usual ones."""
    return {name: value.format(run=outside.run) for name, value in RUN_VARIABLES.items()}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_attack_on_the_runs_services_reaches_nothing_through_kpipe_gym_eval(name: str, outside: Outside, tmp_path: Path) -> None:
    result = evaluate_fresh(tmp_path, attack_sources(outside)[name], PROTOCOL, env=run_environment(outside))
    assert outside.reached() == [], f"{name} reached the outside"
    assert result["status"] == "pass", f"{name} got hold of something: {json.dumps(result, default=str)[:3000]}"
    assert RUN_TOKEN not in json.dumps(result, default=str)


def test_attacks_on_the_runs_services_reach_nothing_through_the_pool_and_each_next_honest_kernel_passes(
        outside: Outside, tmp_path: Path) -> None:
    judged = evaluate_each_then_honest(tmp_path, attack_sources(outside), PROTOCOL, env=run_environment(outside))
    assert outside.reached() == []
    for name, (attacked, honest) in judged.items():
        assert attacked["status"] == "pass", f"{name} got hold of something: {attacked['status']} {attacked['diagnostic']}"
        assert honest["status"] == "pass", f"the honest kernel after {name}: {honest['status']} {honest['diagnostic']}"
