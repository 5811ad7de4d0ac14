"""``kpipe train tiny-model``: build the tiny offline policy. SFT and RL run as the DAG's jobs
(rules `sft`, `rl_iter`: :func:`kpipe.train.sft.sft_job`, :func:`kpipe.train.rl.rl_job`)."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def train() -> None:
    """Training tools: the tiny offline model (SFT and RL run as the DAG's jobs)."""


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
