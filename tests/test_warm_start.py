"""kpipe.infra.warm_start: a forked job is its Snakemake job (output, environment, directory, exit
status) and dies with it; the starter ends with its run; and nobody but the run's own jobs gets
anything from it (issue 52): an abstract socket out of another network namespace's reach, the
client's uid and the run's token checked, and only the jobs of its fixed table run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kpipe.infra import jobs, warm_start
from kpipe.infra.process import process_start

FIXTURES = Path(__file__).parent / "fixtures" / "warm_start"
JOBS = "kpipe_test_warm_jobs"  # tests/fixtures/warm_start: the test starter's table
PRELOAD = ("click", JOBS)  # the tests' starter imports little: what is forked is the same either way


def starter_pid() -> int:
    """The pid of this test's starter (a child of this process)."""
    for entry in Path("/proc").iterdir():
        with_args = entry / "cmdline"
        if entry.name.isdigit() and b"kpipe.infra.warm_start" in _read(with_args) and _parent(entry) == os.getpid():
            return int(entry.name)
    raise AssertionError("no warm starter runs")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _parent(entry: Path) -> int | None:
    stat = _read(entry / "stat").decode()
    return int(stat.rsplit(")", 1)[1].split()[1]) if ")" in stat else None


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process_start(pid) is None:
            return True
        time.sleep(0.05)
    return False


def wait_ready(directory: Path, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    log = directory / warm_start.LOG_NAME
    while "ready to fork" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "ready to fork" in log.read_text(), log.read_text()


@pytest.fixture
def test_jobs(monkeypatch):
    """The fixture jobs, importable here and by the starters the tests start."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")]))
    import kpipe_test_warm_jobs

    return kpipe_test_warm_jobs


@pytest.fixture
def starter(tmp_path, test_jobs):
    """The environment naming a ready starter of this process (its run)."""
    environ = warm_start.start(tmp_path / "run", os.getpid(), PRELOAD)
    wait_ready(tmp_path / "run")
    pid = starter_pid()
    yield environ
    warm_start.stop(environ)
    assert gone(pid), "the starter outlived its stop request"


def starter_log(tmp_path: Path) -> str:
    return (tmp_path / "run" / warm_start.LOG_NAME).read_text()


def fork(environ, job: str, args: list, kwargs: dict | None = None, log: Path | None = None) -> tuple[int | None, list[str]]:
    """fork_job's answer and what it told the job's log."""
    said: list[str] = []
    with open(log or os.devnull, "w") as out:
        code = warm_start.fork_job(job, args, kwargs or {}, out.fileno(), said.append, environ)
    return code, said


def test_a_forked_job_has_the_jobs_output_environment_directory_and_exit_status(starter, tmp_path, monkeypatch):
    monkeypatch.setenv("KPIPE_TEST_MARK", "from-the-job")
    monkeypatch.chdir(tmp_path)
    seen, log = tmp_path / "seen.json", tmp_path / "job.log"
    code, said = fork(starter, f"{JOBS}:report", [str(seen), [1, "a"]], {"code": 3}, log)
    assert (code, said) == (3, [])
    assert log.read_text() == "hello from the job\n"
    job = json.loads(seen.read_text())
    assert (job["values"], job["mark"], job["cwd"]) == ([1, "a"], "from-the-job", str(tmp_path))
    assert job["pid"] != os.getpid()
    assert f"job {JOBS}:report forked as pid {job['pid']}" in starter_log(tmp_path)


def test_a_job_whose_client_is_killed_is_killed_with_it(starter, tmp_path):
    """Snakemake cancelling a job kills its process (the client): the work must not go on."""
    pid_file = tmp_path / "work.pid"
    client = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from kpipe.infra import warm_start; "
        f"sys.exit(warm_start.fork_job('{JOBS}:sleep_forever', [{str(pid_file)!r}], {{}}, 1, print, os.environ))")],
        env={**os.environ, **starter})
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    work = int(pid_file.read_text())
    assert process_start(work) is not None
    client.send_signal(signal.SIGKILL)
    client.wait()
    assert gone(work), "the job's work outlived its killed Snakemake job"


def test_the_starter_ends_with_its_run_and_then_jobs_start_the_usual_way(tmp_path, test_jobs):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    environ = warm_start.start(tmp_path / "run", owner.pid, PRELOAD)
    wait_ready(tmp_path / "run")
    pid = starter_pid()
    owner.kill()
    owner.wait()
    assert gone(pid), "the starter outlived the run (its owner)"
    assert fork(environ, f"{JOBS}:report", [str(tmp_path / "seen.json"), []]) == (
        None, ["the run's warm starter is gone; the job runs in this process"])
    assert fork({}, f"{JOBS}:report", [str(tmp_path / "seen.json"), []]) == (None, [])  # warm starting off
    assert not (tmp_path / "seen.json").exists()


def test_a_job_that_starts_before_the_starter_is_done_importing_starts_the_usual_way(tmp_path, test_jobs, monkeypatch):
    """The starter answers while it imports: a job that starts with the run does not wait for it."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "kpipe_test_slow_module.py").write_text("import time\ntime.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ["PYTHONPATH"]]))
    environ = warm_start.start(tmp_path / "run", os.getpid(), ("kpipe_test_slow_module", JOBS))
    try:
        seen = tmp_path / "seen.json"
        assert fork(environ, f"{JOBS}:report", [str(seen), []]) == (
            None, ["the run's warm starter is still importing; the job runs in this process"])
        wait_ready(tmp_path / "run")
        assert fork(environ, f"{JOBS}:report", [str(seen), []]) == (0, [])
        assert json.loads(seen.read_text())["pid"] != os.getpid()
    finally:
        warm_start.stop(environ)


