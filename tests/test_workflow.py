"""End-to-end: the real Snakemake DAG on the default (tiny, offline) config, in a scratch copy."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir, capture_output=True, text=True
    )


def planned_jobs(result: subprocess.CompletedProcess) -> set[str]:
    """Rule names in the 'Job stats' table of a dry run."""
    stats = result.stdout.split("Job stats:")[-1]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+$", stats, re.M)} - {"total"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A copy of the workflow and config, with the default pipeline already run once."""
    work = tmp_path_factory.mktemp("pipeline")
    shutil.copytree(ROOT / "workflow", work / "workflow")
    shutil.copytree(ROOT / "config", work / "config")
    result = snakemake(work)
    assert result.returncode == 0, result.stderr[-4000:]
    return work


@pytest.fixture
def edited_config(workdir):
    """Edit config/config.yaml of the scratch copy for one test, then put it back."""
    path = workdir / "config" / "config.yaml"
    original = path.read_text()

    def edit(change):
        cfg = yaml.safe_load(original)
        change(cfg)
        path.write_text(yaml.safe_dump(cfg))

    yield edit
    path.write_text(original)


def test_default_pipeline_leaves_tables_and_database(workdir):
    for table in ["tasks/tasks.parquet", "queries/queries.parquet", "kpipe.duckdb"]:
        assert (workdir / "results" / table).exists(), table
    query = subprocess.run(
        [sys.executable, "-m", "kpipe.cli", "query", "--db", str(workdir / "results" / "kpipe.duckdb"), "--format", "json",
         "select level, count(*) as n from tasks group by level order by level"],
        capture_output=True, text=True, cwd="/",
    )
    assert query.returncode == 0, query.stderr
    cfg = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    expected = [{"level": int(k.split("_")[1]), "n": len(v)} for k, v in sorted(cfg["kernelbench"]["ids"].items())]
    assert json.loads(query.stdout) == expected
    assert (workdir / "logs" / "ingest_tasks.log").read_text().strip()


def test_nothing_changed_reruns_nothing(workdir):
    result = snakemake(workdir, "-n")
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr


def test_decontamination_setting_reruns_only_decontamination_and_dependents(workdir, edited_config):
    edited_config(lambda cfg: cfg["queries"]["decontamination"].update(threshold=0.5))
    assert planned_jobs(snakemake(workdir, "-n")) == {"decontaminate", "build_db", "all"}


def test_task_selection_reruns_task_ingest_and_dependents(workdir, edited_config):
    edited_config(lambda cfg: cfg["kernelbench"]["ids"].update(level_1=[19]))
    assert planned_jobs(snakemake(workdir, "-n")) == {"ingest_tasks", "decontaminate", "build_db", "all"}


def test_wrong_key_stops_with_one_line(workdir, edited_config):
    edited_config(lambda cfg: cfg["kernelbench"].update(levles=[1]))
    result = snakemake(workdir, "-n")
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("config error")]
    assert errors == ["config error: kernelbench.levles: unknown key (allowed here: ids, levels, size_cap, version)"]


def test_lint_reports_nothing(workdir):
    result = snakemake(workdir, "--lint")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Congratulations" in result.stdout + result.stderr


def test_paper_config_plans(workdir):
    result = snakemake(workdir, "-n", "--configfile", "config/paper.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    assert {"ingest_tasks", "ingest_queries", "decontaminate", "build_db"} <= planned_jobs(result)
