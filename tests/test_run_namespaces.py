"""Issue 64 items 2 and 3: config/paper.yaml, config/paper_14b.yaml, config/kevin.yaml and an ablation overlay plan
into one results/ without writing each other's outputs. Planned with `snakemake -n` (a real run of all three is GPU-sized): the
outputs of every training and evaluating rule are disjoint across the three; the 14B's cold start is the 8B's
(one distillation, the same files read by both SFT jobs); Kevin's tasks and queries are its own."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import REPOSITORY

CONFIGS = {
    "paper": ["config/paper.yaml"],
    "paper_14b": ["config/paper.yaml", "config/paper_14b.yaml"],
    "kevin": ["config/paper.yaml", "config/ablations/kevin.yaml", "config/kevin.yaml"],
    "paper_grpo": ["config/paper.yaml", "config/ablations/grpo.yaml"],
}
# an ablation overlay adds RL runs to its base config's: those it shares are trained once
SHARES_TRAINING = {("paper", "paper_grpo")}
PER_RUN_RULES = ("sft", "rl_iter", "rl_validate", "select_checkpoint", "eval", "eval_budget", "stts", "export_evals",
                 "build_db", "tables", "figures", "viewer")


def planned(workdir: Path, configfiles: list[str]) -> dict[str, dict[str, set[str]]]:
    """rule -> {"input": paths, "output": paths} of `snakemake -n` with `configfiles`."""
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--configfile", *configfiles], cwd=workdir,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    plan: dict[str, dict[str, set[str]]] = defaultdict(lambda: {"input": set(), "output": set()})
    rule = None
    for line in result.stdout.splitlines():
        if match := re.match(r"^(?:local)?rule (\w+):", line):
            rule = match.group(1)
        elif rule and (match := re.match(r"^\s+(input|output): (.*)$", line)):
            plan[rule][match.group(1)].update(path.strip() for path in match.group(2).split(","))
    return plan


@pytest.fixture(scope="module")
def plans(workflow_copy: Path) -> dict[str, dict[str, dict[str, set[str]]]]:
    return {name: planned(workflow_copy, files) for name, files in CONFIGS.items()}


def test_training_and_evaluation_outputs_are_disjoint_across_configs(plans):
    names = list(plans)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            for rule in PER_RUN_RULES:
                if (first, second) in SHARES_TRAINING and rule not in ("export_evals", "build_db", "tables", "figures",
                                                                          "viewer"):
                    continue
                shared = plans[first][rule]["output"] & plans[second][rule]["output"]
                assert not shared, f"{first} and {second} both write {sorted(shared)[:3]} ({rule})"


def test_the_14b_reads_the_8b_cold_start_and_distils_nothing_new(plans):
    paper, paper_14b = plans["paper"], plans["paper_14b"]
    assert paper["distill"]["output"] and paper_14b["distill"]["output"] == paper["distill"]["output"]
    coldstart = {path for path in paper_14b["sft"]["input"] if "stage=coldstart" in path}
    assert coldstart == paper["distill"]["output"]
    assert paper_14b["sft"]["output"] != paper["sft"]["output"]


def test_kevin_s_split_has_its_own_tasks_and_queries(plans):
    for rule in ("ingest_tasks", "decontaminate", "distill"):
        assert plans["kevin"][rule]["output"].isdisjoint(plans["paper"][rule]["output"]), rule


def test_an_ablation_overlay_trains_only_its_own_runs_beside_the_base_config_s(plans):
    base, ablation = plans["paper"], plans["paper_grpo"]
    assert base["rl_iter"]["output"] < ablation["rl_iter"]["output"]  # drkernel's iterations: the same files
    assert base["sft"]["output"] == ablation["sft"]["output"]
    assert any("/grpo/" in path for path in ablation["rl_iter"]["output"] - base["rl_iter"]["output"])


# config/kevin.yaml's shape at the default run's size: a run of its own on another KernelBench split (its own evaluation
# tasks, its training queries from KernelBench, a split rather than a decontamination)
KEVIN_LIKE = """run: split
policy:
  tiny:
    seed: 2
