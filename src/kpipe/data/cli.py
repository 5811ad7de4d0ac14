"""``kpipe data``: build the evaluation tasks and the training queries outside Snakemake."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

from kpipe.data.ingest import build_queries, build_tasks
from kpipe.data.io import read_table, write_table
from kpipe.data.kernelbench import LEVELS, VERSIONS
from kpipe.data.sources import KERNELBENCH_DESCRIPTION, KINDS, SourceError, schema_problems


def parse_ids(values: tuple[str, ...]) -> dict[str, list[int]]:
    """``1:19,23`` options as config ids ``{"level_1": [19, 23]}``."""
    ids: dict[str, list[int]] = {}
    for value in values:
        level, _, numbers = value.partition(":")
        try:
            ids[f"level_{int(level)}"] = [int(n) for n in numbers.split(",") if n]
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected LEVEL:ID,ID,... (e.g. 1:19,23)") from None
    return ids


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def data() -> None:
    """Evaluation tasks (KernelBench) and training queries (cudaLLM, Dr. Kernel, KernelBook)."""


@data.command()
@click.option("--version", type=click.Choice(sorted(VERSIONS)), default="main", show_default=True,
              help="KernelBench problem set (main = v0.1 sizes).")
@click.option("--levels", type=click.Choice([str(level) for level in LEVELS]), multiple=True, default=("1", "2", "3"),
              show_default=True, help="Levels to keep (repeat the option).")
@click.option("--ids", multiple=True, metavar="LEVEL:ID,ID", help="Problem ids kept in a level, e.g. 1:19,23 (repeat).")
@click.option("--size-cap", type=click.IntRange(min=8), default=None,
              help="Cap every module-level size constant (fast CPU runs); default: the problems' own sizes.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Parquet file to write.")
def tasks(version: str, levels: tuple[str, ...], ids: tuple[str, ...], size_cap: int | None, out: Path) -> None:
    """Select evaluation tasks from the vendored KernelBench sets into a tasks table."""
    levels_chosen = [int(level) for level in levels]
    config = {"version": version, "levels": levels_chosen, "ids": parse_ids(ids), "size_cap": size_cap}
    try:
        table = build_tasks(config)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    write_table(table, out, "tasks")
    click.echo(f"{table.num_rows} tasks -> {out}")


@data.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="YAML file whose `queries:` section names the sources and the decontamination settings.")
@click.option("--tasks", "tasks_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="tasks Parquet file (from `kpipe data tasks`) to decontaminate against.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Parquet file to write.")
@click.option("--counts", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the per-source and decontamination counts as JSON.")
def queries(config_path: Path, tasks_path: Path, out: Path, counts: Path | None) -> None:
    """Load, normalise and decontaminate the training queries of a config's `queries:` section."""
    section = (yaml.safe_load(config_path.read_text()) or {}).get("queries")
    if not section:
        raise click.ClickException(f"{config_path}: no `queries:` section")
    try:
        table, tally = build_queries(section, read_table(tasks_path, "tasks"))
    except (SourceError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    write_table(table, out, "queries")
    if counts:
        counts.write_text(json.dumps(tally, indent=2))
    click.echo(json.dumps(tally))
    click.echo(f"{table.num_rows} queries -> {out}")


@data.command("show-sources")
@click.option("--check", "check_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="Also check that this local file/directory has the columns of --kind.")
@click.option("--kind", type=click.Choice(sorted(KINDS)), default=None, help="Kind to check --check against.")
def show_sources(check_path: Path | None, kind: str | None) -> None:
    """List the query-source kinds, their hub ids and required columns; optionally check a file."""
    if check_path is not None:
        if kind is None:
            raise click.UsageError("--check needs --kind")
        from kpipe.data.sources import read_local

        try:
            table = read_local(check_path, f"{kind} file")
        except SourceError as error:
            raise click.ClickException(str(error)) from None
        problems = schema_problems(table.schema, KINDS[kind].columns)
        if problems:
            raise click.ClickException(f"{check_path}: not in the {kind} schema: {'; '.join(problems)}")
        click.echo(f"{check_path}: {table.num_rows} rows in the {kind} schema")
        return
    click.echo(f"kernelbench  (vendored)  {KERNELBENCH_DESCRIPTION}")
    for source in KINDS.values():
        hub = f"{source.hub_id}/{source.hub_file}" if source.hub_file else source.hub_id
        click.echo(f"{source.kind}  (hub: {hub})  {source.description}")
        for column in source.columns:
            need = "required" if column.required else "optional"
            click.echo(f"    {column.path}: {column.expected} ({need})")
