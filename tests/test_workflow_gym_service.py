"""The run's KernelGym service (kpipe.gym.serve.run_service) in real Snakemake runs of the default DAG's
smallest evaluating jobs: the teacher's evaluation of one task per level, one sample, one turn.

Started once per run by the first job that evaluates, used by every evaluating job, stopped when
the run succeeds, fails, or is interrupted (Ctrl-C); a killed job leaks no process; a record left
by a dead run is never used. Every process of a run carries a marker in its environment, so a
leaked one is found whatever its parent became."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from kpipe.gym import Protocol
from kpipe.gym.serve.run_service import service_settings, settings_digest, write_record
from kpipe.infra.process import process_start
from kpipe.gym.confine.sandbox import opted_out

pytestmark = pytest.mark.slow

TARGETS = [f"results/trajectories/stage=eval/run=default/model=teacher/level={level}/part-0.parquet" for level in (1, 2)]
SMALL = {"eval": {"models": ["teacher"], "samples": 1, "turns": 1}}
# a run still evaluating for a while after its service answers, for a signal to land in: with one
# sample and one turn the jobs finished 4 s after it, once before Ctrl-C took effect on a loaded machine
LONGER = {"eval": {"models": ["teacher"], "samples": 2, "turns": 3}}
WAIT_S = 300.0  # a bound on waiting for a process or file, so a broken run fails instead of hanging
MARK = "KPIPE_TEST_GYM_RUN"


@pytest.fixture(scope="module")
def workdir(workflow_copy: Path) -> Path:
    (workflow_copy / "config" / "small.yaml").write_text(yaml.safe_dump(SMALL))
    (workflow_copy / "config" / "longer.yaml").write_text(yaml.safe_dump(LONGER))
    return workflow_copy


def start(workdir: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """snakemake on the targets in its own session (as a terminal's foreground job), with a marker."""
    mark = uuid.uuid4().hex
    process = subprocess.Popen([sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", "--configfile",
                                "config/small.yaml", "--forcerun", "eval", *args], cwd=workdir, env={**os.environ, MARK: mark},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=as_a_terminal_job)
    return process, mark


def as_a_terminal_job() -> None:
    """SIGINT delivered and fatal by default, as in a terminal's foreground job, whatever this test
    process inherited: started in the background by a non-interactive shell (nohup ... &), pytest
    and everything it starts ignore SIGINT (Python keeps an ignored SIGINT ignored), and so did
    snakemake and its jobs, which then ran a Ctrl-C'd run to a successful end (exit 0)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(process: subprocess.Popen) -> str:
    output, _ = process.communicate(timeout=WAIT_S * 2)
    return output


def marked(mark: str) -> list[int]:
    """Every live process of the run with marker `mark`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and process_start(int(entry.name)) is not None:
            try:
                if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def wait_for(condition, what: str, timeout_s: float = WAIT_S):
    """`condition()`'s first truthy value, polled; fails (never hangs) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.2)
    return value


def service_starts(workdir: Path) -> dict[str, int]:
    """Service log -> how many services it records starting (one line each, appended per start)."""
    return {path.name: path.read_text().count("KernelGym on http") for path in (workdir / "results" / ".gym").glob("service-*.log")}


def clear_service_logs(workdir: Path) -> None:
    for path in (workdir / "results" / ".gym").glob("service-*.log"):
        path.unlink()


def logged_service_pids(workdir: Path) -> list[set[int]]:
    """Per evaluation job (level 1, level 2): the service pids its log says it evaluated on."""
    logs = [(workdir / "logs" / "eval" / "run=default" / f"teacher-L{level}-0.log") for level in (1, 2)]
    return [{int(pid) for pid in re.findall(r"evaluating on the run's KernelGym service \S+ \(pid (\d+)\)", path.read_text())}
            if path.exists() else set() for path in logs]


def service_pids(workdir: Path) -> set[int]:
    """The service pids the jobs of the last run evaluated on (their logs)."""
    return set().union(*logged_service_pids(workdir))


def forget_results(workdir: Path) -> None:
    """Empty the result cache, so the run's evaluations take real seconds: with the earlier tests'
    results cached, a run could finish between the service answering and the signal sent to it."""
    for path in (workdir / "results" / "gym").glob("cache.sqlite*"):
        path.unlink()


def evaluating(workdir: Path) -> int | None:
    """The pid of the run's service once every job of this run has logged that it evaluates on it
    (so the run is in the middle of its jobs, none still to be started)."""
    for path in records(workdir):
        pid = json.loads(path.read_text())["pid"]
        if all(pid in pids for pids in logged_service_pids(workdir)):
            return pid
    return None


def records(workdir: Path) -> list[Path]:
    return list((workdir / "results" / ".gym").glob("service-*.json"))


def eval_settings(workdir: Path) -> dict:
    """What the teacher's evaluation jobs ask of the service (the default config's gym section)."""
    gym = yaml.safe_load((workdir / "config" / "config.yaml").read_text())["gym"]
    return service_settings(Protocol.from_dict(gym["protocol"]), True, workdir / "results" / "gym" / "cache.sqlite",
                            None, opted_out())


def test_one_service_serves_the_run_and_stops_on_success(workdir):
    settings = eval_settings(workdir)
    gym_dir = workdir / "results" / ".gym"
    gym_dir.mkdir(parents=True, exist_ok=True)
    # a record a dead run left: its owner is gone, its address answers nothing
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_record(gym_dir / f"service-{settings_digest(settings)}.json",
                 {"url": "http://127.0.0.1:9", "pid": os.getpid(), "started": process_start(os.getpid()), "owner": dead.pid,
                  "host": os.uname().nodename, "token": "", "settings": settings})
    clear_service_logs(workdir)
    process, mark = start(workdir)
    output = finish(process)
    assert process.returncode == 0, output[-4000:]
    assert list(service_starts(workdir).values()) == [1], output[-4000:]  # one service, started once
    pids = service_pids(workdir)
    assert len(pids) == 1  # both jobs evaluated on it
    assert "not used: left by another run" in output
    assert records(workdir) == []  # onsuccess stopped it
    wait_for(lambda: not marked(mark), "the run's processes to end")
    assert all(process_start(pid) is None for pid in pids)


def test_ctrl_c_stops_the_service(workdir):
    clear_service_logs(workdir)
    forget_results(workdir)
    process, mark = start(workdir, "--configfile", "config/longer.yaml")
    wait_for(lambda: evaluating(workdir), "every job to evaluate on the run's service")
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: snakemake and its jobs
    output = finish(process)
    assert process.returncode != 0, output[-4000:]
    wait_for(lambda: not marked(mark), "the run's processes (the service among them) to end")
    assert records(workdir) == []


def test_a_killed_job_fails_the_run_leaks_nothing_and_the_service_stops(workdir):
    clear_service_logs(workdir)
    forget_results(workdir)
    process, mark = start(workdir, "--configfile", "config/longer.yaml")
    record = json.loads(wait_for(lambda: records(workdir), "the service to answer")[0].read_text())
    jobs = wait_for(lambda: [pid for pid in marked(mark) if b"eval.py" in Path(f"/proc/{pid}/cmdline").read_bytes()],
                    "an evaluation job")
    os.kill(jobs[0], signal.SIGKILL)
    output = finish(process)
    assert process.returncode != 0, output[-4000:]
    assert "Error in rule eval" in output
    wait_for(lambda: not marked(mark), "the run's processes to end")
    assert process_start(record["pid"]) is None
    assert records(workdir) == []
    assert list(service_starts(workdir).values()) == [1]


def test_off_runs_a_pool_per_job(workdir):
    clear_service_logs(workdir)
    process, mark = start(workdir, "--config", 'gym={"service": "job"}')
    output = finish(process)
    assert process.returncode == 0, output[-4000:]
    assert service_starts(workdir) == {} and service_pids(workdir) == set()
    wait_for(lambda: not marked(mark), "the run's processes to end")


def most_at_once(output: str, rule: str) -> int:
    """The most jobs of `rule` running at once, from the order of snakemake's start and finish lines."""
    running = most = 0
    current = None
    for line in output.splitlines():
        if match := re.match(r"^(?:local)?rule (\w+):", line):
            current = match.group(1)
            running += current == rule
            most = max(most, running)
        elif match := re.match(rf"^Finished jobid: \d+ \(Rule: {rule}\)", line):
            running -= 1
    return most


@pytest.mark.parametrize(("service", "slots", "at_once"), [("auto", 1, 2), ("job", 4, 1)])
def test_small_jobs_share_a_gpu_and_a_whole_gpu_job_takes_all_its_slots(workdir, tmp_path, service, slots, at_once):
    """On one (pretended) GPU of 4 slots, the teacher's two evaluation jobs take one slot each and run
    at once; with a pool of each job's own (gym.service: job) they time kernels on it, so each takes
    the whole GPU and they run one after the other."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "KPIPE_GPU_LOCK_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", "--configfile",
                             "config/small.yaml", "--forcerun", "eval", "--config", f'gym={{"service": "{service}"}}'],
                            cwd=workdir, env=env, capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert re.findall(r"resources: .*gpu_slots=(\d+)", output) == [str(slots)] * 2
    assert most_at_once(output, "eval") == at_once
    for level in (1, 2):
        log = (workdir / "logs" / "eval" / "run=default" / f"teacher-L{level}-0.log").read_text()
        assert f"rule eval: {slots} of 4 GPU slot(s) per GPU leased on ['0']" in log
