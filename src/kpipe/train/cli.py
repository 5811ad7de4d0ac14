"""``kpipe train``: build the tiny offline model, run SFT, run one RL iteration.

Many GPUs: ``kpipe launch --gpus N -- train sft|rl ...`` (one process per GPU, FSDP2).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import click
import yaml


@click.group()
def train() -> None:
    """Training: the tiny offline model, supervised fine-tuning and RL iterations."""


@train.command("tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--size", default="tiny", show_default=True, help="nano | tiny | small | qwen3-0.6b | qwen3-8b | qwen3-14b")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--tokenizer", type=click.Choice(["byte", "bpe"]), default="byte", show_default=True,
              help="byte: one token per byte; bpe: a BPE trained on the templates, bank kernels and references")
@click.option("--vocab-size", default=4000, show_default=True, type=int, help="BPE vocabulary size")
def tiny_model_command(out_dir: Path, size: str, seed: int, tokenizer: str, vocab_size: int) -> None:
    """Build a random-weight Qwen3 model and its tokenizer in HF format at OUT_DIR."""
    from kpipe.train.tiny_model import tiny_model_job

    tiny_model_job(out_dir, size=size, seed=seed, tokenizer=tokenizer, vocab_size=vocab_size)


def trajectory_files(paths: tuple[Path, ...]) -> list[Path]:
    """Parquet files named directly or found under directories (hive layouts)."""
    files = []
    for path in paths:
        files.extend(sorted(path.rglob("*.parquet")) if path.is_dir() else [path])
    if not files:
        raise click.UsageError("no trajectory Parquet files found")
    return files


def parse_overrides(pairs: tuple[str, ...]) -> dict:
    """`key=value` pairs, values parsed as YAML (numbers, booleans, lists)."""
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint="--set")
        values[key.strip()] = yaml.safe_load(value)
    return values


def yaml_mapping(text: str, option: str) -> dict:
    """An option's JSON/YAML mapping (`{}` for an empty one)."""
    value = yaml.safe_load(text) or {}
    if not isinstance(value, dict):
        raise click.BadParameter(f"expected a mapping, got {text!r}", param_hint=option)
    return value


def publish(source: Path, target: Path | None, *, move: bool = False) -> None:
    """Copy a finished result of the run directory to a pipeline output. Snakemake deletes the
    outputs of a killed job, so what a rerun resumes from must live in the run directory. `move`:
    what no rerun reads (the finished model) is moved, so the run directory keeps no full copy."""
    if target is None:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if move:
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(source, target)
    elif source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True)
    else:
        shutil.copy(source, target)


@train.command("sft")
@click.option("--trajectories", "-t", multiple=True, required=True, type=click.Path(exists=True, path_type=Path),
              help="trajectories Parquet file or directory (repeatable)")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="run directory: checkpoints/, model/, sft_summary.json")
@click.option("--metrics", "metrics_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="train_metrics Parquet file to write")
@click.option("--preset", type=click.Choice(["paper", "code", "offline"]), default=None,
              help="start from a documented preset")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML with an `sft:` section (or a bare mapping) overriding the preset")
@click.option("--settings", default="{}",
              help="SFTConfig values as a JSON/YAML mapping (the `sft` config section), over --config")
@click.option("--set", "overrides", multiple=True, help="key=value override, e.g. --set lr=1e-5 (repeatable)")
@click.option("--model-out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="copy the final model here when done")
@click.option("--summary-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="copy sft_summary.json here when done")
@click.option("--metrics-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="copy the --metrics file here when done (keep --metrics in the run directory: a resumed run reads it)")
def sft_command(trajectories: tuple[Path, ...], out_dir: Path, metrics_path: Path, preset: str | None,
                config_file: Path | None, settings: str, overrides: tuple[str, ...], model_out: Path | None,
                summary_out: Path | None, metrics_out: Path | None) -> None:
    """Fine-tune a causal LM on trajectory turns; an interrupted run resumes from its last checkpoint (same restart key). Several GPUs: under `kpipe launch`."""
    from accelerate import PartialState

    from kpipe.train.samples import load_trajectory_rows
    from kpipe.train.sft import SFTConfig, train_sft

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    values = {}
    if config_file is not None:
        loaded = yaml.safe_load(config_file.read_text()) or {}
        values = loaded.get("sft", loaded)
    values.update(yaml_mapping(settings, "--settings"))
    values.update(parse_overrides(overrides))
    try:
        cfg = SFTConfig.from_dict(values, preset=preset)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    rows = load_trajectory_rows(trajectory_files(trajectories))
    result = train_sft(cfg, rows, out_dir, metrics_path)
    if not PartialState().is_main_process:
        return
    publish(result.model_dir, model_out, move=True)
    publish(out_dir / "sft_summary.json", summary_out)
    publish(metrics_path, metrics_out)
    click.echo(json.dumps({"model": str(model_out or result.model_dir), "steps": result.steps,
                           "resumed_from": result.resumed_from, "final_loss": result.final_loss,
                           "samples": result.samples.as_dict()}, indent=2))


@train.command("rl")
@click.option("--queries", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="queries Parquet file: its non-contaminated queries are the prompts")
@click.option("--init-model", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="HF model to start from (the previous iteration's, or the SFT model)")
@click.option("--model-out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--trajectories", "trajectories_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="trajectories Parquet file to write (the rollouts)")
@click.option("--metrics", "metrics_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="train_metrics Parquet file to write")
@click.option("--scratch", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="partial work of the iteration (a rerun resumes from it)")
@click.option("--run", default="default", show_default=True)
@click.option("--iteration", default=0, show_default=True, type=int)
@click.option("--init-state", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="the previous iteration's optimizer state (missing: a fresh optimizer)")
@click.option("--state-out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where to write this iteration's optimizer state")
@click.option("--drop-init-state", is_flag=True, help="delete --init-state once this iteration is done")
@click.option("--settings", default="{}", help="RLConfig values as a JSON/YAML mapping (the `rl` config section)")
@click.option("--gym", "gym_settings", default="{}", help="the `gym` config section as a JSON/YAML mapping")
@click.option("--reference-model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="the KL term's reference policy (the run's SFT model); used when kl_coef > 0")
def rl_command(queries: Path, init_model: Path, model_out: Path, trajectories_path: Path, metrics_path: Path,
               scratch: Path, run: str, iteration: int, init_state: Path | None, state_out: Path | None,
               drop_init_state: bool, settings: str, gym_settings: str, reference_model: Path | None) -> None:
    """One RL iteration; rerunning resumes its unfinished work. Several GPUs: under `kpipe launch`."""
    from accelerate import PartialState

    from kpipe.train.rl import drop_optimizer_state, run_iteration, training_tasks
    from kpipe.train.rl_config import RLConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = RLConfig.from_dict(yaml_mapping(settings, "--settings"))
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    result = run_iteration(cfg, training_tasks(queries, cfg.max_prompts), init_model, model_out, trajectories_path,
                           metrics_path, scratch, run=run, iteration=iteration, init_state=init_state,
                           state_out=state_out, gym=yaml_mapping(gym_settings, "--gym"),
                           reference_model=reference_model)
    if PartialState().is_main_process:
        if drop_init_state and init_state is not None:
            drop_optimizer_state(init_state)  # the next iteration needs only this one's
        click.echo(f"RL {run} iteration {iteration}: {result.rows} turns, mean reward {result.mean_reward:.3f}, "
                   f"{result.resumed_steps} step(s) resumed -> {result.model_dir}")
