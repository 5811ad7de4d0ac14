"""End-to-end: the real Snakemake DAG on the default (tiny, offline) config, in a scratch copy."""

import csv
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir, capture_output=True, text=True
    )


def job_counts(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Rule name -> job count, from the first 'Job stats' table of a dry run ({} if none)."""
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    if "Job stats:" not in result.stdout:
        return {}
    stats = result.stdout.split("Job stats:")[1].split("total")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}


def planned_jobs(result: subprocess.CompletedProcess) -> set[str]:
    return set(job_counts(result))


UPSTREAM_OF_QUERIES = {"ingest_tasks", "ingest_queries", "tiny_model"}


@pytest.fixture(scope="module")
def workdir(workflow_copy: Path) -> Path:
    """A copy of the workflow and config, with the default pipeline already run once."""
    result = snakemake(workflow_copy)
    assert result.returncode == 0, result.stderr[-4000:]
    return workflow_copy


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
    for table in ["tasks/*/tasks.parquet", "queries/*/queries.parquet", "runs/default+default/kpipe.duckdb"]:
        assert len(list((workdir / "results").glob(table))) == 1, table
    query = subprocess.run(
        [sys.executable, "-m", "kpipe.cli", "query", "--db", str(workdir / "results" / "runs" / "default+default" / "kpipe.duckdb"), "--format", "json",
         "select level, count(*) as n from tasks group by level order by level"],
        capture_output=True, text=True, cwd="/",
    )
    assert query.returncode == 0, query.stderr
    cfg = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    expected = [{"level": int(k.split("_")[1]), "n": len(v)} for k, v in sorted(cfg["kernelbench"]["ids"].items())]
    assert json.loads(query.stdout) == expected
    (log,) = (workdir / "logs").glob("ingest_tasks-*.log")  # named by the tasks key (rules/inputs.smk)
    assert log.read_text().strip()


def test_the_default_run_s_clock_free_tables_are_those_of_main(workdir):
    """Issue 66's reshape changed no result: the tables of the default run that do not depend on the
    CPU's timings are those a run of main 73f9be3 wrote (tests/default_dag.py says which and why)."""
    from default_dag import FIXTURE, deterministic_tables

    recorded = json.loads(FIXTURE.read_text())
    now = json.loads(json.dumps(deterministic_tables(workdir / "results")))
    assert (now["tasks"], now["queries"]) == (recorded["tasks"], recorded["queries"])
    assert [row[:2] for row in now["sft"]] == [row[:2] for row in recorded["sft"]]
    for (step, name, value), (_, _, expected) in zip(now["sft"], recorded["sft"]):
        assert value == pytest.approx(expected, rel=1e-6, abs=1e-9), (step, name)


def test_nothing_changed_reruns_nothing(workdir):
    result = snakemake(workdir, "-n")
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr


def test_decontamination_setting_reruns_only_decontamination_and_dependents(workdir, edited_config):
    edited_config(lambda cfg: cfg["queries"]["decontamination"].update(threshold=0.5))
    planned = planned_jobs(snakemake(workdir, "-n"))
    assert {"decontaminate", "distill", "build_db"} <= planned  # it and what reads the queries
    assert not planned & UPSTREAM_OF_QUERIES


def test_sft_setting_reruns_sft_and_what_reads_its_model(workdir, edited_config):
    """The `sft` section reaches the sft job as a plain param: Snakemake leaves a params function of
    `input` out of its params trigger, and an edit of the section would then rerun nothing."""
    edited_config(lambda cfg: cfg["sft"].update(max_steps=cfg["sft"]["max_steps"] - 1))
    planned = planned_jobs(snakemake(workdir, "-n"))
    assert {"sft", "rl_iter", "eval", "build_db"} <= planned
    assert not planned & (UPSTREAM_OF_QUERIES | {"decontaminate", "distill"})


def test_the_rl_chain_and_every_job_it_waits_for_start_first(workdir):
    """rl_iter and every rule it depends on, however far up, carry the critical path's priority, and
    no other rule does: Snakemake passes a rule's priority to none of the jobs it depends on (only
    --prioritize does), and on 2 CPU cores the teacher's evaluations had taken a core before
    ingest_queries, which started distillation 17 s late."""
    graph = snakemake(workdir, "--rulegraph")
    assert graph.returncode == 0, graph.stderr[-2000:]
    names = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)"', graph.stdout, re.M))
    needs: dict[str, set[str]] = {}
    for before, after in re.findall(r"^\s*(\d+) -> (\d+)$", graph.stdout, re.M):
        needs.setdefault(names[after], set()).add(names[before])
    critical, todo = set(), ["rl_iter"]
    while todo:
        rule = todo.pop()
        if rule not in critical:
            critical.add(rule)
            todo += needs.get(rule, set())
    assert {"ingest_queries", "decontaminate", "distill", "tiny_model", "sft", "rl_iter"} <= critical
    plan = snakemake(workdir, "-n", "--forceall")
    assert plan.returncode == 0, plan.stderr[-2000:]
    jobs = re.findall(r"^(?:local)?rule (\w+):\n(.*?)^\S", plan.stdout, re.M | re.S)
    first = {rule for rule, block in jobs if re.search(r"^\s+priority: 10$", block, re.M)}
    assert first == critical


