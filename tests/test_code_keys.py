"""Code keys in a real Snakemake plan (kpipe.infra.provenance.job_code_version): after an edit of a
comment or docstring, `snakemake -n` plans nothing; after a changed constant, exactly the jobs
whose rules run that code; `kpipe outdated` (kpipe.infra.outdated) lists the same, with why."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPOSITORY

pytestmark = pytest.mark.slow

# ingest (its rules run kpipe.data) and the tiny policy (train/tiny_model.py, not kpipe.data)
TARGETS = ("decontaminate", "results/models/tiny-nano-bpe4000-seed0")
INGEST_RULES = {"ingest_tasks", "ingest_queries", "decontaminate"}
OUTDATED = ("kpipe.cli", "outdated")  # `kpipe outdated`, in place of Snakemake 9.27's --list-changes


def snakemake(workdir: Path, *args: str, kpipe: Path | None = None, command: tuple[str, ...] = ("snakemake",)) -> str:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    if kpipe:
        env["PYTHONPATH"] = str(kpipe)
    result = subprocess.run([sys.executable, "-m", *command, *TARGETS, "--cores", "2", *args], cwd=workdir,
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout + result.stderr


def planned_rules(output: str) -> set[str]:
    """The rules of a dry run's plan (its "rule NAME:" lines)."""
    return set(re.findall(r"^(?:local)?rule (\w+):", output, re.MULTILINE))


def edited_kpipe(tmp_path: Path, module: str, old: str, new: str) -> Path:
    """A copy of kpipe with `old` replaced by `new` in `module`, for PYTHONPATH."""
    edited = tmp_path / "src"
    shutil.rmtree(edited, ignore_errors=True)
    shutil.copytree(Path(__import__("kpipe").__file__).parent, edited / "kpipe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = edited / "kpipe" / module
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))
    return edited


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("keys")
    shutil.copytree(REPOSITORY / "workflow", work / "workflow")
    shutil.copytree(REPOSITORY / "config", work / "config")
    snakemake(work)
    assert "Nothing to be done" in snakemake(work, "-n")
    return work


def test_a_docstring_and_comment_edit_plans_nothing(finished, tmp_path):
    edited = edited_kpipe(tmp_path, "data/decontam.py", '"""Decontamination: training queries',
                          '# an added comment\n"""Decontamination (reworded): training queries')
    assert "Nothing to be done" in snakemake(finished, "-n", kpipe=edited)
    assert snakemake(finished, kpipe=edited, command=OUTDATED).strip() == "nothing is out of date (snakemake -n: nothing to be done)"


def test_a_changed_constant_plans_exactly_its_dependants(finished, tmp_path):
    data = edited_kpipe(tmp_path, "data/decontam.py", "SHINGLE_SIZE = 5", "SHINGLE_SIZE = 6")
    assert planned_rules(snakemake(finished, "-n", kpipe=data)) == INGEST_RULES
    listed = snakemake(finished, kpipe=data, command=OUTDATED).splitlines()
    assert listed[0].startswith("3 job(s) out of date")
    assert {line.split(":")[0] for line in listed[1::2]} == INGEST_RULES
    assert "/queries.parquet" in "\n".join(listed)
    why = dict(zip((line.split(":")[0] for line in listed[1::2]), listed[2::2]))
    assert why["ingest_tasks"].startswith("    why: Params have changed since last execution"), listed
    tiny = edited_kpipe(tmp_path, "train/tiny_model.py", "SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)",
                        "SPECIAL_TOKENS = (ENDOFTEXT, IM_END, IM_START)")
    assert planned_rules(snakemake(finished, "-n", kpipe=tiny)) == {"tiny_model"}


def test_the_dry_run_parser_reads_each_job_and_leaves_out_none():
    from kpipe.infra.outdated import OutdatedJob, planned_jobs

    plan = ("[Mon Dec  7 02:16:26 2026]\nrule decontaminate:\n    input: a, b\n    output: q.parquet, d.json\n"
            "    jobid: 0\n    reason: Params have changed since last execution\n    priority: 10\n"
            "Shell command: None\n\nlocalrule all:\n    input: q.parquet\n    jobid: 1\n"
            "    reason: Input files updated by another job: q.parquet\n")
    assert planned_jobs(plan) == [OutdatedJob("decontaminate", ("q.parquet", "d.json"),
                                              "Params have changed since last execution"),
                                  OutdatedJob("all", (), "Input files updated by another job: q.parquet")]
