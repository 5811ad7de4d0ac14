"""The eval, stts and tables rules as a real Snakemake run on a nano model (random bytes: every
answer is a format error, so no kernel is evaluated and jobs take seconds): outputs, report,
and that changing the STTS window reruns only the windowed STTS jobs and what reads them."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from kpipe.data.io import read_table, write_table

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "workflow" / "rules"

SNAKEFILE = textwrap.dedent(f"""
    from pathlib import Path

    configfile: "config.yaml"
    RESULTS, LOGS, RUN = "results", "logs", config["run"]

    def gpus_per_job(requested):
        return 0

    def code_version(*parts):  # fixed: other edits to the library must not rerun jobs mid-test
        return "test"

    include: "{RULES}/eval.smk"
    include: "{RULES}/stts.smk"
    include: "{RULES}/tables.smk"

    rule all:
        input: table_targets()

    rule build_db:
        input: eval_parts(), stts_parts(), "results/tasks/tasks.parquet"
        output: "results/kpipe.duckdb"
        params: code=code_version("db.py")
        run:
            from kpipe.db import build_db
            build_db(Path("results"), Path(output[0]), Path("{REPO}/workflow/sql/views.sql"))
""")

SMALL = {"samples": 1, "shards": 1, "max_tasks": 1, "sampling": {"max_tokens": 8, "temperature": 1.0},
         "reuse_reference": True}


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--rerun-triggers", "params", "input",
                           *args], cwd=workdir, capture_output=True, text=True, timeout=600)


def dry_run_rules(workdir: Path) -> list[str]:
    """The rules of the jobs a dry run would run (its first job-count table)."""
    out = snakemake(workdir, "-n", "--quiet", "rules")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rules, counting = [], False
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts[:2] == ["job", "count"]:
            counting = True
        elif counting and parts and parts[0] == "total":
            break
        elif counting and len(parts) == 2 and parts[1].isdigit():
            rules += [parts[0]] * int(parts[1])
    return sorted(rules)


@pytest.mark.slow
def test_eval_stts_tables_dag(tmp_path):
    from kpipe.train.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "nano", size="nano", seed=0)
    tasks = [{"task_id": f"kb-L{lv}-{i}", "source": "kernelbench", "version": "main", "size_profile": "tiny",
              "split": "eval", "level": lv, "problem_id": i, "name": f"p{i}", "reference_src": "# ref",
              "reference_hash": str(i)} for i, lv in ((1, 1), (2, 2))]
    write_table(tasks, tmp_path / "results" / "tasks" / "tasks.parquet", "tasks")
    config = {"run": "t", "kernelbench": {"levels": [1, 2]},
              "models": [{"name": "nano", "kind": "hf", "path": str(tmp_path / "nano"), "device": "cpu"}],
              "eval": {**SMALL, "turns": 1, "levels": [1]},
              "stts": {**SMALL, "enabled": True, "strategies": ["full", "top_w"], "window": 2, "max_turns": 2,
                       "levels": [2]},
              "tables": {"n_boot": 10}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "Snakefile").write_text(SNAKEFILE)

    assert dry_run_rules(tmp_path) == sorted(["all", "build_db", "eval", "figures", "stts", "stts", "tables"])
    run = snakemake(tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    eval_rows = read_table(tmp_path / "results/trajectories/stage=eval/run=t/model=nano/level=1/part-0.parquet",
                           "trajectories").to_pandas()
    assert set(eval_rows["stage"]) == {"eval"} and set(eval_rows["model"]) == {"nano"} and len(eval_rows) == 1
    stts_rows = read_table(tmp_path / "results/trajectories/stage=stts/run=t/model=nano/strategy=top_w/level=2/"
                           "part-0.parquet", "trajectories").to_pandas()
    assert set(stts_rows["model"]) == {"nano@top_w(w=2)"} and sorted(stts_rows["turn"]) == [1, 2]
    assert "| kpipe" in (tmp_path / "results/tables/table1_fastp_eager.md").read_text()
    assert (tmp_path / "results/figures/fig6_stts.png").stat().st_size > 0
    assert (tmp_path / "logs/benchmarks/eval/run=t/nano-L1-0.tsv").exists()

    assert dry_run_rules(tmp_path) == []  # up to date
    config["stts"]["window"] = 3
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    # only the windowed STTS job and its readers; not eval, not the vanilla (full) STTS job
    assert dry_run_rules(tmp_path) == sorted(["all", "build_db", "figures", "stts", "tables"])

    report = snakemake(tmp_path, "--report", "report.zip")
    assert report.returncode == 0, (report.stdout + report.stderr)[-3000:]
    assert (tmp_path / "report.zip").stat().st_size > 0
