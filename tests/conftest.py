"""Shared test setup: Triton runs through its CPU interpreter; no GPU is assumed."""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

REPOSITORY = Path(__file__).resolve().parents[1]

# The longest modules, longest first (573 s of a worker's time down to 32 s in a full run on 2 cores, 8149c15). `make test` runs the suite on two
# pytest-xdist workers, a module at a time on one worker (`--dist loadfile`: its module-scoped
# fixtures run once), in collection order: started first, the long modules do not leave one worker
# busy at the end while the other idles. Order only; every test runs either way.
LONGEST_MODULES = (
    "test_workflow.py",
    "test_workflow_gym_service.py",
    "test_workflow_reruns.py",
    "test_run_namespaces.py",
    "test_compare_clean_runs.py",
    "test_workflow_db.py",
    "test_rl_learning.py",
    "test_gym_service.py",
    "test_gym_pool.py",
    "test_distributed.py",
    "test_gym_eval.py",
    "test_gym_forgery.py",
    "test_workflow_attacks.py",
    "test_gym_confinement.py",
    "test_gym_memory.py",
    "test_bank.py",
    "test_gym_environment.py",
    "test_slurm_profile.py",
    "test_gym_waiting_child.py",
    "test_rl_validation.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of LONGEST_MODULES first, in its order; within a module, tests keep theirs.

    Every item also gets a node id of its own: schemathesis gives its items (one per API operation,
    tests/test_gym_service_contract.py) their operation in the name but one node id for all, and
    pytest-xdist, which hands tests to workers by node id, ran only the first of them."""
    rank = {name: position for position, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        module_and_class, _, name = item.nodeid.rpartition("::")
        if name != item.name and item.name.startswith(f"{name}["):
            unique = f"{module_and_class}::{item.name}"
            if hasattr(item, "_id"):  # pytest 9 keeps the node id as a NodeId (schemathesis still sets _nodeid)
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(unique)
            else:
                item._nodeid = unique


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
