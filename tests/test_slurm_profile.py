"""The SLURM profile plans the paper run (as --profile and as --workflow-profile), passes lint,
and the SLURM executor plugin turns each planned job's resources into the intended sbatch
request; a local run caps GPU requests at the visible GPUs (run in a scratch copy of the repo's
workflow/ and config/, as tests/test_workflow.py does)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

import snakemake_executor_plugin_slurm  # noqa: F401 (the profile needs it)
from snakemake_executor_plugin_slurm.submit_string import get_submit_command  # noqa: E402
from snakemake_executor_plugin_slurm.utils import set_gres_string  # noqa: E402
from snakemake_executor_plugin_slurm.validation import validate_slurm_extra  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAPER = ["--configfile", "config/paper.yaml"]
SFT_GPUS = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())["sft"]["gpus"]
PROFILE_FORMS = ["--profile", "--workflow-profile"]  # the first also applies workflow/profiles/default


@pytest.fixture(scope="module")
def workdir(workflow_copy: Path) -> Path:
    return workflow_copy


def snakemake(workdir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True, text=True,
                            env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def planned_resources(output: str) -> dict[str, list[dict[str, Any]]]:
    """rule name -> the resources of each of its planned jobs, from a dry run's job listing."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    rule = None
    for line in output.splitlines():
        if match := re.match(r"^(?:local)?rule (\w+):", line):
            rule = match.group(1)
        elif rule and line.strip().startswith("resources:"):
            pairs = (item.split("=", 1) for item in line.split("resources:", 1)[1].split(", "))
            jobs.setdefault(rule, []).append({k.strip(): int(v) if v.isdigit() else v for k, v in pairs})
            rule = None
    return jobs


class FakeResources(dict):
    """The attribute-and-get access the plugin uses on ``job.resources``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def sbatch_line(resources: dict[str, Any], **extra: Any) -> str:
    job = type("Job", (), {"resources": FakeResources({**resources, **extra}), "threads": 1})()
    validate_slurm_extra(job)
    params = {"run_uuid": "kpipe", "slurm_logfile": "logs/slurm/x.log", "comment_str": "rule", "account": "-A lab",
              "partition": "-p gpu", "workdir": None}
    return get_submit_command(job, params) + set_gres_string(job)


@pytest.fixture(scope="module")
def paper_dry_runs(workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    """The paper run's dry run with the SLURM profile, given either way (PROFILE_FORMS), each made
    once for the module: the acceptance command (--profile) and the resource tests read the same output."""
    return {form: snakemake(workdir, "-n", form, "workflow/profiles/slurm", *PAPER) for form in PROFILE_FORMS}


@pytest.fixture(scope="module", params=PROFILE_FORMS)
def paper_plan(request, paper_dry_runs: dict[str, subprocess.CompletedProcess]) -> dict[str, list[dict[str, Any]]]:
    """The paper run planned with the SLURM profile, given either way."""
    return planned_resources(paper_dry_runs[request.param].stdout)


def test_the_acceptance_command_plans_the_full_paper_run(paper_dry_runs: dict[str, subprocess.CompletedProcess]) -> None:
    result = paper_dry_runs["--profile"]  # snakemake -n --profile workflow/profiles/slurm --configfile config/paper.yaml
    plan = planned_resources(result.stdout)
    counts = Counter({rule: len(jobs) for rule, jobs in plan.items()})
    assert {"ingest_tasks", "ingest_queries", "decontaminate", "sft", "build_db"} <= set(counts)
    assert counts["distill"] == 64  # distill.shards of config/paper.yaml
    assert "Using profiles workflow/profiles/slurm and workflow specific profile workflow/profiles/default" in result.stderr
    assert plan["sft"][0]["gpu"] == SFT_GPUS  # not capped by the default profile applied on top


def test_a_local_run_caps_gpu_requests_at_the_visible_gpus(workdir: Path) -> None:
    def planned_sft(*args: str) -> tuple[int, int]:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}  # what kpipe.infra.gpu.visible_gpus() reads first
        sft = planned_resources(snakemake(workdir, "-n", *PAPER, *args, env=env).stdout)["sft"][0]
        return sft["gpu"], sft["gpu_slots"]

    assert SFT_GPUS > 2
    assert planned_sft() == (2, 8)  # both GPUs whole, 4 slots each (gpu.slots_per_gpu)
    assert planned_sft("--resources", "gpu_slots=4") == (1, 4)  # a run given one GPU's slots


def test_every_planned_job_has_runtime_and_memory(paper_plan) -> None:
    for rule, jobs in paper_plan.items():
        for resources in jobs:
            assert resources["runtime"] > 0 and resources["mem_mb"] > 0, rule


def test_gpu_jobs_ask_slurm_for_the_rules_gpus(paper_plan) -> None:
    sft = paper_plan["sft"][0]
    assert sft["gpu"] == SFT_GPUS
    line = sbatch_line(sft)
    for flag in (f"--gpus={SFT_GPUS}", "-t 1440", "--mem 512000", "--cpus-per-gpu=12", "--exclusive"):
        assert flag in line, line
    assert "--cpus-per-task" not in line
    assert f"--gpus=h100:{SFT_GPUS}" in sbatch_line(sft, gpu_model="h100")
    distill = sbatch_line(paper_plan["distill"][0])
    assert "--gpus=1" in distill and "--cpus-per-gpu=8" in distill


def test_cpu_jobs_ask_for_cpus_and_no_gpu(paper_plan) -> None:
    line = sbatch_line(paper_plan["decontaminate"][0])
    assert "--cpus-per-task=8" in line and "--gpus" not in line and "--ntasks=1" in line


@pytest.mark.parametrize("profile_form", PROFILE_FORMS)
def test_profile_passes_lint(workdir: Path, profile_form: str) -> None:
    result = snakemake(workdir, "--lint", profile_form, "workflow/profiles/slurm", *PAPER)
    assert "Congratulations" in result.stdout + result.stderr


PAPER_14B = [*PAPER, "config/paper_14b.yaml"]
KEVIN = [*PAPER, "config/ablations/kevin.yaml"]


@pytest.mark.parametrize("profile", [[], ["--profile", "workflow/profiles/slurm"]], ids=["local", "slurm"])
def test_the_14b_run_and_the_kevin_preset_are_planned(workdir: Path, profile: list[str]) -> None:
    result = snakemake(workdir, "-n", *profile, *PAPER_14B)
    plan = planned_resources(result.stdout)
    paper_14b = yaml.safe_load((ROOT / "config" / "paper_14b.yaml").read_text())
    assert len(plan["rl_iter"]) == paper_14b["rl"]["iterations"]  # only the full recipe: base_run false
    assert "results/models/rl-paper-14b/drkernel/iter=59" in result.stdout and "rl-paper/" not in result.stdout
    assert "results/models/sft-paper-14b" in result.stdout
    if profile:  # the 14B's GPUs: 8 per SFT / RL job, tensor parallel 2 for its evaluations
        assert {job["gpu"] for job in plan["rl_iter"] + plan["sft"]} == {8}
        served = [job for job in plan["eval"] if job["gpu"] == 2]
        assert len(served) == 6  # drkernel-14b-sft and -rl x 3 levels
        assert all(job["runtime"] > 0 and job["mem_mb"] > 0 for jobs in plan.values() for job in jobs)
    kevin = planned_resources(snakemake(workdir, "-n", *profile, *KEVIN).stdout)
    assert len(kevin["rl_iter"]) == 3 * yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())["rl"]["iterations"]
