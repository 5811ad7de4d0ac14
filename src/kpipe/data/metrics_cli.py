"""``kpipe metrics``: the evaluation metrics of a set of trajectories, without building the
database — for a quick look at an evaluation shard, an RL iteration's rollouts, or results
someone sent you."""

from __future__ import annotations

from pathlib import Path

import click
import pandas as pd
from tabulate import tabulate

from kpipe.data import metrics as kpipe_metrics
from kpipe.data.io import read_table

SPEEDUP_COLUMNS = {"eager": "speedup_eager", "compile": "speedup_compile"}


def parquet_files(paths: tuple[str, ...]) -> list[Path]:
    """The Parquet files named, a directory standing for every Parquet file below it."""
    files: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise click.UsageError(f"no such file or directory: {path}")
        files.extend(sorted(path.rglob("*.parquet")) if path.is_dir() else [path])
    if not files:
        raise click.UsageError(f"no Parquet files under {', '.join(paths)}")
    return files


def rates_by_turn(frame: pd.DataFrame) -> pd.DataFrame:
    """Correctness, hacking and compile rates of the samples that reached each turn."""
    rows = []
    for turn, at_turn in frame.groupby("turn"):
        rows.append({
            "turn": turn,
            "samples": len(at_turn),
            "correct": kpipe_metrics.correct_rate(at_turn["correct"], at_turn["hacked"]),
            "hacked": kpipe_metrics.hacking_ratio(at_turn["hacked"]),
            "compiled": kpipe_metrics.compile_rate(at_turn["status"]),
        })
    return pd.DataFrame(rows)


def fast_p_table(frame: pd.DataFrame, ps: tuple[float, ...], speedup_col: str, history: bool, strict: bool,
                 n_boot: int) -> pd.DataFrame:
    """Fast@p per turn as percentages, with a task-bootstrap 95% interval when n_boot > 0."""
    table = kpipe_metrics.fast_p_by_turn(frame, ps, speedup_col, history=history, strict=strict)
    for p in ps:
        column = f"fast@{p:g}"
        cells = []
        for turn, value in zip(table["turn"], table[column]):
            cell = f"{100 * value:.1f}"
            if n_boot:
                ci = kpipe_metrics.fast_p_ci(frame, p, turn, speedup_col, history, strict, n_boot=n_boot)
                cell += f" [{100 * ci.low:.1f}, {100 * ci.high:.1f}]"
            cells.append(cell)
        table[column] = cells
    return table


@click.group()
def metrics() -> None:
    """Evaluation metrics of trajectories (Fast@p, best-of-history, hacking ratio)."""


@metrics.command("summary")
@click.argument("paths", nargs=-1, required=True)
@click.option("--baseline", type=click.Choice(sorted(SPEEDUP_COLUMNS)), default="eager", show_default=True,
              help="Speedup against eager PyTorch or torch.compile.")
@click.option("-p", "ps", type=float, multiple=True, default=kpipe_metrics.FAST_P_THRESHOLDS, show_default=True,
              help="Fast@p thresholds (repeat the option).")
@click.option("--strict", is_flag=True, help="KernelBench's speedup > p instead of the paper's >= p.")
@click.option("--n-boot", type=int, default=0, show_default=True,
              help="Bootstrap replicates (resampling tasks) for 95% intervals; 0 for none.")
@click.option("--stage", default=None, help="Only rows of this stage (coldstart | rl | eval | stts | rl_val).")
def summary(paths: tuple[str, ...], baseline: str, ps: tuple[float, ...], strict: bool, n_boot: int,
            stage: str | None) -> None:
    """Print per-turn rates and Fast@p (last turn and best-of-history) of trajectories in PATHS."""
    frame = read_table(parquet_files(paths), "trajectories").to_pandas()
    if stage is not None:
        frame = frame[frame["stage"] == stage]
    if frame.empty:
        raise click.UsageError("no trajectory rows to summarise")
    speedup_col = SPEEDUP_COLUMNS[baseline]
    comparison = ">" if strict else ">="
    click.echo(f"{frame['task_id'].nunique()} tasks, {len(frame)} turns; "
               f"Fast@p = correct, not hacked, speedup vs {baseline} {comparison} p (% of trajectories)\n")
    click.echo(tabulate(rates_by_turn(frame).to_dict("records"), headers="keys", tablefmt="github",
                        floatfmt=".3f"))
    for title, history in (("Fast@p at turn t", False), ("Fast@p, best of turns <= t", True)):
        table = fast_p_table(frame, ps, speedup_col, history, strict, n_boot)
        click.echo(f"\n{title}\n" + tabulate(table.to_dict("records"), headers="keys", tablefmt="github"))