def test_task_selection_reruns_task_ingest_and_dependents(workdir, edited_config):
    edited_config(lambda cfg: cfg["kernelbench"]["ids"].update(level_1=[19]))
    planned = planned_jobs(snakemake(workdir, "-n"))
    assert {"ingest_tasks", "decontaminate", "eval", "build_db"} <= planned
    assert not planned & {"ingest_queries", "tiny_model"}


def test_stts_window_reruns_only_windowed_stts_and_readers(workdir, edited_config):
    edited_config(lambda cfg: cfg["stts"].update(window=3))
    counts = job_counts(snakemake(workdir, "-n"))
    # the top-w STTS job of each model (tiny-sft, tiny-rl) and what reads them; not eval, not the vanilla (full) ones
    assert counts == {"stts": 2, "export_evals": 1, "build_db": 1, "tables": 1, "figures": 1, "viewer": 1, "all": 1}


def test_the_default_run_learns(workdir):
    """The RL iterations of the default run raise the rollouts' mean reward (docs/rl.md, "The default run learns")."""
    with open(workdir / "results" / "runs" / "default+default" / "tables" / "rl_reward.csv") as handle:
        rows = sorted((int(r["iteration"]), float(r["mean_reward"])) for r in csv.DictReader(handle) if r["run"] == "default")
    assert [iteration for iteration, _ in rows] == list(range(5))
    assert rows[-1][1] >= rows[0][1] + 0.2, rows


def test_every_stage_wrote_its_table(workdir):
    db = str(workdir / "results" / "runs" / "default+default" / "kpipe.duckdb")
    query = subprocess.run(
        [sys.executable, "-m", "kpipe.cli", "query", "--db", db, "--format", "json",
         "select stage, count(*) as n from trajectories group by stage order by stage"],
        capture_output=True, text=True,
    )
    assert {row["stage"] for row in json.loads(query.stdout)} == {"budget", "coldstart", "eval", "rl", "rl_val", "stts"}
    for name in ["table1_fastp_eager", "table2_fastp_compile", "hacking_ratio", "stts_curves", "rl_validation",
                 "kevin_budget"]:
        assert "| default " in (workdir / "results" / "runs" / "default+default" / "tables" / f"{name}.md").read_text()  # rows of this run
    table1 = (workdir / "results" / "runs" / "default+default" / "tables" / "table1_fastp_eager.md").read_text()
    hacks = {line.split("|")[7].strip() for line in table1.splitlines() if line.startswith("| kpipe ")}
    assert hacks == {"kpipe", "paper"}  # both hack definitions, from the same rows (issue 30)
    with open(workdir / "results" / "runs" / "default+default" / "tables" / "hacking_ratio.csv") as handle:
        assert {"hacking_ratio", "hacking_ratio_paper", "checks"} <= set(next(csv.DictReader(handle)))
    with open(workdir / "results" / "runs" / "default+default" / "tables" / "kevin_budget.csv") as handle:
        budget = [row for row in csv.DictReader(handle) if row["source"] == "kpipe" and row["full_budget"] == "True"]
    assert sorted((row["trajectories"], row["turns"]) for row in budget) == [("2", "4"), ("4", "2"), ("8", "1")]
    for name in ["fig6_stts", "fig_kevin_budget"]:
        assert (workdir / "results" / "runs" / "default+default" / "figures" / f"{name}.png").stat().st_size > 0


