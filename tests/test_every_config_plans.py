"""Issue 64: `snakemake -n` plans every config and every ablation overlay, each on the base its header names
(config/paper.yaml for the paper's overlays), and an ablation overlay plans RL iterations of each run it adds.
A config or overlay added without an entry here fails `test_every_config_file_is_planned`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import REPOSITORY
from test_run_namespaces import planned

# a config file -> the configfiles it is planned with (its base first); cost_units.yaml is no pipeline config
CONFIGS = {
    "config/config.yaml": ["config/config.yaml"],
    "config/gpu.yaml": ["config/config.yaml", "config/gpu.yaml"],
    "config/paper.yaml": ["config/paper.yaml"],
    "config/paper_14b.yaml": ["config/paper.yaml", "config/paper_14b.yaml"],
    "config/paper_smoke.yaml": ["config/paper.yaml", "config/paper_smoke.yaml"],
    "config/paper_smoke_1gpu.yaml": ["config/paper.yaml", "config/paper_smoke.yaml", "config/paper_smoke_1gpu.yaml"],
    "config/kevin.yaml": ["config/paper.yaml", "config/ablations/kevin.yaml", "config/kevin.yaml"],
}
NOT_PIPELINE_CONFIGS = {"config/cost_units.yaml"}
ABLATIONS = sorted(f"config/ablations/{path.name}" for path in (REPOSITORY / "config" / "ablations").glob("*.yaml"))


def test_every_config_file_is_planned():
    files = {f"config/{path.name}" for path in (REPOSITORY / "config").glob("*.yaml")}
    assert files - NOT_PIPELINE_CONFIGS == set(CONFIGS)
    assert len(ABLATIONS) >= 12


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_config_plans(workflow_copy: Path, config: str):
    plan = planned(workflow_copy, CONFIGS[config])
    assert plan["tables"]["output"], f"{config}: no tables planned"


@pytest.mark.parametrize("overlay", ABLATIONS)
def test_every_ablation_plans_its_runs_on_the_paper_config(workflow_copy: Path, overlay: str):
    runs = yaml.safe_load((REPOSITORY / overlay).read_text())["rl"]["runs"]
    plan = planned(workflow_copy, ["config/paper.yaml", overlay])
    trained = plan["rl_iter"]["output"]
    for run in runs:
        assert any(f"/{run}/" in path for path in trained), f"{overlay}: no RL iteration of the run {run} planned"
