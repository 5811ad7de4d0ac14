"""The paper's figures as PNG (matplotlib), from the same SQL as the tables:

- Figure 4: Fast@1 over RL training steps (as the RL stage logs it), one line per run;
- Figure 5: Fast@1.2 at the last turn (left) and entropy (right) over training steps;
- Figure 6: STTS, Fast@1.2 of the last turn (left) and best of history (right) vs turns T;
- Figure 7: training dynamics: entropy, gradient norm, rollout and trainer perplexity;
- Figure 8: hacking ratio over RL iterations (from the rollouts' hacked flags);
- RL validation (the paper's Figures 4 and 5 left, and 8, measured as the paper does): Fast@1,
  Fast@1.2, pass rate and hacking ratio of each validated iteration's checkpoint on the
  validation tasks vs training step, one line per run (workflow/sql/rl_validation.sql).

Training metrics are found by name (`train_metrics.name`, normalised to lower case with every
non-alphanumeric run as "_"), so a figure shows whatever the RL stage logs under any of the
usual spellings (e.g. "val/fast@1.2_turn3", "fast_1.2"). A panel with no data says so in the
image instead of failing: a run without RL still gets its report.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pandas as pd

from kpipe.tables import DEFAULT_SQL_DIR, run_table_sql

# panel title -> pattern over normalised metric names
FIGURE_PANELS: dict[str, dict[str, str]] = {
    "fig4_fast1_training": {"Fast@1 during RL": r"fast_?1(?:_turn_?\d+)?$"},
    "fig5_fast12_entropy": {"Fast@1.2 during RL": r"fast_?1_2(?:_turn_?\d+)?$", "Entropy": r"(?:^|_)entropy$"},
    "fig7_training_dynamics": {
        "Entropy": r"(?:^|_)entropy$",
        "Gradient norm": r"(?:^|_)grad_?norm$",
        "Rollout (vLLM) perplexity": r"(?:rollout|vllm|infer\w*)_ppl|ppl_(?:rollout|vllm)",
        "Trainer (FSDP) perplexity": r"(?:train\w*|fsdp)_ppl|ppl_(?:train|fsdp)",
    },
}
TRAINING_STAGES = ("rl", "val")
# panel title -> column of rl_validation.sql (percentages)
VALIDATION_PANELS = {"Fast@1, last turn": "fast_1", "Fast@1.2, last turn": "fast_1_2",
                     "Pass rate, last turn": "pass_rate", "Hacking ratio, all turns": "hacking_ratio"}
FIGURE_NAMES = tuple(sorted([*FIGURE_PANELS, "fig6_stts", "fig8_hacking_ratio", "fig_rl_validation"]))


def normalised(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def matching_series(curves: pd.DataFrame, pattern: str) -> pd.DataFrame:
    """Rows of the RL / validation metrics whose normalised name matches `pattern`."""
    if curves.empty:
        return curves
    names = curves["name"].map(normalised)
    return curves[curves["stage"].isin(TRAINING_STAGES) & names.str.contains(pattern, regex=True)]


def _empty_panel(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes, color="gray")


def _figure(n_panels: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n_panels, figsize=(4.5 * n_panels, 3.6), squeeze=False)
    return plt, fig, list(axes[0])


def _percent_axes(ax, values: pd.Series) -> None:
    """Percentages from 0 (a flat zero line stays readable) and whole-number turns/iterations."""
    from matplotlib.ticker import MaxNLocator

    top = float(values.max()) if len(values) else 0.0
    ax.set_ylim(0, max(5.0, 1.1 * top))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def training_figure(curves: pd.DataFrame, panels: dict[str, str], path: Path) -> Path:
    """One panel per metric pattern, one line per (run, metric name), x = training step."""
    plt, fig, axes = _figure(len(panels))
    for ax, (title, pattern) in zip(axes, panels.items()):
        series = matching_series(curves, pattern)
        for (run, name), line in series.groupby(["run", "name"]):
            line = line.sort_values(["iteration", "step"])
            ax.plot(line["step"], line["value"], marker=".", label=f"{run}: {name}")
        if series.empty:
            _empty_panel(ax, title)
        else:
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("training step")
    return _save(plt, fig, path)


def stts_figure(stts: pd.DataFrame, path: Path) -> Path:
    """Figure 6: Fast@1.2 vs T, last turn (left) and best of history (right)."""
    plt, fig, axes = _figure(2)
    for ax, (history, title) in zip(axes, (("last", "Last turn"), ("best", "Best of history"))):
        part = stts[stts["history"] == history] if not stts.empty else stts
        for (model, strategy, level), line in part.groupby(["model", "strategy", "level"]):
            ax.plot(line["T"], line["fast_1_2"], marker="o", label=f"{model} {strategy} L{level}")
        if part.empty:
            _empty_panel(ax, "STTS rows")
        else:
            ax.legend(fontsize=7)
        _percent_axes(ax, part["fast_1_2"] if not part.empty else pd.Series(dtype=float))
        ax.set_title(f"STTS: {title} Fast@1.2")
        ax.set_xlabel("turns T")
        ax.set_ylabel("Fast@1.2 (%)")
    return _save(plt, fig, path)


def hacking_figure(hacking: pd.DataFrame, path: Path) -> Path:
    """Figure 8: hacking ratio of the RL rollouts per iteration, per run and level."""
    plt, fig, axes = _figure(1)
    ax = axes[0]
    rl = hacking[hacking["stage"] == "rl"] if not hacking.empty else hacking
    for (run, level), line in rl.groupby(["run", "level"], dropna=False):
        ax.plot(line["iteration"], line["hacking_ratio"], marker="o", label=f"{run} L{level}")
    if rl.empty:
        _empty_panel(ax, "RL rollouts")
    else:
        ax.legend(fontsize=7)
    _percent_axes(ax, rl["hacking_ratio"] if not rl.empty else pd.Series(dtype=float))
    ax.set_title("Hacking ratio during RL")
    ax.set_xlabel("RL iteration")
    ax.set_ylabel("hacked samples (%)")
    return _save(plt, fig, path)


def validation_figure(validation: pd.DataFrame, path: Path) -> Path:
    """The RL validation curves: one panel per metric, one line per (run, level), x = the training
    step at the end of each validated iteration (the RL iteration where no step was logged)."""
    plt, fig, axes = _figure(len(VALIDATION_PANELS))
    by_step = not validation.empty and bool(validation["step"].notna().all())
    x = "step" if by_step else "iteration"
    for ax, (title, column) in zip(axes, VALIDATION_PANELS.items()):
        for (run, level), line in validation.groupby(["run", "level"], dropna=False):
            line = line.sort_values("iteration")
            ax.plot(line[x], line[column], marker="o", label=f"{run} L{level}")
        if validation.empty:
            _empty_panel(ax, "RL validation rows")
        else:
            ax.legend(fontsize=7)
        _percent_axes(ax, validation[column])
        ax.set_title(f"Validation: {title}")
        ax.set_xlabel("training step" if by_step else "RL iteration")
        ax.set_ylabel("%")
    return _save(plt, fig, path)


def build_figures(db_path: Path, out_dir: Path, sql_dir: Path = DEFAULT_SQL_DIR) -> dict[str, Path]:
    """Every figure as `out_dir/<name>.png`; returns name -> path."""
    if not Path(db_path).exists():
        raise FileNotFoundError(f"no database at {db_path}: build it first (kpipe query --rebuild)")
    try:
        curves = run_table_sql(db_path, sql_dir / "training_curves.sql")
        stts = run_table_sql(db_path, sql_dir / "stts_curves.sql")
        hacking = run_table_sql(db_path, sql_dir / "hacking_ratio.sql")
        validation = run_table_sql(db_path, sql_dir / "rl_validation.sql")
    except duckdb.Error as error:
        raise RuntimeError(f"figures: {error}") from None
    out_dir = Path(out_dir)
    written = {name: training_figure(curves, panels, out_dir / f"{name}.png") for name, panels in FIGURE_PANELS.items()}
    written["fig6_stts"] = stts_figure(stts, out_dir / "fig6_stts.png")
    written["fig8_hacking_ratio"] = hacking_figure(hacking, out_dir / "fig8_hacking_ratio.png")
    written["fig_rl_validation"] = validation_figure(validation, out_dir / "fig_rl_validation.png")
    return dict(sorted(written.items()))
