"""`kpipe agent ...`: cold-start distillation shards and the released cold-start data."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click
import yaml


def load_settings(path: str | None) -> dict[str, Any]:
    """The `distill` config section from a YAML/JSON file (the whole config, or just the section)."""
    if path is None:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: expected a mapping")
    return data.get("distill", data)


@click.group()
def agent() -> None:
    """The multi-turn agent loop: distillation of cold-start trajectories."""


@agent.command("distill")
@click.option("--queries", required=True, type=click.Path(exists=True, dir_okay=False), help="queries Parquet.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="trajectories Parquet to write.")
@click.option("--cache", type=click.Path(dir_okay=False), help="Response cache (default: <out>.cache.jsonl).")
@click.option("--settings", type=click.Path(exists=True, dir_okay=False),
              help="YAML/JSON with the `distill` config section (or a whole config file).")
@click.option("--gym", "gym_file", type=click.Path(exists=True, dir_okay=False),
              help="YAML/JSON with the `gym` config section (protocol, backend, workers, cache).")
@click.option("--shard", default=0, show_default=True)
@click.option("--num-shards", default=1, show_default=True)
@click.option("--run", "run_name", default="default", show_default=True)
@click.option("--teacher", type=click.Choice(["offline", "api"]), help="Overrides distill.teacher.")
@click.option("--model", help="API model name (overrides distill.engine.model).")
@click.option("--base-url", help="API endpoint (overrides distill.engine.base_url).")
@click.option("--turns", type=int, help="Overrides distill.turns.")
@click.option("--max-queries", type=int, help="Overrides distill.max_queries.")
def distill(queries: str, out: str, cache: str | None, settings: str | None, gym_file: str | None, shard: int,
            num_shards: int, run_name: str, teacher: str | None, model: str | None, base_url: str | None,
            turns: int | None, max_queries: int | None) -> None:
    """Distill multi-turn trajectories for one shard of queries (resumable through --cache)."""
    from kpipe.agent.distill import distill_job

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    section = load_settings(settings)
    overrides = {"teacher": teacher, "turns": turns, "max_queries": max_queries}
    section.update({k: v for k, v in overrides.items() if v is not None})
    engine = dict(section.get("engine", {}))
    engine.update({k: v for k, v in {"model": model, "base_url": base_url}.items() if v is not None})
    section["engine"] = engine
    if section.get("teacher", "offline") == "api" and "model" not in engine:
        raise click.UsageError("an API teacher needs a model: --model or distill.engine.model")
    gym = yaml.safe_load(Path(gym_file).read_text()) if gym_file else None
    distill_job(queries, out, cache or f"{out}.cache.jsonl", section, shard=shard, num_shards=num_shards,
                run=run_name, gym=gym)  # logs the per-turn summary table


@agent.command("convert-coldstart")
@click.argument("source", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="trajectories Parquet to write.")
@click.option("--run", "run_name", default="released", show_default=True)
def convert_coldstart(source: str, out: str, run_name: str) -> None:
    """Turn the released hkust-nlp/drkernel-coldstart-8k Parquet into trajectories rows."""
    from kpipe.agent.distill import released_coldstart_rows
    from kpipe.data.io import write_table

    rows = released_coldstart_rows(source, run=run_name)
    write_table(rows, out, "trajectories")
    click.echo(f"{len(rows)} turns -> {out}")