@pytest.mark.parametrize("token", [None, "", "wrong", "the right one but one"])
def test_a_client_without_the_runs_token_is_refused_and_nothing_runs(starter, tmp_path, token):
    made = tmp_path / "made.json"
    environ = dict(starter)
    if token is None:
        del environ[warm_start.TOKEN_ENV]
    else:
        environ[warm_start.TOKEN_ENV] = starter[warm_start.TOKEN_ENV][:-1] + "x" if token.startswith("the right") else token
    with pytest.raises(warm_start.Refused, match="no valid token"):
        fork(environ, f"{JOBS}:report", [str(made), []])
    assert not made.exists()
    assert "no valid token" in starter_log(tmp_path)
    warm_start.stop(environ)  # a stop without the token is refused too
    assert fork(starter, f"{JOBS}:report", [str(made), []]) == (0, [])


@pytest.mark.skipif(os.getuid() != 0, reason="a client of another user: root drops to it")
def test_a_client_of_another_user_is_refused_even_with_the_token(starter, tmp_path):
    made = tmp_path / "made.json"
    client = subprocess.run([sys.executable, "-c", (  # the protocol by hand: kpipe's client would not ask
        "import os, socket, sys; from kpipe.infra import warm_start\n"
        "os.setgid(65534)\n"
        "os.setuid(65534)\n"
        "conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "conn.connect('\\0' + os.environ[warm_start.WARM_START_ENV])\n"
        "warm_start.send_request(conn, {'token': os.environ[warm_start.TOKEN_ENV], 'job': sys.argv[1], "
        "'args': [sys.argv[2], []], 'kwargs': {}, 'env': {}, 'cwd': '/'}, [])\n"
        "print(conn.makefile().readline())\n"), f"{JOBS}:report", str(made)],
        env={**os.environ, **starter}, capture_output=True, text=True, timeout=120)
    # the starter refuses before reading the request: the client reads the refusal, or (a race) finds the
    # connection closed while it still sends; either way the starter's log names the refusal
    assert "uid 65534 is not the run's owner (uid 0)" in client.stdout or "BrokenPipeError" in client.stderr, \
        client.stdout + client.stderr
    assert "uid 65534 is not the run's owner (uid 0)" in starter_log(tmp_path)
    assert not made.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="a listener of another user: root drops to it")
