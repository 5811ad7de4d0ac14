"""Shared test setup: Triton runs through its CPU interpreter; no GPU is assumed."""

import os
import shutil
from collections.abc import Iterator
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


@pytest.fixture
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core machine, more threads make torch far slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
