"""kpipe.infra.snakemake_adapter is the one place that touches Snakemake's internals: these tests pin
the behaviour it relies on (each fails when Snakemake changes under it) and keep the rest of the
repository on Snakemake's documented interface."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from kpipe.infra.snakemake_adapter import TESTED_SNAKEMAKE

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "src" / "kpipe" / "infra" / "snakemake_adapter.py"
# documented API: the Snakefile's version pin and the CLI's parser (its docs are generated from it)
PUBLIC_IMPORTS = {("snakemake.utils", "min_version"), ("snakemake.cli", "get_argument_parser")}
# the `workflow` object's documented attributes (Snakefile docs: "Accessing the workflow's base directory")
PUBLIC_WORKFLOW_ATTRIBUTES = {"basedir", "current_basedir"}


def python_files() -> list[Path]:
    """The repository's code (tests/fixtures holds candidate kernels, some deliberately broken)."""
    return [path for folder in ("src", "workflow", "scripts", "checks", "tests", "benchmarks")
            for path in sorted((ROOT / folder).rglob("*.py")) if "fixtures" not in path.parts]


def snakefiles() -> list[Path]:
    return [ROOT / "workflow" / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]


def snakemake_imports(source: str) -> set[tuple[str, str]]:
    """(module, name) of each import from the `snakemake` package; "" as the name of `import snakemake.x`."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "snakemake":
            found |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "snakemake"}
    return found


def test_no_snakemake_internals_outside_the_adapter():
    """Python files import from Snakemake only its documented API; Snakefiles too, and they read only
    the documented attributes of `workflow`."""
    offending = [f"{path.relative_to(ROOT)}: {imported}" for path in python_files() if path != ADAPTER
                 for imported in snakemake_imports(path.read_text()) - PUBLIC_IMPORTS]
    for path in snakefiles():
        text = path.read_text()
        imports = re.findall(r"^\s*from\s+(snakemake[\w.]*)\s+import\s+([\w, ()]+)$", text, re.MULTILINE)
        offending += [f"{path.relative_to(ROOT)}: {(module, name.strip())}" for module, names in imports
                      for name in names.strip("()").split(",") if (module, name.strip()) not in PUBLIC_IMPORTS]
        offending += [f"{path.relative_to(ROOT)}: import {module}"
                      for module in re.findall(r"^\s*import\s+(snakemake[\w.]*)", text, re.MULTILINE)]
        attributes = set(re.findall(r"(?<![\w./])workflow\.(\w+)", text)) - PUBLIC_WORKFLOW_ATTRIBUTES
        offending += [f"{path.relative_to(ROOT)}: workflow.{attribute}" for attribute in sorted(attributes)]
    assert not offending, "go through kpipe.infra.snakemake_adapter:\n" + "\n".join(offending)


def test_the_grep_sees_a_private_import():
    assert snakemake_imports("from snakemake.dag import DAG\nimport snakemake.jobs\n") == {
        ("snakemake.dag", "DAG"), ("snakemake.jobs", "")}


def test_pins_name_the_tested_versions():
    """The installed Snakemake is in the pinned range (the newest under `make test`, the floor under
    `make test-snakemake-floor`), and pyproject.toml, environment.yml, the Snakefile's min_version and
    the Makefile's floor say the same range."""
    lowest, first_untested = TESTED_SNAKEMAKE
    assert Version(lowest) <= Version(version("snakemake")) < Version(first_untested)
    pyproject = (ROOT / "pyproject.toml").read_text()
    pinned = [Requirement(line.strip().strip('",').split('"')[0]) for line in pyproject.splitlines()
              if line.strip().startswith('"snakemake>') or line.strip().startswith('"snakemake<')]
    assert [str(requirement.specifier) for requirement in pinned] == [f"<{first_untested},>={lowest}"]
    assert f"snakemake-minimal>={lowest},<{first_untested}" in (ROOT / "environment.yml").read_text()
    assert f'min_version("{lowest}")' in (ROOT / "workflow" / "Snakefile").read_text()
    assert f"SNAKEMAKE_FLOOR ?= {lowest}.0" in (ROOT / "Makefile").read_text()


