"""The paper's figures as PNG (matplotlib), from the same SQL as the tables:

- Figure 4: Fast@1 over RL training steps (as the RL stage logs it), one line per run;
- Figure 5: Fast@1.2 at the last turn (left) and entropy (right) over training steps;
- Figure 6: STTS, Fast@1.2 of the last turn (left) and best of history (right) vs turns T;
- Figure 7: training dynamics: mean reward, entropy, gradient norm, rollout and trainer perplexity;
- Figure 8: hacking ratio over RL iterations (rollouts and validation; kpipe's and the paper's hack definitions);
- RL validation (the paper's Figures 4 and 5 left, and 8, measured as the paper does): Fast@1,
  Fast@1.2, pass rate and hacking ratio of each validated iteration's checkpoint on the
  validation tasks vs training step, one line per run (workflow/sql/rl_validation.sql);
- Kevin's test-time budget (Kevin-32B §5.3-5.4): best@k correctness and speedup vs the kernels
  generated per task, one line per split of the budget (workflow/sql/kevin_budget.sql);
- RL reward: the rollouts' mean reward per iteration with its bootstrap interval, and their pass
  and compile rates (workflow/sql/rl_reward.sql): does RL learn?

Every figure's title says where its data came from (view `provenance` of views.sql): the rollout
engine of RL rows and the device of the timings, read from the rows, so a CPU run says "CPU
(Triton interpreter)" and an HF rollout is not called vLLM. Every axis says what it measures
and in which unit. A panel with nothing to show says so in the image instead of drawing flat
zeros: no rows; a speed metric (Fast@p, speedup) that is 0 everywhere without GPU timings (CPU
interpreter timings, or no timed kernel); an update statistic (gradient norm, entropy,
perplexity) that is 0 at every step (nothing was trained on). A zero measured on a GPU, a zero
reward, pass rate or hacking ratio are results and are drawn. Where a table has an interval
(`<column>_lo`, `<column>_hi`), the figure shades it.

Training metrics are found by name (`train_metrics.name`, normalised to lower case with every
non-alphanumeric run as "_"), so a figure shows whatever the RL stage logs under any of the
usual spellings (e.g. "val/fast@1.2_turn3", "fast_1.2").
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import duckdb
import pandas as pd

from kpipe.data.db import connect
from kpipe.report.tables import DEFAULT_SQL_DIR, run_table_sql, with_intervals

log = logging.getLogger(__name__)


class Panel(NamedTuple):
    """One panel of a training figure: the metrics it draws and how to read them."""

    pattern: str  # over normalised metric names
    ylabel: str
    speed: bool = False  # depends on kernel timings (Fast@p): meaningless without GPU timings
    zero_means: str | None = None  # a statistic of the update: what 0 at every step means (nothing to draw)


FAST_UNIT = "fraction of rollouts (0-1)"
NO_TOKENS = "no token was trained on"
# figure -> panel title -> panel
FIGURE_PANELS: dict[str, dict[str, Panel]] = {
    "fig4_fast1_training": {"Fast@1 during RL": Panel(r"fast_?1(?:_turn_?\d+)?$", f"Fast@1, {FAST_UNIT}", speed=True)},
    "fig5_fast12_entropy": {
        "Fast@1.2 during RL": Panel(r"fast_?1_2(?:_turn_?\d+)?$", f"Fast@1.2, {FAST_UNIT}", speed=True),
        "Entropy": Panel(r"(?:^|_)entropy$", "entropy (nats per token)", zero_means=NO_TOKENS),
    },
    "fig7_training_dynamics": {
        "Mean reward": Panel(r"(?:^|_)reward_mean$", "mean reward per rollout turn"),
        "Entropy": Panel(r"(?:^|_)entropy$", "entropy (nats per token)", zero_means=NO_TOKENS),
        "Gradient norm": Panel(r"(?:^|_)grad_?norm$", "gradient L2 norm (before clipping)",
                               zero_means="no update moved the policy (every advantage 0, e.g. equal rewards, "
                                          "or no rollout kept)"),
        "Rollout-engine perplexity": Panel(r"(?:rollout|vllm|infer\w*)_ppl|ppl_(?:rollout|vllm)",
                                           "perplexity (exp mean NLL per token)", zero_means=NO_TOKENS),
        "Trainer perplexity": Panel(r"(?:train\w*|fsdp)_ppl|ppl_(?:train|fsdp)", "perplexity (exp mean NLL per token)",
                                    zero_means=NO_TOKENS),
    },
}
FIGURE_TITLES = {"fig4_fast1_training": "Figure 4: Fast@1 of the RL rollouts",
                 "fig5_fast12_entropy": "Figure 5: Fast@1.2 and entropy during RL",
                 "fig7_training_dynamics": "Figure 7: RL training dynamics"}
TRAINING_STAGES = ("rl", "val")
# panel title -> column of rl_validation.sql (percentages), whether it depends on timings
VALIDATION_PANELS = {"Fast@1, last turn": ("fast_1", True), "Fast@1.2, last turn": ("fast_1_2", True),
                     "Pass rate, last turn": ("pass_rate", False), "Hacking ratio, all turns": ("hacking_ratio", False)}
HACKING_STAGES = {"rl": "rollouts", "rl_val": "validation"}  # Figure 8's stages of hacking_ratio.sql, as labelled
FIGURE_NAMES = tuple(sorted([*FIGURE_PANELS, "fig6_stts", "fig8_hacking_ratio", "fig_rl_validation",
                             "fig_kevin_budget", "fig_rl_reward"]))
ENGINES = {"hf": "HF transformers", "vllm": "vLLM"}
DEVICES = {"cpu": "CPU (Triton-interpreter timings, not GPU performance)", "cuda": "GPU (CUDA-event timings)",
           "mixed": "CPU and GPU timings mixed"}
CPU_MARK = "CPU-interpreter timings: not GPU performance"


def normalised(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def matching_series(curves: pd.DataFrame, pattern: str) -> pd.DataFrame:
    """Rows of the RL / validation metrics whose normalised name matches `pattern`."""
    if curves.empty:
        return curves
    names = curves["name"].map(normalised)
    return curves[curves["stage"].isin(TRAINING_STAGES) & names.str.contains(pattern, regex=True)]


# ---------------------------------------------------------------------------------------
# Where the data came from
# ---------------------------------------------------------------------------------------


class Source(NamedTuple):
    """The engines and timing kinds behind one figure's rows."""

    engines: tuple[str, ...]  # rollout engines (RL rows), or the evaluated models
    timing: tuple[str, ...]  # timing kinds: cpu, cuda, mixed

    @property
    def gpu_timed(self) -> bool:
        return "cuda" in self.timing

    @property
    def cpu_timed(self) -> bool:
        return bool(self.timing) and not self.gpu_timed


