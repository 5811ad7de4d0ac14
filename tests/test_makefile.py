"""`make setup TORCH=...` on an existing .venv replaces torch (a GPU box first set up with the CPU
pin keeps it otherwise: pip finds a bare `torch` satisfied). Run against a stand-in venv whose
python only records its arguments."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPOSITORY


@pytest.fixture
def stand_in_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {venv}/calls\n')
    python.chmod(0o755)
    (venv / ".kpipe-installed").touch()  # set up already (newer than pyproject.toml)
    os.utime(venv / ".kpipe-installed", (2**31, 2**31))
    return venv


def setup(venv: Path, *args: str) -> list[str]:
    (venv / "calls").unlink(missing_ok=True)
    subprocess.run(["make", "-s", "-C", str(REPOSITORY), "setup", f"VENV={venv}", *args], check=True,
                   capture_output=True)
    return (venv / "calls").read_text().splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_another_torch_requirement_replaces_torch_once(stand_in_venv):
    assert not any("pip" in call for call in setup(stand_in_venv))  # the default pin: nothing to do
    switched = setup(stand_in_venv, "TORCH=torch")
    assert switched[:2] == ["-m pip uninstall -q -y torch triton", "-m pip install -q --retries 10 --resume-retries 10 torch"]
    assert (stand_in_venv / ".kpipe-torch").read_text().strip() == "torch"
    assert not any("pip" in call for call in setup(stand_in_venv, "TORCH=torch"))  # done once
