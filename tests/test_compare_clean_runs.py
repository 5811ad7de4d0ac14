"""Two clean runs of the same code and config, each in its own fresh copy of the workflow, compare
equal under scripts/compare_runs.py in what it calls deterministic (exit 0), while on this CPU their
run-dependent part (Triton-interpreter timings, the rewards from them, the RL policy) differs.
A reduced default config: every stage runs, each at its smallest."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPOSITORY

pytestmark = pytest.mark.slow

SMALL = {
    "distill": {"shards": 1, "samples": 2, "turns": 2},
    "sft": {"max_steps": 40, "save_every": 10},
    "rl": {"iterations": 1, "steps_per_iteration": 2, "prompts_per_step": 1, "rollouts_per_prompt": 2,
           "validation": {"every": 0}},
    "eval": {"samples": 1, "turns": 2},
}


def clean_run(root: Path) -> Path:
    root.mkdir()
    shutil.copytree(REPOSITORY / "workflow", root / "workflow")
    shutil.copytree(REPOSITORY / "config", root / "config")
    (root / "config" / "small.yaml").write_text(yaml.safe_dump(SMALL))
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "config/small.yaml"],
                            cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return root


def test_two_clean_runs_compare_equal_in_the_deterministic_part(tmp_path):
    a, b = clean_run(tmp_path / "a"), clean_run(tmp_path / "b")
    result = subprocess.run([sys.executable, str(REPOSITORY / "scripts" / "compare_runs.py"), str(a / "results"),
                             str(b / "results"), "--config", str(a / "config" / "config.yaml"),
                             "--config", str(a / "config" / "small.yaml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
    summaries = [line for line in result.stdout.splitlines() if line.startswith("trajectories [deterministic]")]
    assert summaries and not summaries[0].endswith(" 0 / 0 row(s): same rows")  # something was compared
