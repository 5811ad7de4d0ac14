"""`kpipe eval kernelbench` / `kpipe eval stts`: the evaluation stages outside Snakemake (e.g. a
released checkpoint or an API model), over the same jobs the rules run (`kpipe.evaluate.kernelbench`,
`kpipe.evaluate.stts`). A command-line module: it sits above both, so neither imports the other's CLI."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import click

from kpipe.evaluate.kernelbench import PAPER_EVAL, check_model, eval_job

def _load_yaml(path: str | None) -> dict[str, Any]:
    import yaml

    if path is None:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: expected a mapping")
    return data


def _model_entry(model_spec: str) -> dict[str, Any]:
    """`--model` as name=kind:target, e.g. drk14b=hf:/ckpt/drkernel-14b or gpt5=openai:gpt-5."""
    match = re.match(r"^([^=]+)=(hf|vllm|openai|offline_teacher)(?::(.+))?$", model_spec)
    if not match:
        raise click.BadParameter(f"--model {model_spec!r}: expected NAME=hf:PATH, NAME=vllm:PATH, "
                                 "NAME=openai:MODEL or NAME=offline_teacher")
    name, kind, target = match.groups()
    entry: dict[str, Any] = {"name": name, "kind": kind}
    if kind in ("hf", "vllm"):
        entry["path"] = target
    elif kind == "openai":
        entry["model"] = target
    try:
        check_model(entry)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return entry


def _common_options(command: Any) -> Any:
    options = [
        click.option("--tasks", required=True, type=click.Path(exists=True, dir_okay=False), help="tasks Parquet."),
        click.option("--out", required=True, type=click.Path(dir_okay=False), help="trajectories Parquet to write."),
        click.option("--model", "model_spec", required=True,
                     help="NAME=hf:PATH | NAME=vllm:PATH | NAME=openai:MODEL | NAME=offline_teacher"),
        click.option("--base-url", help="Endpoint of an openai model."),
        click.option("--level", type=click.IntRange(1, 3), required=True),
        click.option("--settings", type=click.Path(exists=True, dir_okay=False),
                     help="YAML with the eval/stts section (or a whole config)."),
        click.option("--gym", "gym_file", type=click.Path(exists=True, dir_okay=False),
                     help="YAML of the `gym` config section (protocol, backend, workers, cache)."),
        click.option("--run", "run_name", default="default", show_default=True),
        click.option("--paper", is_flag=True, help="The paper's settings: 8 samples, 3 turns, 8,192 tokens per turn."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.group("eval")
def eval_cli() -> None:
    """KernelBench evaluation and sequential test-time scaling of any model."""


@eval_cli.command("kernelbench")
@_common_options
@click.option("--samples", type=int, help="Overrides eval.samples.")
@click.option("--turns", type=int, help="Overrides eval.turns.")
def kernelbench_command(tasks: str, out: str, model_spec: str, base_url: str | None, level: int, settings: str | None,
                        gym_file: str | None, run_name: str, paper: bool, samples: int | None,
                        turns: int | None) -> None:
    """Evaluate a model on one KernelBench level (stage=eval rows in --out)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    section = {**(PAPER_EVAL if paper else {}), **_load_yaml(settings).get("eval", _load_yaml(settings))}
    section.update({k: v for k, v in {"samples": samples, "turns": turns}.items() if v is not None})
    entry = _model_entry(model_spec) | ({"base_url": base_url} if base_url else {})
    eval_job(tasks, out, f"{out}.cache.jsonl", entry, section, level=level, run=run_name,
             gym=_load_yaml(gym_file) or None)


@eval_cli.command("stts")
@_common_options
@click.option("--strategy", type=click.Choice(["full", "top_w", "best_window"]), default="top_w", show_default=True)
@click.option("--window", "w", type=int, default=4, show_default=True)
@click.option("--max-turns", type=int, help="Overrides stts.max_turns.")
def stts_command(tasks: str, out: str, model_spec: str, base_url: str | None, level: int, settings: str | None,
                 gym_file: str | None, run_name: str, paper: bool, strategy: str, w: int,
                 max_turns: int | None) -> None:
    """Sequential test-time scaling of a model on one KernelBench level (stage=stts rows in --out)."""
    from kpipe.evaluate.stts import stts_job

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    section = {**(PAPER_EVAL if paper else {}), **_load_yaml(settings).get("stts", _load_yaml(settings))}
    section.update({"window": w, **({"max_turns": max_turns} if max_turns else {})})
    entry = _model_entry(model_spec) | ({"base_url": base_url} if base_url else {})
    stts_job(tasks, out, f"{out}.cache.jsonl", entry, section, strategy=strategy, level=level, run=run_name,
             gym=_load_yaml(gym_file) or None)
