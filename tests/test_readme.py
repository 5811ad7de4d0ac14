"""README.md is a user's guide: at most 1,500 words, no commit hashes (history is git's and
CHANGELOG.md's, measured figures docs/performance.md's), and the commands it shows run: every shell
block parses (`bash -n`), every `snakemake` command takes only Snakemake's options, and the ones that
plan (`-n`) plan in a scratch copy of the workflow."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_WORDS = 1500
# 7 to 40 hex digits with a digit and a letter among them: a commit, not a number or an English word
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)


def shell_blocks(text: str) -> list[str]:
    return SHELL_BLOCK.findall(text)


def snakemake_commands(text: str) -> list[list[str]]:
    """Each `snakemake ...` command of the shell blocks as its arguments, `$(nproc)` read as 2."""
    commands = []
    for block in shell_blocks(text):
        for line in block.splitlines():
            words = shlex.split(line.replace("$(nproc)", "2"), comments=True)
            if words and words[0].endswith("snakemake"):
                commands.append(words[1:])
    return commands


def test_the_readme_is_short_and_names_no_commit() -> None:
    text = README.read_text()
    assert len(text.split()) <= MAX_WORDS, f"README.md has {len(text.split())} words (at most {MAX_WORDS})"
    assert COMMIT.findall(text) == [], "README.md names commits: history goes to CHANGELOG.md and git"
    assert COMMIT.findall("at 1dfced6 and a4bfa06") == ["1dfced6", "a4bfa06"]
    assert COMMIT.findall("1500000 words, defaced, 0xff") == []


def test_every_shell_block_parses() -> None:
    blocks = shell_blocks(README.read_text())
    assert len(blocks) >= 3
    for block in blocks:
        done = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert done.returncode == 0, f"{done.stderr}\nin:\n{block}"
    assert subprocess.run(["bash", "-n"], input="make run &&\n", capture_output=True, text=True).returncode != 0


def test_every_snakemake_command_takes_snakemakes_options() -> None:
    from snakemake.cli import get_argument_parser

    commands = snakemake_commands(README.read_text())
    assert any("-n" in command for command in commands) and any("--configfile" in command for command in commands)
    parser = get_argument_parser()
    for command in commands:
        try:
            parser.parse_args(command)
        except SystemExit:
            pytest.fail(f"snakemake {shlex.join(command)}: not Snakemake's options")


@pytest.mark.slow
def test_the_dry_runs_shown_plan(workflow_copy: Path) -> None:
    """At most two of the README's `snakemake -n` commands, in a scratch copy (a plan takes seconds)."""
    dry_runs = [command for command in snakemake_commands(README.read_text()) if "-n" in command][:2]
    assert dry_runs
    for command in dry_runs:
        done = subprocess.run([sys.executable, "-m", "snakemake", *command], cwd=workflow_copy,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and "Job stats:" in done.stdout, (
            f"snakemake {shlex.join(command)}:\n{(done.stdout + done.stderr)[-3000:]}")


DOCS = README.parent / "docs"


@pytest.mark.parametrize("path", sorted(path.name for path in DOCS.glob("*.md")))
def test_no_guide_names_a_commit(path: str) -> None:
    """Run histories and the commits behind them live in git, CHANGELOG.md and docs/gpu-results/ledger."""
    found = COMMIT.findall((DOCS / path).read_text())
    assert not found, f"docs/{path} names commits: {found[:10]}"


def where_things_are() -> str:
    text = README.read_text()
    start = text.index("## Where things are")
    return text[start:text.index("\n## ", start + 1)]


def test_where_things_are_names_only_modules_and_files_that_exist() -> None:
    table = where_things_are()
    modules = set(re.findall(r"`(kpipe(?:\.\w+)+)`", table))
    paths = set(re.findall(r"`((?:workflow|src|config)/[^`]+)`", table))
    assert {"kpipe.train.algos", "kpipe.train.rl", "kpipe.gym.judge.evaluation", "kpipe.report.tables"} <= modules
    source = README.parent / "src"
    for module in modules:
        base = source.joinpath(*module.split("."))
        assert base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), f"README names {module}: no such module"
    for path in paths:
        pattern = path.replace("<rule>", "*")
        assert list(README.parent.glob(pattern)), f"README names {path}: nothing there"


def test_the_extending_section_names_registries_that_exist() -> None:
    from kpipe.train import algos

    text = README.read_text()
    for name in re.findall(r"`@(register_\w+)\(", text):
        assert callable(getattr(algos, name, None)), f"README names algos.{name}: it does not exist"
    assert "@register_advantage(" in text and "@register_reward(" in text
