"""kpipe.infra.launch: the rule's GPU count and SLURM's node variables become the accelerate command
line that accelerate's own parser reads back as intended (process count, FSDP, ranks)."""

from __future__ import annotations

import os
import time
import sys
from pathlib import Path

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from click.testing import CliRunner

from kpipe.infra.launch import (
    NodeInfo,
    accelerate_command,
    first_host,
    launch,
    launch_plan,
    node_info_from_env,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "workflow" / "accelerate"
TRAIN = ["logs/sft-default.job.json"]
SLURM_TWO_NODES = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]",
                   "SLURM_JOB_ID": "81234"}


def parsed(command: list[str]):
    """What `accelerate launch` itself makes of the command (config file merged in)."""
    assert command[1:3] == ["-m", "accelerate.commands.launch"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(command[3:]))
    return args


@pytest.mark.parametrize("nodelist, host", [("gpu[03-05,09],cpu1", "gpu03"), ("node7", "node7"),
                                            ("a-b[12-13]", "a-b12"), ("n1,n2", "n1")])
def test_first_host_of_a_slurm_nodelist(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_node_info_from_slurm_and_torchrun_variables() -> None:
    assert node_info_from_env(SLURM_TWO_NODES) == NodeInfo(nodes=2, rank=1, main_address="gpu03", main_port=29500 + 1234)
    overridden = node_info_from_env({**SLURM_TWO_NODES, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23456"})
    assert (overridden.main_address, overridden.main_port) == ("10.0.0.5", 23456)
    local = node_info_from_env({})
    assert (local.nodes, local.rank, local.main_address) == (1, 0, "127.0.0.1") and 1024 <= local.main_port < 65536
    with pytest.raises(ValueError, match="outside"):
        node_info_from_env({"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "2"})


def test_no_gpu_runs_plain_python() -> None:
    assert accelerate_command(0, TRAIN, config_dir=CONFIG_DIR) == [sys.executable, "-m", "kpipe.cli", *TRAIN]


def test_one_gpu_runs_plain_python_without_a_launcher() -> None:
    """One process needs no `accelerate launch` (it would import torch once more before the job's own)."""
    assert accelerate_command(1, TRAIN, config_dir=CONFIG_DIR) == [sys.executable, "-m", "kpipe.cli", *TRAIN]


def test_gpus_of_one_node_are_fsdp_processes() -> None:
    args = parsed(accelerate_command(4, TRAIN, NodeInfo(main_port=31000), config_dir=CONFIG_DIR))
    assert (args.num_processes, args.num_machines, args.use_fsdp, args.fsdp_version) == (4, 1, True, 2)
    assert (args.fsdp_auto_wrap_policy, args.main_process_port) == ("TRANSFORMER_BASED_WRAP", 31000)


def test_each_node_of_a_multi_node_job_gets_its_rank_and_the_shared_rendezvous() -> None:
    node = node_info_from_env(SLURM_TWO_NODES)
    args = parsed(accelerate_command(16, TRAIN, node, config_dir=CONFIG_DIR))
    assert (args.num_processes, args.num_machines, args.machine_rank) == (16, 2, 1)
    assert (args.main_process_ip, args.main_process_port, args.use_fsdp) == ("gpu03", 30734, True)


def test_uneven_gpu_split_is_refused() -> None:
    with pytest.raises(ValueError, match="evenly"):
        accelerate_command(3, TRAIN, NodeInfo(nodes=2), config_dir=CONFIG_DIR)


def test_first_node_fans_out_with_srun_and_node_tasks_launch_accelerate() -> None:
    jobs = "kpipe.infra.jobs"  # what a training rule's job launches: its settings file in every process
    fan_out = launch_plan(16, TRAIN, SLURM_TWO_NODES, node_task=False, config_dir=CONFIG_DIR, module=jobs)
    assert fan_out[:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    assert fan_out[-len(TRAIN) - 7:] == ["launch", "--gpus", "16", "--module", jobs, "--node-task", "--", *TRAIN]
    node = launch_plan(16, TRAIN, SLURM_TWO_NODES, node_task=True, config_dir=CONFIG_DIR, module=jobs)
    assert parsed(node).machine_rank == 1 and node[-3:] == ["-m", jobs, *TRAIN]


def test_cli_prints_and_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(SLURM_TWO_NODES) + ["MASTER_ADDR", "MASTER_PORT", "SLURM_NNODES", "SLURM_NODELIST"]:
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()
    printed = runner.invoke(launch, ["--gpus", "8", "--config-dir", str(CONFIG_DIR), "--print", "--", *TRAIN])
    assert printed.exit_code == 0, printed.output
    assert "fsdp_single_node.yaml --num_processes 8" in printed.output and printed.output.rstrip().endswith(" ".join(TRAIN))
    ran = runner.invoke(launch, ["--gpus", "0", "--", "query", "--help"])
    assert ran.exit_code == 0, ran.output
    refused = runner.invoke(launch, ["--gpus", "3", "--print", "--", *TRAIN], env={"SLURM_JOB_NUM_NODES": "2"})
    assert refused.exit_code != 0 and "evenly" in refused.output


def test_a_job_notes_when_it_began_once_and_its_processes_say_how_long_ago(monkeypatch) -> None:
    """The job's first working log line says how long it took to get there (imports, models, CUDA):
    the time is set by the job's first process and kept by the processes it becomes or starts."""
    from kpipe.infra import jobs

    monkeypatch.delenv(jobs.JOB_STARTED, raising=False)
    assert jobs.since_job_started() == ""
    monkeypatch.setenv(jobs.JOB_STARTED, "1000.0")
    jobs.mark_job_started()  # a later process of the job: the job's time stays
    assert os.environ[jobs.JOB_STARTED] == "1000.0"
    monkeypatch.setattr(jobs.time, "time", lambda: 1012.5)
    assert jobs.since_job_started() == " (12.5 s after the job began)"


def test_a_job_begins_when_its_process_did_not_when_it_marks_it(monkeypatch) -> None:
    """The start counts Python's start and Snakemake's script preamble: the process's own start time."""
    import subprocess
    import sys

    from kpipe.infra import jobs
    from kpipe.infra.process import process_age

    monkeypatch.delenv(jobs.JOB_STARTED, raising=False)
    jobs.mark_job_started()
    age = process_age(os.getpid())
    assert age is not None and abs(time.time() - float(os.environ[jobs.JOB_STARTED]) - age) < 0.5
    marked = subprocess.run([sys.executable, "-c", "import time; time.sleep(1.2); from kpipe.infra import jobs; "
                             "jobs.mark_job_started(); print(jobs.since_job_started())"],
                            env={k: v for k, v in os.environ.items() if k != jobs.JOB_STARTED},
                            capture_output=True, text=True, check=True).stdout
    assert 1.2 <= float(marked.split("(")[1].split(" s")[0]) < 30


def test_exit_without_teardown_runs_the_exit_handlers_and_keeps_the_code(tmp_path):
    """A KernelGym worker and zygote end through ``exit_without_teardown``: their exit handlers (a
    worker's removal of its trusted compile cache) still run, and the exit code is the one given."""
    import subprocess
    import sys

    marker = tmp_path / "handler-ran"
    code = ("import atexit, pathlib\n"
            f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
            "from kpipe.infra.process import exit_without_teardown\n"
            "print('flushed', end='')\n"
            "exit_without_teardown(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout == "flushed"
    assert marker.read_text() == "yes"
