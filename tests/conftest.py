"""Shared test setup: Triton runs through its CPU interpreter; no GPU is assumed."""

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

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


@pytest.fixture
def load_script(monkeypatch) -> Callable[[str], ModuleType]:
    """A program of scripts/ as a module, importing as it does when run as `python scripts/NAME.py`
    (scripts/ on the path: the GPU checks import gpu_harness)."""
    monkeypatch.syspath_prepend(str(REPOSITORY / "scripts"))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, REPOSITORY / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # a dataclass looks its module up there
        spec.loader.exec_module(module)
        return module

    return load
