"""Rule -> code in one hop: every rule runs workflow/scripts/<rule>.py, which runs the one library
function the rule's docstring names through the one job wrapper (kpipe.infra.jobs.run_job), and
docs/architecture.md's table of it (scripts/rule_map.py) is current."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


def _load_rule_map():
    spec = importlib.util.spec_from_file_location("rule_map", REPOSITORY / "scripts" / "rule_map.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["rule_map"] = module
    spec.loader.exec_module(module)
    return module


rule_map = _load_rule_map()


def test_every_rule_runs_its_script_which_runs_the_named_function_through_the_wrapper() -> None:
    rules = rule_map.parse_rules()
    assert {"ingest_tasks", "distill", "coldstart_released", "tiny_model", "sft", "rl_iter", "eval", "viewer"} <= {
        rule.name for rule in rules}
    assert rule_map.problems(rules) == []


def test_the_architecture_table_is_generated_from_the_rules() -> None:
    assert rule_map.DOC == REPOSITORY / "docs" / "architecture.md"
    assert rule_map.table_block(rule_map.DOC.read_text()) == rule_map.table(rule_map.parse_rules()), (
        "docs/architecture.md's rule table is stale: python scripts/rule_map.py --write")


@pytest.fixture
def scratch_repository(tmp_path: Path) -> Path:
    """A minimal repository: one module with four rules, their scripts and a library module."""
    (tmp_path / "workflow" / "rules").mkdir(parents=True)
    (tmp_path / "workflow" / "scripts").mkdir()
    (tmp_path / "src" / "kpipe" / "data").mkdir(parents=True)
    (tmp_path / "workflow" / "Snakefile").write_text('include: "rules/common.smk"\ninclude: "rules/stage.smk"\n')
    (tmp_path / "workflow" / "rules" / "common.smk").write_text("def helper():\n    return 1\n")
    (tmp_path / "workflow" / "rules" / "stage.smk").write_text('''
rule good:
    """kpipe.data.stage.good_job: fine."""
    output:
        "a",
    script:
        "../scripts/good.py"


if True:

    rule shelled:
        """kpipe.data.stage.good_job: a shell rule."""
        output:
            "b",
        shell:
            "kpipe something > {log}"

else:

    rule wrong_call:
        """kpipe.data.stage.missing_job: names a function that does not exist."""
        output:
            "c",
        script:
            "../scripts/wrong_call.py"


rule unwrapped:
    """kpipe.data.stage.good_job: called without the job wrapper."""
    output:
        "d",
    script:
        "../scripts/unwrapped.py"
''')
    (tmp_path / "src" / "kpipe" / "data" / "stage.py").write_text("def good_job(path):\n    return path\n")
    (tmp_path / "workflow" / "scripts" / "good.py").write_text(
        "from kpipe.data.stage import good_job\nfrom kpipe.infra.jobs import run_job\n\n"
        "run_job(snakemake, good_job, snakemake.output[0])\n")
    (tmp_path / "workflow" / "scripts" / "unwrapped.py").write_text(
        "from kpipe.data.stage import good_job\n\ngood_job(snakemake.output[0])\n")
    (tmp_path / "workflow" / "scripts" / "wrong_call.py").write_text(
        "from kpipe.data.stage import good_job\nfrom kpipe.data.io import write_table\n\n"
        "write_table(good_job(snakemake.output[0]))\n")
    (tmp_path / "workflow" / "scripts" / "orphan.py").write_text("")
    return tmp_path


def test_the_check_names_each_broken_rule(scratch_repository: Path) -> None:
    rules = rule_map.parse_rules(scratch_repository / "workflow")
    assert [(rule.name, rule.script, rule.function) for rule in rules] == [
        ("good", "workflow/scripts/good.py", "kpipe.data.stage.good_job"),
        ("shelled", None, "kpipe.data.stage.good_job"),
        ("wrong_call", "workflow/scripts/wrong_call.py", "kpipe.data.stage.missing_job"),
        ("unwrapped", "workflow/scripts/unwrapped.py", "kpipe.data.stage.good_job"),
    ]
    found = rule_map.problems(rules, scratch_repository)
    assert not [line for line in found if "rule good " in line]
    assert any("rule shelled" in line and "`shell:`" in line for line in found)
    assert any("rule shelled" in line and "script is missing" in line for line in found)
    assert any("rule wrong_call" in line and "defines no function missing_job" in line for line in found)
    assert any("rule wrong_call" in line and "does not run kpipe.data.stage.missing_job" in line for line in found)
    assert any("rule unwrapped" in line and "through kpipe.infra.jobs.run_job(snakemake, good_job, ...)" in line
               for line in found)
    assert any("imports more of kpipe" in line and "kpipe.data.io.write_table" in line for line in found)
    assert "workflow/scripts/orphan.py: no rule runs it" in found


def test_a_stale_table_is_rewritten_between_the_markers() -> None:
    rules = rule_map.parse_rules()
    document = f"# x\n\n{rule_map.BEGIN}\n| old |\n{rule_map.END}\n\nafter\n"
    assert rule_map.table_block(document) != rule_map.table(rules)
    updated = rule_map.with_table(document, rules)
    assert rule_map.table_block(updated) == rule_map.table(rules)
    assert updated.startswith("# x\n\n") and updated.endswith("\n\nafter\n")


def test_the_shared_rule_module_stays_short_and_the_input_functions_hold_no_rules() -> None:
    """rules/common.smk holds what every stage shares (config, resources, the run's services) in at
    most 150 lines; each stage's paths and input functions sit in rules/inputs.smk, which defines no
    rule (Snakemake's lint wants functions and rules apart), and the rule modules define no function."""
    rules = Path(__file__).resolve().parents[1] / "workflow" / "rules"
    assert len((rules / "common.smk").read_text().splitlines()) <= 150
    assert "\nrule " not in (rules / "inputs.smk").read_text()
    for path in rules.glob("*.smk"):
        if path.name not in ("common.smk", "inputs.smk"):
            assert "\ndef " not in path.read_text(), path.name