def test_a_job_never_sends_the_token_to_a_socket_of_another_user():
    """A squatter on the run's socket name (another user's process) gets nothing and fails the job."""
    name = f"kpipe-test-squatter-{os.getpid()}"
    squatter = subprocess.Popen([sys.executable, "-c", (
        "import os, socket, sys\n"
        "os.setgid(65534)\n"
        "os.setuid(65534)\n"
        "listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "listener.bind('\\0' + sys.argv[1])\n"
        "listener.listen(1)\n"
        "print('listening', flush=True)\n"
        "conn, _ = listener.accept()\n"
        "conn.settimeout(10)\n"
        "data = b''\n"
        "try:\n"
        "    while chunk := conn.recv(4096):\n"
        "        data += chunk\n"
        "except OSError:\n"
        "    pass\n"
        "print(data.hex(), flush=True)\n"), name], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "listening"
        with pytest.raises(warm_start.Refused, match="belongs to uid 65534"):
            fork({warm_start.WARM_START_ENV: name, warm_start.TOKEN_ENV: "the-run-s-secret"}, f"{JOBS}:report", [])
        received = bytes.fromhex(squatter.communicate(timeout=60)[0].strip())
        assert b"the-run-s-secret" not in received
    finally:
        squatter.kill()


@pytest.mark.parametrize("job", ["os:system", "builtins:exec", f"{JOBS}:not_forkable", "kpipe.cli:main", None])
def test_a_client_asking_for_a_job_outside_the_table_is_refused_and_nothing_runs(starter, tmp_path, job):
    """Issue 52: `kpipe job MODULE:FUNCTION` ran any function, and a client's argv any command."""
    marker = tmp_path / "ran"
    if job is None:  # the old protocol: a command line of the client's
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(f"\0{starter[warm_start.WARM_START_ENV]}")
            warm_start.send_request(conn, {"token": starter[warm_start.TOKEN_ENV], "env": dict(os.environ),
                                           "cwd": str(tmp_path), "argv": ["gpu", "run", "-n", "0", "--", "touch", str(marker)]}, [])
            answer = json.loads(conn.makefile().readline())
        assert answer["status"] == "refused" and not answer["unauthenticated"]
    else:
        code, said = fork(starter, job, [f"touch {marker}"] if "not_forkable" not in job else [str(marker)])
        assert code is None and len(said) == 1 and "unknown job" in said[0] and "runs in this process" in said[0]
    assert not marker.exists()  # and never will: the starter answers `forked` for what it forks
    assert f"unknown job {job!r}" in starter_log(tmp_path)


@pytest.mark.parametrize("sent", [b"", b"\xff\xff\xff\xff", b"\x00\x00\x00\x05junk!", b"\x00\x00\x00\x04[[[[",
                                  b"\x00\x00\x00\x03[1]"])
def test_a_client_that_sends_junk_is_refused_and_the_starter_serves_on(starter, tmp_path, sent):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(f"\0{starter[warm_start.WARM_START_ENV]}")
        conn.sendall(sent)
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(4096) == b""  # no answer: closed
    assert "unreadable request" in starter_log(tmp_path)
    assert fork(starter, f"{JOBS}:report", [str(tmp_path / "seen.json"), []]) == (0, [])


def test_the_socket_is_abstract_and_the_token_is_on_no_disk_and_in_no_command_line(starter, tmp_path):
    name, token = starter[warm_start.WARM_START_ENV], starter[warm_start.TOKEN_ENV]
    assert len(name) > len("kpipe-warm-start-") + 30 and len(token) >= 64  # random per run
    assert not [path for path in (tmp_path / "run").rglob("*") if path.is_socket()]
    listed = Path("/proc/net/unix").read_text().split()
    assert f"@{name}" in listed  # abstract: in the kernel's namespace, no file
    pid = starter_pid()
    assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert token.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    assert not [path for path in (tmp_path / "run").rglob("*") if token in path.read_text(errors="replace")]


CONNECT = ("import socket, sys\n"
           "conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
           "try:\n"
           "    conn.connect('\\0' + sys.argv[1])\n"
           "    print('connected')\n"
           "except OSError as error:\n"
           "    print(type(error).__name__)\n")


def test_a_process_in_another_network_namespace_cannot_connect(starter):
    """A KernelGym candidate runs in a network namespace of its own: the socket is out of its reach."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode:
        pytest.skip("unshare -n is not allowed here")
    name = starter[warm_start.WARM_START_ENV]
    here = subprocess.run([sys.executable, "-c", CONNECT, name], capture_output=True, text=True, timeout=60)
    assert here.stdout.strip() == "connected", here.stderr
    elsewhere = subprocess.run(["unshare", "-n", sys.executable, "-c", CONNECT, name], capture_output=True, text=True,
                               timeout=60)
    assert elsewhere.stdout.strip() == "ConnectionRefusedError", elsewhere.stderr


def fake_snakemake_job(log: Path, gpu: int = 0) -> SimpleNamespace:
    return SimpleNamespace(log=[str(log)], resources=SimpleNamespace(gpu_slots=0, gpu=gpu),
                           config={"gpu": {"slots_per_gpu": 8}}, rule="eval", threads=1)


@pytest.fixture
def job_environment(monkeypatch):
    """What run_job sets in its process, restored after the test."""
    monkeypatch.setenv(jobs.JOB_STARTED, str(time.time()))
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")


def run_report(tmp_path: Path, name: str, monkeypatch, environ: dict[str, str]) -> tuple[dict, str]:
    """Run the `report` job through run_job under `environ` (the run's starter, or none); what it saw
    and its log."""
    from kpipe_test_warm_jobs import report

    for variable, value in environ.items():
        monkeypatch.setenv(variable, value)
    seen, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    with pytest.raises(SystemExit) as done:
        jobs.run_job(fake_snakemake_job(log), report, str(seen), (1, "a"), code=4)
    assert done.value.code == 4
    assert not {warm_start.WARM_START_ENV, warm_start.TOKEN_ENV} & set(os.environ)  # the job's, not its children's
    return json.loads(seen.read_text()), log.read_text()


def test_a_job_gives_the_same_outputs_forked_or_in_its_own_process(starter, tmp_path, monkeypatch, job_environment):
    """Warm starting is a backend: switched off (no starter), a job only starts later."""
    monkeypatch.chdir(tmp_path)
    forked, forked_log = run_report(tmp_path, "forked", monkeypatch, starter)
    here, here_log = run_report(tmp_path, "here", monkeypatch, {})
    assert forked["pid"] != os.getpid() and here["pid"] == os.getpid()
    assert forked.pop("pid") and here.pop("pid")
    assert forked == here == {"values": [1, "a"], "mark": None, "cwd": str(tmp_path), "starter_variables": []}
    for log in (forked_log, here_log):
        assert "rule eval: 0 of 8 GPU slot(s) per GPU leased on []" in log and "hello from the job" in log


def test_a_job_that_is_not_forkable_runs_in_its_own_process_beside_a_starter(starter, tmp_path, monkeypatch,
                                                                             job_environment, test_jobs):
    for variable, value in starter.items():
        monkeypatch.setenv(variable, value)
    before = starter_log(tmp_path)
    made = tmp_path / "made"
    jobs.run_job(fake_snakemake_job(tmp_path / "job.log"), test_jobs.not_forkable, made)  # any values: not forked
    assert made.read_text() == str(os.getpid())
    assert starter_log(tmp_path) == before  # never asked


def test_a_job_whose_token_the_starter_refuses_fails_and_its_log_says_why(starter, tmp_path, monkeypatch,
                                                                         job_environment, test_jobs):
    monkeypatch.setenv(warm_start.WARM_START_ENV, starter[warm_start.WARM_START_ENV])
    monkeypatch.setenv(warm_start.TOKEN_ENV, "forged")
    log = tmp_path / "job.log"
    with pytest.raises(warm_start.Refused):
        jobs.run_job(fake_snakemake_job(log), test_jobs.report, str(tmp_path / "seen.json"), [])
    assert "the run's warm starter refused this job: no valid token" in log.read_text()
    assert not (tmp_path / "seen.json").exists()


def test_a_forkable_job_takes_json_values_forked_or_not(tmp_path, monkeypatch, job_environment, test_jobs):
    monkeypatch.delenv(warm_start.WARM_START_ENV, raising=False)
    with pytest.raises(TypeError):
        jobs.run_job(fake_snakemake_job(tmp_path / "job.log"), test_jobs.report, tmp_path / "seen.json", [])


def test_a_launched_job_of_one_process_runs_its_command_here_or_forked(starter, tmp_path, monkeypatch, job_environment,
                                                                       test_jobs):
    """`sft` and `rl_iter` on a CPU or one GPU: ``kpipe <command>`` in one process, no launcher."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command takes this process's
    for environ, name in (({}, "here"), (starter, "forked")):
        for variable, value in environ.items():
            monkeypatch.setenv(variable, value)
        log = tmp_path / f"{name}.log"
        with pytest.raises(SystemExit) as done:
            jobs.run_job(fake_snakemake_job(log), test_jobs.help_of_train)
        assert done.value.code == 0
        assert "tiny-model" in log.read_text()  # `kpipe train --help`
    assert f"job {JOBS}:help_of_train forked" in starter_log(tmp_path)