def test_trajectories_join_their_evaluations(workdir):
    """The stages' evaluations live in the result cache; export_evals makes it the `evals` table
    that trajectories.eval_key joins (one row per key)."""
    query = subprocess.run(
        [sys.executable, "-m", "kpipe.cli", "query", "--db", str(workdir / "results" / "runs" / "default+default" / "kpipe.duckdb"), "--format", "json",
         "select count(*) as evals, count(distinct key) as keys, "
         "(select count(*) from trajectories t join evals e on t.eval_key = e.key) as joined from evals"],
        capture_output=True, text=True,
    )
    assert query.returncode == 0, query.stderr
    [counts] = json.loads(query.stdout)
    assert counts["evals"] > 0 and counts["keys"] == counts["evals"], counts
    assert counts["joined"] > 0, counts


def test_report_contains_tables_and_figures(workdir):
    result = snakemake(workdir, "--report", "report.zip")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    names = zipfile.ZipFile(workdir / "report.zip").namelist()
    assert any(name.endswith("table1_fastp_eager.md") for name in names)
    assert any(name.endswith("fig6_stts.png") for name in names)
    assert any(name.endswith("kevin_budget.md") for name in names)
    assert any(name.endswith("fig_kevin_budget.png") for name in names)
    viewer_dirs = [name.removesuffix("index.html") for name in names if name.endswith("/index.html")]
    assert any(f"{folder}data/page-0000.js" in names for folder in viewer_dirs)  # the viewer with its data


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
    counts = job_counts(snakemake(workdir, "-n", "--configfile", "config/paper.yaml"))
    assert counts["distill"] == 64 and counts["rl_iter"] == 60  # 2 runs x 30 iterations
    assert {"ingest_tasks", "sft", "eval", "stts", "tables"} <= set(counts)


def test_gpu_config_plans_anywhere_and_runs_only_where_a_gpu_shows(workflow_copy, tmp_path):
    """config/gpu.yaml (the README's GPU command) plans the default DAG with every GPU job on one slot;
    a run (not a dry run: the paper's plan is made on laptops too) on a machine with no GPU stops with one
    line before any job runs."""
    import os
    import shutil

    def snakemake_gpu(workdir: Path, visible: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "config/gpu.yaml", *args],
                              cwd=workdir, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": visible})

    planned = snakemake_gpu(workflow_copy, "0", "-n")
    assert job_counts(planned)["rl_iter"] == 5
    assert set(re.findall(r"resources: .*gpu_slots=(\d+)", planned.stdout)) == {"1"}  # every GPU job shares the GPU
    assert job_counts(snakemake_gpu(workflow_copy, "", "-n"))["rl_iter"] == 5
    fresh = tmp_path / "fresh"
    for folder in ("workflow", "config"):
        shutil.copytree(workflow_copy / folder, fresh / folder)
    refused = snakemake_gpu(fresh, "")
    assert refused.returncode != 0
    assert "config error: device: cuda (config/gpu.yaml and config/paper.yaml set it), but this machine shows no GPU" \
        in refused.stdout + refused.stderr
    assert not (fresh / "results").exists()