def read_provenance(db_path: Path) -> pd.DataFrame:
    with connect(db_path) as con:
        return con.sql("select run, stage, model, engine, timing_kind from provenance").df()


def source_of(provenance: pd.DataFrame, stages: Iterable[str], engines_from: str | None = "rl") -> Source:
    """The timing kinds of `stages`' rows (of their runs' rows when they timed none), and the rollout
    engines of the `engines_from` stage's rows of the same runs (None: the models of `stages`' rows,
    base name before '@')."""
    stages = tuple(stages)
    rows = provenance[provenance["stage"].isin(stages)]
    runs = provenance[provenance["run"].isin(set(rows["run"]) if not rows.empty else set(provenance["run"]))]
    if engines_from is None:
        engines = rows["model"].str.split("@").str[0]
    else:
        rl = runs[runs["stage"] == engines_from]
        engines = rl["engine"].map(lambda engine: ENGINES.get(engine, engine))
    # rows that timed no kernel (none correct) ran where the rest of their run did
    timing = set(rows["timing_kind"].dropna()) or set(runs["timing_kind"].dropna())
    return Source(tuple(sorted(set(engines.dropna()))), tuple(sorted(timing)))


def source_line(source: Source, what: str = "rollouts") -> str:
    """E.g. "rollouts: HF transformers · device: CPU (Triton-interpreter timings, ...)"."""
    engines = ", ".join(source.engines) or "not recorded"
    device = ", ".join(DEVICES.get(kind, kind) for kind in source.timing) or "no timed kernel"
    return f"{what}: {engines} · device: {device}"


# ---------------------------------------------------------------------------------------
# Drawing helpers
# ---------------------------------------------------------------------------------------