CHAIN = """
{patch}
rule all:
    input: "link.3"

rule link:
    input: lambda wildcards: [] if int(wildcards.i) == 0 else [f"link.{{int(wildcards.i) - 1}}"]
    output: "link.{{i}}"
    shell: "touch {{output}}"

rule after:
    input: "link.3"
    output: "after"
    shell: "touch {{output}}"
"""


def run_chain(tmp_path: Path, patched: bool) -> subprocess.CompletedProcess[str]:
    patch = "from kpipe.infra.snakemake_adapter import until_stops_after_chained_rules\n" \
            "until_stops_after_chained_rules()\n" if patched else ""
    (tmp_path / "Snakefile").write_text(CHAIN.format(patch=patch))
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--until", "link"], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          timeout=300)


def test_until_still_stops_a_chained_rule_after_its_first_job(tmp_path):
    """The upstream behaviour the patch works around: `--until` a rule whose jobs read each other runs
    its first job only. When this fails, Snakemake has fixed it: drop until_stops_after_chained_rules."""
    result = run_chain(tmp_path, patched=False)
    assert (tmp_path / "link.0").exists() and not (tmp_path / "link.1").exists()
    assert "Out of jobs ready to be started" in result.stdout + result.stderr


def test_patched_until_runs_the_chain_and_stops_after_it(tmp_path):
    result = run_chain(tmp_path, patched=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all((tmp_path / f"link.{i}").exists() for i in range(4)) and not (tmp_path / "after").exists()


READER = """
import json
from kpipe.infra.snakemake_adapter import (command_line_config, default_resource_total, is_main_process, resource_total,
                                           runs_here)

default_resource_total(workflow, "api", 4)
default_resource_total(workflow, "gpu_slots", 8)
Path("read.json").write_text(json.dumps({
    "config": command_line_config(workflow), "runs_here": runs_here(workflow), "main": is_main_process(workflow),
    "api": resource_total(workflow, "api"), "gpu_slots": resource_total(workflow, "gpu_slots"),
    "absent": resource_total(workflow, "absent")}))

rule all:
    output: "x"
    shell: "touch {output}"
"""


@pytest.mark.parametrize("given_slots", [None, 3])
def test_workflow_attributes_read_as_the_adapter_expects(tmp_path, given_slots):
    """`--config` pairs as given (nested values as strings), a local run, totals given on the command line winning over defaults."""
    (tmp_path / "Snakefile").write_text("from pathlib import Path\n" + textwrap.dedent(READER))
    resources = [] if given_slots is None else ["--resources", f"gpu_slots={given_slots}"]
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--config", "nested={\"size\": 1}",
                             "count=2", *resources], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert result.returncode == 0, result.stdout + result.stderr
    read = json.loads((tmp_path / "read.json").read_text())
    assert read == {"config": {"nested": {"size": "1"}, "count": 2}, "runs_here": True, "main": True, "api": 4,
                    "gpu_slots": 8 if given_slots is None else given_slots, "absent": None}


INTERRUPTED = """
import os
from pathlib import Path
{patch}
if not Path("main.pid").exists():
    Path("main.pid").write_text(str(os.getpid()))

rule all:
    input: "out"

rule write:
    output: "out"
    shell: "touch {{output}}; kill -9 $(cat main.pid); sleep 30"
"""


def dry_run_after_a_kill(tmp_path: Path, patched: bool) -> str:
    """The plan after a run killed (SIGKILL) while its job's output was written: incomplete."""
    patch = "from kpipe.infra.snakemake_adapter import label_interrupted_jobs\nlabel_interrupted_jobs()" if patched else ""
    (tmp_path / "Snakefile").write_text(INTERRUPTED.format(patch=patch))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    killed = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--nolock"], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=300)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    plan = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--rerun-incomplete", "-n"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=300)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    return plan.stdout + plan.stderr


def test_upstream_labels_a_job_rerun_after_an_interruption_forced(tmp_path):
    """When this fails, Snakemake labels such jobs itself: drop label_interrupted_jobs."""
    assert "reason: Forced execution" in dry_run_after_a_kill(tmp_path, patched=False)


def test_a_job_rerun_after_an_interruption_says_its_output_is_incomplete(tmp_path):
    plan = dry_run_after_a_kill(tmp_path, patched=True)
    assert "reason: Incomplete output files: out" in plan and "Forced execution" not in plan
    assert "incomplete output files:\n        write" in plan  # the Reasons summary
