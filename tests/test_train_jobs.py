"""The training rules' jobs (kpipe.train.jobs): the `kpipe train` command lines they launch are the
ones the CLI parses, and a job of several processes becomes the launch, its output in the rule's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kpipe.infra.launch import launch_command
from kpipe.train.cli import train
from kpipe.train.jobs import rl_job, sft_job


def parsed(args: list[str]) -> dict:
    """The parameters `kpipe train <cmd>` reads from `args` (parsed, not run)."""
    assert args[0] == "train"
    command = train.get_command(None, args[1])
    return command.make_context(args[1], list(args[2:])).params


def test_the_sft_job_s_command_line_is_the_cli_s_options(tmp_path: Path) -> None:
    parts = [tmp_path / f"part-{i}.parquet" for i in range(2)]
    for part in parts:
        part.write_text("")
    args = sft_job(parts, tmp_path / "work dir", {"lr": 1e-5, "base_model": "m"}, tmp_path / "model",
                         tmp_path / "s.json", tmp_path / "m.parquet")
    params = parsed(args)
    assert list(params["trajectories"]) == parts
    assert params["out_dir"] == tmp_path / "work dir"
    assert params["metrics_path"] == tmp_path / "work dir" / "train_metrics.parquet"
    assert json.loads(params["settings"]) == {"base_model": "m", "lr": 1e-5}
    assert (params["model_out"], params["summary_out"], params["metrics_out"]) == (
        tmp_path / "model", tmp_path / "s.json", tmp_path / "m.parquet")


def test_the_rl_job_s_command_line_is_the_cli_s_options(tmp_path: Path) -> None:
    (tmp_path / "q.parquet").write_text("")
    (tmp_path / "init").mkdir()
    common = dict(run="default", state_out=tmp_path / "state", settings='{"steps_per_iteration": 2}',
                  gym={"protocol": {}})
    first = parsed(rl_job(tmp_path / "q.parquet", tmp_path / "init", tmp_path / "out", tmp_path / "t.parquet",
                                tmp_path / "m.parquet", tmp_path / "scratch", iteration=0, init_state="",
                                drop_init_state=False, **common))
    assert first["init_state"] is None and not first["drop_init_state"] and first["iteration"] == 0
    assert json.loads(first["gym_settings"]) == {"protocol": {}}
    assert first["settings"] == '{"steps_per_iteration": 2}'
    later = parsed(rl_job(tmp_path / "q.parquet", tmp_path / "init", tmp_path / "out", tmp_path / "t.parquet",
                                tmp_path / "m.parquet", tmp_path / "scratch", iteration=3,
                                init_state=tmp_path / "prev state", drop_init_state=True, **common))
    assert later["init_state"] == tmp_path / "prev state" and later["drop_init_state"] and later["iteration"] == 3
    assert later["scratch"] == tmp_path / "scratch" and later["state_out"] == tmp_path / "state"


def test_a_job_of_several_processes_becomes_kpipe_launch_with_output_in_the_log(tmp_path: Path) -> None:
    assert launch_command(2, ["train", "sft"])[1:] == ["-m", "kpipe.cli", "launch", "--gpus", "2", "--", "train", "sft"]
    log = tmp_path / "logs" / "job.log"
    code = ("from kpipe.infra.jobs import _become_launch\n"
            f"print('before', flush=True)\n_become_launch(0, ['train', '--help'], {str(log)!r}, (0, 1))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\n"  # nothing after the exec reaches the old stdout
    assert "tiny-model" in log.read_text()  # `kpipe train --help`, run by `kpipe launch --gpus 0`
