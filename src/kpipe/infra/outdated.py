"""``kpipe outdated``: which outputs are out of date, and why, in place of `snakemake --list-changes`.

Snakemake 9.27's ``--list-changes params`` (and ``code``, ``input``) lists every output of a
finished tree while ``snakemake -n`` says "Nothing to be done", so the common idiom
``snakemake -R $(snakemake --list-changes params)`` reruns everything. This command asks the
dry run, the plan Snakemake will really execute, and lists each planned job's outputs and reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import click

JOB_HEADER = re.compile(r"^(?:local)?(?:rule|checkpoint) (?P<rule>\w+):$")
JOB_FIELD = re.compile(r"^\s+(?P<name>\w+): (?P<value>.*)$")
NOTHING_TO_DO = "Nothing to be done"


@dataclass(frozen=True)
class OutdatedJob:
    rule: str
    outputs: tuple[str, ...]
    reason: str


def planned_jobs(dry_run_output: str) -> list[OutdatedJob]:
    """The jobs of a `snakemake -n` plan: each "rule NAME:" block's output and reason lines."""
    jobs: list[OutdatedJob] = []
    rule, fields = None, {}
    for line in [*dry_run_output.splitlines(), ""]:
        header = JOB_HEADER.match(line)
        field = JOB_FIELD.match(line) if rule else None
        if field:
            fields[field["name"]] = field["value"].strip()
            continue
        if rule:
            outputs = tuple(path for path in fields.get("output", "").split(", ") if path)
            jobs.append(OutdatedJob(rule, outputs, fields.get("reason", "")))
            rule, fields = None, {}
        if header:
            rule = header["rule"]
    return jobs


def dry_run(snakemake_args: tuple[str, ...]) -> str:
    """`snakemake -n` with `snakemake_args` (targets, --configfile, --config...), its whole output;
    a failing plan stops with Snakemake's own last lines."""
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", *snakemake_args], capture_output=True,
                            text=True)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise click.ClickException(f"snakemake -n failed (exit {result.returncode}):\n" + "\n".join(output.splitlines()[-20:]))
    return output


def describe(jobs: list[OutdatedJob]) -> str:
    if not jobs:
        return "nothing is out of date (snakemake -n: nothing to be done)"
    lines = [f"{len(jobs)} job(s) out of date (what `snakemake` with the same arguments would run):"]
    for job in jobs:
        lines.append(f"{job.rule}: {', '.join(job.outputs)}")
        lines.append(f"    why: {job.reason or 'not given'}")
    return "\n".join(lines)


@click.command("outdated", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("snakemake_args", nargs=-1, type=click.UNPROCESSED)
def outdated_command(snakemake_args: tuple[str, ...]) -> None:
    """List the outputs that are out of date and why: the jobs `snakemake` would run with the same
    arguments (targets, --configfile, --config), from its dry run. Run in the working directory
    of the pipeline. Use it instead of `snakemake --list-changes`, which in Snakemake 9.27 lists every
    output of a finished tree."""
    output = dry_run(snakemake_args)
    jobs = planned_jobs(output)
    if not jobs and NOTHING_TO_DO not in output:
        raise click.ClickException("snakemake -n planned jobs kpipe could not read:\n" + output[-2000:])
    click.echo(describe([job for job in jobs if job.outputs]))  # not the target rule `all`: it has none