def _figure(n_panels: int, title: str, source: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = n_panels if n_panels <= 3 else -(-n_panels // 2)  # more wrap to two rows: a report page stays readable
    rows = -(-n_panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(4.8 * cols, 7.0), 0.6 + 3.6 * rows), squeeze=False)
    for unused in axes.flat[n_panels:]:
        unused.remove()
    fig.suptitle(f"{title}\n{source}", fontsize=10)
    return plt, fig, list(axes.flat[:n_panels])


def _no_data(ax, message: str) -> None:
    """The panel says why there is nothing to draw (and keeps no misleading ticks)."""
    ax.text(0.5, 0.5, "\n".join(textwrap.wrap(message, 38)), ha="center", va="center", transform=ax.transAxes,
            color="dimgray", fontsize=9, bbox={"boxstyle": "round", "facecolor": "whitesmoke", "edgecolor": "silver"})
    ax.set_xticks([])
    ax.set_yticks([])


def _cpu_mark(ax) -> None:
    ax.text(0.99, 0.02, CPU_MARK, ha="right", va="bottom", transform=ax.transAxes, color="firebrick", fontsize=7,
            style="italic")


def nothing_to_draw(values: pd.Series, what: str, source: Source, speed: bool = False, zero_means: str | None = None,
                    where: str = "point") -> str | None:
    """Why a panel of `values` shows no lines (None: draw them)."""
    values = values.dropna()
    if values.empty:
        return f"no {what} in this run"
    if not (values == 0).all():
        return None
    n = f"0 at every {where} ({len(values)} values)"
    if speed and not source.gpu_timed:
        reason = "timings are CPU-interpreter timings" if source.cpu_timed else "no kernel was timed"
        return f"{what}: {n}; {reason}, so speedups say nothing about GPU performance"
    if zero_means:
        return f"{what}: {n}: {zero_means}"
    return None


def _line(ax, frame: pd.DataFrame, x: str, y: str, label: str, interval: tuple[str, str] | None = None,
          **style: Any) -> None:
    """A line, with its interval shaded where the table has one (`interval`, default `y`_lo, `y`_hi)."""
    ax.plot(frame[x], frame[y], label=label, **{"marker": "o", **style})
    _integer_x(ax)
    low, high = interval or (f"{y}_lo", f"{y}_hi")
    if {low, high} <= set(frame.columns):
        ax.fill_between(frame[x], frame[low], frame[high], alpha=0.2, label=f"{label}: 95% interval")


def _integer_x(ax) -> None:
    """Whole-number ticks: steps, turns, iterations and kernel counts have no halves."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _percent_axes(ax, values: pd.Series, top: float = 100.0) -> None:
    """Percentages from 0 (a low line stays readable)."""
    highest = float(values.max()) if len(values.dropna()) else 0.0
    ax.set_ylim(0, min(top * 1.05, max(5.0, 1.1 * highest)))


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------
# The figures
# ---------------------------------------------------------------------------------------


def training_figure(curves: pd.DataFrame, panels: dict[str, Panel], path: Path, title: str, source: Source) -> Path:
    """One panel per metric pattern, one line per (run, metric name), x = training step."""
    plt, fig, axes = _figure(len(panels), title, source_line(source))
    for ax, (panel_title, panel) in zip(axes, panels.items()):
        series = matching_series(curves, panel.pattern)
        ax.set_title(panel_title)
        why = nothing_to_draw(series["value"] if not series.empty else pd.Series(dtype=float), panel_title, source,
                              speed=panel.speed, zero_means=panel.zero_means, where="step")
        if why:
            _no_data(ax, why)
            continue
        for (run, name), line in series.groupby(["run", "name"]):
            _line(ax, line.sort_values(["iteration", "step"]), "step", "value", f"{run}: {name}", marker=".")
        ax.legend(fontsize=7)
        ax.set_xlabel("training step (optimizer updates)")
        ax.set_ylabel(panel.ylabel)
        if panel.speed and source.cpu_timed:
            _cpu_mark(ax)
    return _save(plt, fig, path)


def stts_figure(stts: pd.DataFrame, path: Path, source: Source) -> Path:
    """Figure 6: Fast@1.2 vs T, last turn (left) and best of history (right)."""
    plt, fig, axes = _figure(2, "Figure 6: sequential test-time scaling", source_line(source, "models"))
    for ax, (history, label) in zip(axes, (("last", "Last turn"), ("best", "Best of history"))):
        part = stts[stts["history"] == history] if not stts.empty else stts
        ax.set_title(f"STTS: {label} Fast@1.2")
        values = part["fast_1_2"] if not part.empty else pd.Series(dtype=float)
        why = nothing_to_draw(values, "STTS rows" if stts.empty else "STTS Fast@1.2", source, speed=True, where="T")
        if why:
            _no_data(ax, why)
            continue
        for (model, strategy, level), line in part.groupby(["model", "strategy", "level"]):
            _line(ax, line.sort_values("T"), "T", "fast_1_2", f"{model} {strategy} L{level}")
        ax.legend(fontsize=7)
        _percent_axes(ax, values)
        ax.set_xlabel("turns T")
        ax.set_ylabel("Fast@1.2 vs eager (% of samples)")
        if source.cpu_timed:
            _cpu_mark(ax)
    return _save(plt, fig, path)


def hacking_figure(hacking: pd.DataFrame, path: Path, source: Source) -> Path:
    """Figure 8: hacking ratio during RL per iteration, run and level, of the rollouts and of the validation
    (Appendix C measures it on the level-2 subset), by kpipe's definition (solid) and the paper's (dashed)."""
    plt, fig, axes = _figure(1, "Figure 8: hacking ratio during RL", source_line(source))
    ax = axes[0]
    ax.set_title("Hacked turns: RL rollouts and validation")
    rl = hacking[hacking["stage"].isin(HACKING_STAGES)] if not hacking.empty else hacking
    why = nothing_to_draw(rl["hacking_ratio"] if not rl.empty else pd.Series(dtype=float), "RL rollouts", source)
    if why:
        _no_data(ax, why)
        return _save(plt, fig, path)
    for (stage, run, level), line in rl.groupby(["stage", "run", "level"], dropna=False):
        line = line.sort_values("iteration")
        label = f"{run} {HACKING_STAGES[stage]} L{level}"
        _line(ax, line, "iteration", "hacking_ratio", f"{label} (kpipe)")
        _line(ax, line, "iteration", "hacking_ratio_paper", f"{label} (paper)", linestyle="--")
    ax.legend(fontsize=7)
    _percent_axes(ax, rl["hacking_ratio"])
    ax.set_xlabel("RL iteration")
    ax.set_ylabel("hacked turns (% of generated turns)")
    return _save(plt, fig, path)


def validation_figure(validation: pd.DataFrame, path: Path, source: Source) -> Path:
    """The RL validation curves: one panel per metric, one line per (run, level), x = the training
    step at the end of each validated iteration (the RL iteration where no step was logged)."""
    plt, fig, axes = _figure(len(VALIDATION_PANELS), "RL validation: each iteration's checkpoint on the validation tasks",
                             source_line(source))
    by_step = not validation.empty and bool(validation["step"].notna().all())
    x = "step" if by_step else "iteration"
    for ax, (title, (column, speed)) in zip(axes, VALIDATION_PANELS.items()):
        ax.set_title(f"Validation: {title}")
        values = validation[column] if not validation.empty else pd.Series(dtype=float)
        what = "RL validation rows" if validation.empty else f"validation {title.split(',')[0]}"
        why = nothing_to_draw(values, what, source, speed=speed, where="iteration")
        if why:
            _no_data(ax, why)
            continue
        for (run, level), line in validation.groupby(["run", "level"], dropna=False):
            _line(ax, line.sort_values("iteration"), x, column, f"{run} L{level}")
        ax.legend(fontsize=7)
        _percent_axes(ax, values)
        ax.set_xlabel("training step (optimizer updates)" if by_step else "RL iteration")
        ax.set_ylabel("% of validation samples" if column != "hacking_ratio" else "% of generated turns")
        if speed and source.cpu_timed:
            _cpu_mark(ax)
    return _save(plt, fig, path)


def budget_figure(budget: pd.DataFrame, path: Path, source: Source) -> Path:
    """Kevin §5.3-5.4: best@k vs kernels generated per task (k × turns), one line per split (fixed
    turns, k growing); each line ends at the whole budget (Kevin's Table 2), drawn larger."""
    budgets = sorted(set(budget["budget"])) if not budget.empty else []
    title = "Kevin test-time budget: " + (f"{', '.join(map(str, budgets))} kernels per task" if budgets else "no budget")
    plt, fig, axes = _figure(2, title, source_line(source, "models"))
    panels = (("best_at_k_correct", "best@k correctness (% of tasks)", False),
              ("best_at_k_speedup", "best@k speedup vs eager (x, mean over tasks)", True))
    for ax, (column, ylabel, speed) in zip(axes, panels):
        ax.set_title(ylabel.split(" (")[0])
        values = budget[column] if not budget.empty else pd.Series(dtype=float)
        why = nothing_to_draw(values, "budget rows (config eval_budget)" if budget.empty else ylabel.split(" (")[0],
                              source, speed=speed, where="k")
        if why:
            _no_data(ax, why)
            continue
        for (model, level, turns), line in budget.groupby(["model", "level", "turns"]):
            line = line.sort_values("k")
            label = f"{model} L{level}: {int(line['trajectories'].iloc[0])} traj × {turns} turn{'s' * (turns > 1)}"
            _line(ax, line, "kernels", column, label, marker=".")
            whole = line[line["full_budget"]]
            ax.scatter(whole["kernels"], whole[column], s=60, color=ax.get_lines()[-1].get_color(), zorder=3)
        ax.legend(fontsize=7)
        if column == "best_at_k_correct":
            _percent_axes(ax, values)
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("kernels generated per task (k trajectories × turns)")
        ax.set_ylabel(ylabel)
        if speed and source.cpu_timed:
            _cpu_mark(ax)
    return _save(plt, fig, path)


def reward_figure(reward: pd.DataFrame, path: Path, source: Source) -> Path:
    """Does RL learn: the rollouts' mean reward per iteration with its bootstrap band (left), and
    the pass and compile rates of their turns (right), one line per run."""
    plt, fig, axes = _figure(2, "RL rollouts per iteration", source_line(source))
    panels = (("Mean reward", ("mean_reward",), "mean reward per turn (paper Eq. 1)"),
              ("Pass and compile rates", ("pass_rate", "compile_rate"), "% of rollout turns"))
    for ax, (title, columns, ylabel) in zip(axes, panels):
        ax.set_title(title)
        why = nothing_to_draw(reward[columns[0]] if not reward.empty else pd.Series(dtype=float), "RL rollouts",
                              source)
        if why:
            _no_data(ax, why)
            continue
        for run, line in reward.groupby("run"):
            line = line.sort_values("iteration")
            for column in columns:
                interval = ("reward_lo", "reward_hi") if column == "mean_reward" else None
                _line(ax, line, "iteration", column, f"{run}: {column.replace('_', ' ')}", interval)
        ax.legend(fontsize=7)
        if columns[0] == "pass_rate":
            _percent_axes(ax, reward[list(columns)].stack())
        ax.set_xlabel("RL iteration")
        ax.set_ylabel(ylabel)
    return _save(plt, fig, path)


def build_figures(db_path: Path, out_dir: Path, sql_dir: Path = DEFAULT_SQL_DIR, n_boot: int = 0) -> dict[str, Path]:
    """Every figure as `out_dir/<name>.png`; returns name -> path. `n_boot` > 0: the STTS and RL
    validation curves shade the tables' task-bootstrap intervals (`kpipe.report.tables.INTERVALS`)."""
    if not Path(db_path).exists():
        raise FileNotFoundError(f"no database at {db_path}: build it first (kpipe query --rebuild)")
    try:
        curves = run_table_sql(db_path, sql_dir / "training_curves.sql")
        stts = run_table_sql(db_path, sql_dir / "stts_curves.sql")
        hacking = run_table_sql(db_path, sql_dir / "hacking_ratio.sql")
        validation = run_table_sql(db_path, sql_dir / "rl_validation.sql")
        stts = with_intervals(db_path, "stts_curves", stts, n_boot)
        validation = with_intervals(db_path, "rl_validation", validation, n_boot)
        budget = run_table_sql(db_path, sql_dir / "kevin_budget.sql")
        reward = run_table_sql(db_path, sql_dir / "rl_reward.sql")
        provenance = read_provenance(db_path)
    except (duckdb.Error, RuntimeError) as error:
        raise RuntimeError(f"figures: {error}") from None
    out_dir = Path(out_dir)
    training = source_of(provenance, ["rl"])
    written = {name: training_figure(curves, panels, out_dir / f"{name}.png", FIGURE_TITLES[name], training)
               for name, panels in FIGURE_PANELS.items()}
    written["fig6_stts"] = stts_figure(stts, out_dir / "fig6_stts.png", source_of(provenance, ["stts"], None))
    written["fig8_hacking_ratio"] = hacking_figure(hacking, out_dir / "fig8_hacking_ratio.png", training)
    written["fig_rl_validation"] = validation_figure(validation, out_dir / "fig_rl_validation.png",
                                                     source_of(provenance, ["rl_val"]))
    written["fig_kevin_budget"] = budget_figure(budget, out_dir / "fig_kevin_budget.png",
                                                source_of(provenance, ["budget"], None))
    written["fig_rl_reward"] = reward_figure(reward, out_dir / "fig_rl_reward.png", training)
    log.info("figures in %s: %s", out_dir, ", ".join(sorted(written)))
    return dict(sorted(written.items()))
