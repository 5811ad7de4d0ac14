"""The training rules' jobs: a rule's script calls its function with keyword settings (one hop, no argv),
and a job of several processes hands them over in one file that every process reads
(``kpipe launch --module kpipe.infra.jobs -- FILE``), its output in the rule's log."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kpipe.infra import jobs
from kpipe.infra.jobs import JOBS_MODULE, launched, run_job_file, write_job_file
from kpipe.infra.launch import launch_command
from kpipe.train.rl import rl_job
from kpipe.train.sft import sft_job

SCRIPTS = Path(__file__).resolve().parents[1] / "workflow" / "scripts"


@launched
def record_settings(*, out: str, values: dict) -> None:
    """A launched job for these tests: writes its settings where `out` says."""
    Path(out).write_text(json.dumps(values))


def not_launched(**settings) -> None:
    raise AssertionError("a settings file may name only a launched job")


def script_keywords(script: str) -> set[str]:
    """The keyword arguments a workflow script passes to its job through run_job."""
    tree = ast.parse((SCRIPTS / script).read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "run_job"]
    assert len(calls) == 1
    return {keyword.arg for keyword in calls[0].keywords}


@pytest.mark.parametrize(("script", "function"), [("rl_iter.py", rl_job), ("sft.py", sft_job)])
def test_a_training_script_passes_its_job_exactly_the_settings_it_takes(script, function):
    assert jobs.job_name(function) in jobs.LAUNCHED
    parameters = inspect.signature(function).parameters
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    assert script_keywords(script) == set(parameters)


def test_a_settings_file_calls_its_job_with_its_settings(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    path = write_job_file(tmp_path / "logs" / "job.job.json", record_settings, {"out": str(out), "values": {"a": [1]}})
    assert json.loads(path.read_text())["job"] == "test_train_jobs:record_settings"
    run_job_file(path)
    assert json.loads(out.read_text()) == {"a": [1]}
    with pytest.raises(ValueError, match="not a launched job"):
        run_job_file(write_job_file(tmp_path / "other.json", not_launched, {}))


def test_a_launched_job_takes_keyword_settings_only(tmp_path: Path) -> None:
    from types import SimpleNamespace

    smk = SimpleNamespace(threads=1, resources=SimpleNamespace(gpu=0, gpu_slots=0), log=[], rule="r",
                          config={"gpu": {"slots_per_gpu": 1}})
    with pytest.raises(TypeError, match="keyword arguments only"):
        jobs.run_job(smk, record_settings, str(tmp_path / "x"))


def test_a_job_of_several_processes_becomes_kpipe_launch_with_output_in_the_log(tmp_path: Path) -> None:
    assert launch_command(2, ["f.json"], module=JOBS_MODULE)[1:] == [
        "-m", "kpipe.cli", "launch", "--gpus", "2", "--module", JOBS_MODULE, "--", "f.json"]
    log, out = tmp_path / "logs" / "job.log", tmp_path / "seen.json"
    settings = write_job_file(log.with_suffix(".job.json"), record_settings, {"out": str(out), "values": {"b": 2}})
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from kpipe.infra.jobs import _become_launch\n"
            f"print('before', flush=True)\n_become_launch(0, [{str(settings)!r}], {str(log)!r}, (0, 1))\n")
    env_path = f"{Path(__file__).parent}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "PYTHONPATH": env_path})
    assert result.returncode == 0, result.stderr + log.read_text()
    assert result.stdout == "before\n"  # nothing after the exec reaches the old stdout
    assert json.loads(out.read_text()) == {"b": 2}  # python -m kpipe.infra.jobs FILE, run by `kpipe launch --gpus 0`
