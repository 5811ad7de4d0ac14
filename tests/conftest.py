"""Shared test setup: Triton runs through its CPU interpreter; no GPU is assumed."""

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    """A scratch copy of workflow/ and config/: Snakemake plans and runs there, never touching the
    repository's own results/ and logs/."""
    work = tmp_path_factory.mktemp("workflow")
    shutil.copytree(REPOSITORY / "workflow", work / "workflow")
    shutil.copytree(REPOSITORY / "config", work / "config")
    return work