kernelbench:
  ids:
    level_1: [19]
    level_2: [76]
queries:
  sources:
    - name: kevin_train
      kind: kernelbench
      version: main
      levels: [1, 2]
      ids:
        level_1: [1, 23]
        level_2: [9, 12]
      size_cap: 48
      stages: [distill, rl]
  decontamination:
    mode: drop
    threshold: 1.0
"""


SHARED_CACHES = ("cache", "gym")  # keyed by content (teacher and query; candidate and protocol): any run adds to them


SERVICE_STATE = ".gym"  # the KernelGym run service's log and protocol, one per protocol: whichever run starts it


def files_of(results: Path) -> dict[Path, int]:
    """A run's outputs and their times (the shared caches apart: `appended_only`; the service's state apart)."""
    return {path: path.stat().st_mtime_ns for path in results.rglob("*")
            if path.is_file() and path.relative_to(results).parts[0] not in (*SHARED_CACHES, SERVICE_STATE)}


def jsonl_caches(results: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for folder in SHARED_CACHES for path in (results / folder).rglob("*.jsonl")}


def appended_only(before: dict[Path, bytes], results: Path) -> bool:
    """Every answer a shared cache held before is still there, first: later runs only append."""
    after = jsonl_caches(results)
    return all(after[path].startswith(content) for path, content in before.items())


@pytest.mark.slow
def test_three_configs_run_into_one_results_share_the_cold_start_and_leave_each_other_done(tmp_path):
    """A real tiny trio up to SFT, in the shapes of config/paper.yaml (the default run), config/paper_14b.yaml (a
    second run `other` with its own tiny policy on the same data) and config/kevin.yaml (a run `split` on its own
    KernelBench split): the second distils nothing (the cold start is the first's) and trains its own SFT model; the
    third ingests, decontaminates and distils its own; no run rewrites a file of the runs before it, and afterwards
    each config's plan says "Nothing to be done"."""
    for folder in ("workflow", "config"):
        shutil.copytree(REPOSITORY / folder, tmp_path / folder)
    (tmp_path / "config" / "other.yaml").write_text("run: other\npolicy:\n  tiny:\n    seed: 1\n")
    (tmp_path / "config" / "split.yaml").write_text(KEVIN_LIKE)
    default = ["sft"]
    other = ["sft", "--configfile", "config/config.yaml", "config/other.yaml"]
    split = ["sft", "--configfile", "config/config.yaml", "config/split.yaml"]
    results = tmp_path / "results"

    def snakemake(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=tmp_path,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        return result.stdout + result.stderr

    snakemake(*default)
    coldstart = sorted(tmp_path.glob("results/trajectories/stage=coldstart/*/iter=0/part-*.parquet"))
    before, cached = files_of(results), jsonl_caches(results)
    second = snakemake(*other)
    assert "rule distill:" not in second and "rule sft:" in second
    assert {path: files_of(results)[path] for path in before} == before  # the first run's files, untouched
    assert appended_only(cached, results)
    assert set(coldstart) == set(tmp_path.glob("results/trajectories/stage=coldstart/*/iter=0/part-*.parquet"))
    assert (results / "models/sft-default").is_dir() and (results / "models/sft-other").is_dir()

    before, cached = files_of(results), jsonl_caches(results)
    third = snakemake(*split)
    assert all(f"rule {rule}:" in third for rule in ("ingest_tasks", "decontaminate", "distill", "sft"))
    assert {path: files_of(results).get(path) for path in before} == before  # neither earlier run's files
    assert cached and appended_only(cached, results)
    assert (results / "models/sft-split").is_dir()
    for args in (default, other, split):
        assert "Nothing to be done" in snakemake("-n", *args)
