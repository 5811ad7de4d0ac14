"""Reruns of the stages that resume, in real Snakemake runs of a small DAG (one distillation shard,
40 SFT steps, one RL iteration of three steps, one-sample evaluations): a rerun never hands back
stale work. A code change to SFT retrains, `--forcerun sft` trains again from step 0, an edited
offline teacher answers again, and Ctrl-C during `rl_iter` followed by the same command resumes the
iteration (README, "Reruns")."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kpipe.data.io import read_table
from test_workflow_gym_service import as_a_terminal_job, wait_for

pytestmark = pytest.mark.slow

SMALL = {
    "distill": {"shards": 1, "samples": 1, "turns": 1},
    "sft": {"max_steps": 40, "save_every": 10},
    "rl": {"iterations": 1, "steps_per_iteration": 3, "prompts_per_step": 1, "rollouts_per_prompt": 2,
           "validation": {"every": 0}},
    "eval": {"samples": 1, "turns": 1},
}
SFT_MODEL = "results/models/sft-default"
RL_MODEL = "results/models/rl-default/default/iter=0"
RL_SCRATCH = "results/work/rl-default/default/iter=0/scratch"
TEACHER_EVAL = "results/trajectories/stage=eval/run=default/model=teacher/level=1/part-0.parquet"
WAIT_S = 600.0  # a bound on waiting for a file, so a broken run fails instead of hanging


def command(target: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", target, "--cores", "2", "--configfile", "config/small.yaml", *args]


def snakemake(workdir: Path, target: str, *args: str, env: dict | None = None) -> str:
    result = subprocess.run(command(target, *args), cwd=workdir, capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def edited_kpipe(tmp_path: Path, module: str, addition: str) -> Path:
    """A copy of kpipe with `addition` appended to `module`: a folder for PYTHONPATH, so a run's
    processes import the edited code (and the rules' code params hash it)."""
    edited = tmp_path / "src"
    shutil.copytree(Path(__import__("kpipe").__file__).parent, edited / "kpipe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = edited / "kpipe" / module
    path.write_text(path.read_text() + "\n\n" + addition)
    return edited


def weights(workdir: Path) -> bytes:
    return (workdir / SFT_MODEL / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def workdir(workflow_copy: Path) -> Path:
    """The small DAG's copy, run up to the SFT model."""
    (workflow_copy / "config" / "small.yaml").write_text(yaml.safe_dump(SMALL))
    snakemake(workflow_copy, SFT_MODEL)
    return workflow_copy


def test_forcerun_sft_trains_again_from_step_zero(workdir):
    """A finished SFT run leaves no checkpoint in results/work, so a forced rerun trains every step
    (it used to "resume" at the final checkpoint and hand back the old model in seconds)."""
    output = snakemake(workdir, SFT_MODEL, "--forcerun", "sft")
    assert "rule sft:" in output
    summary = json.loads((workdir / "results" / "reports" / "sft-default.json").read_text())
    assert summary["resumed_from"] is None and summary["steps"] == 40
    log = (workdir / "logs" / "sft-default.log").read_text()
    assert "no unfinished checkpoint in results/work/sft-default/checkpoints: training from step 0" in log
    steps = read_table(workdir / "results" / "train_metrics" / "stage=sft" / "run=default" / "part-0.parquet",
                       "train_metrics").to_pydict()
    assert sorted({step for step, name in zip(steps["step"], steps["name"]) if name == "loss"}) == list(range(1, 41))
    assert not list((workdir / "results" / "work" / "sft-default" / "checkpoints").iterdir())


def test_a_code_change_to_sft_retrains_and_the_model_differs(workdir, tmp_path):
    """An edit of kpipe's SFT code (here: the learning rate set to 0, in a copy of kpipe that the run
    imports) reruns sft, which trains a new model instead of resuming the old one."""
    before = weights(workdir)
    edited = edited_kpipe(tmp_path, "train/sft.py", "def lr_factor(*args, **kwargs) -> float:  # the edit: no learning\n"
                                                    "    return 0.0\n")
    output = snakemake(workdir, SFT_MODEL, env={"PYTHONPATH": str(edited)})
    assert "rule sft:" in output
    assert weights(workdir) != before
    summary = json.loads((workdir / "results" / "reports" / "sft-default.json").read_text())
    assert summary["resumed_from"] is None
    snakemake(workdir, SFT_MODEL)  # the code as it is: trains again, the model as before
    assert weights(workdir) == before


def test_an_edited_offline_teacher_answers_again(workdir, tmp_path):
    """The offline teacher's answers are cached per job (results/cache/); after an edit of the
    teacher's code the rerun gets the edited teacher's answers, not the cached ones."""
    snakemake(workdir, TEACHER_EVAL)
    edited = edited_kpipe(tmp_path, "llm/teacher.py", "_answer_text = Teacher.answer_text\n"
                          "Teacher.answer_text = lambda self, request, rng: _answer_text(self, request, rng) + '\\n# edited'\n")
    output = snakemake(workdir, TEACHER_EVAL, env={"PYTHONPATH": str(edited)})
    assert "rule eval:" in output
    rows = read_table(workdir / TEACHER_EVAL, "trajectories").to_pylist()
    assert rows and all(row["response"].endswith("# edited") for row in rows)


def test_ctrl_c_during_rl_iter_then_the_same_command_resumes_it(workdir):
    """Ctrl-C once the iteration's first step is checkpointed; the same command then resumes the
    iteration at that step (the default profile's rerun-incomplete: no IncompleteFilesException), and
    its rows hold every step once."""
    shutil.rmtree(workdir / RL_SCRATCH, ignore_errors=True)
    args = command(RL_MODEL, "--forcerun", "rl_iter")
    process = subprocess.Popen(args, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, preexec_fn=as_a_terminal_job)
    wait_for(lambda: list((workdir / RL_SCRATCH / "checkpoints").glob("step-*")), "the first step's checkpoint", WAIT_S)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: snakemake and its jobs
    output, _ = process.communicate(timeout=WAIT_S)
    assert process.returncode != 0, output[-4000:]
    assert (workdir / RL_SCRATCH / "restart_key.json").exists()

    rerun = subprocess.run(command(RL_MODEL), cwd=workdir, capture_output=True, text=True)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    log = (workdir / "logs" / "rl-default" / "default" / "iter=0.log").read_text()
    resumed = re.search(r"resuming RL iteration 0 of default at step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 1, log[-3000:]
    rows = read_table(workdir / "results" / "trajectories" / "stage=rl" / "rl-default" / "run=default" / "iter=0" / "part-0.parquet",
                      "trajectories")
    assert rows.num_rows == 3 * 1 * 2  # steps x prompts x rollouts, one turn each
    metrics = read_table(workdir / "results" / "train_metrics" / "stage=rl" / "rl-default" / "run=default" / "iter=0" / "part-0.parquet",
                         "train_metrics").to_pydict()
    assert sorted(step for step, name in zip(metrics["step"], metrics["name"]) if name == "reward_mean") == [1, 2, 3]
    assert not (workdir / RL_SCRATCH).exists()
