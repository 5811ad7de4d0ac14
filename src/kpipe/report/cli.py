"""`kpipe tables build` / `kpipe tables figures`: the paper's tables (`kpipe.report.tables`) and figures
(`kpipe.report.figures`) from the kpipe database. A command-line module above both, so the figures'
use of the tables' SQL runner is the only import between them."""

from __future__ import annotations

from pathlib import Path

import click

from kpipe.data.db import locate_db
from kpipe.report.tables import DEFAULT_SQL_DIR, REPORT_TURNS, build_tables

@click.group()
def tables() -> None:
    """The paper's tables and figures from the kpipe database."""


@tables.command("build")
@click.option("--db", "db_path", type=click.Path(dir_okay=False),
              help="database path (default: $KPIPE_DB, else the one run's under results/runs)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="default: tables/ beside the database")
@click.option("--sql-dir", default=str(DEFAULT_SQL_DIR), show_default=True, type=click.Path(file_okay=False))
@click.option("--n-boot", default=1000, show_default=True, help="Bootstrap replicates per Fast@p cell (0: none).")
@click.option("--report-turn", type=click.Choice(REPORT_TURNS), default="paper", show_default=True,
              help="Turn of the Fast@p rows: paper (own models last, baselines best), last or best.")
@click.option("--own-model", "own_models", multiple=True,
              help="A model of this pipeline (reported at its last turn under --report-turn paper); repeatable.")
def build_command(db_path: str | None, out_dir: str | None, sql_dir: str, n_boot: int, report_turn: str,
                  own_models: tuple[str, ...]) -> None:
    """Write tables/<name>.md and .csv beside the database for every workflow/sql/<name>.sql."""
    db = locate_db(db_path)
    try:
        written = build_tables(db, Path(out_dir) if out_dir else db.parent / "tables", Path(sql_dir), n_boot,
                               report_turn=report_turn, own_models=own_models)
    except (FileNotFoundError, RuntimeError) as error:
        raise click.ClickException(str(error)) from None
    for name, path in written.items():
        click.echo(f"{name}: {path}")


@tables.command("figures")
@click.option("--db", "db_path", type=click.Path(dir_okay=False),
              help="database path (default: $KPIPE_DB, else the one run's under results/runs)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="default: figures/ beside the database")
@click.option("--n-boot", default=1000, show_default=True, help="Bootstrap replicates of the shaded intervals (0: none).")
def figures_command(db_path: str | None, out_dir: str | None, n_boot: int) -> None:
    """Write the paper's figures (4-8, RL validation, Kevin's budget) as PNG beside the database."""
    from kpipe.report.figures import build_figures  # matplotlib: only when asked for

    db = locate_db(db_path)
    for name, path in build_figures(db, Path(out_dir) if out_dir else db.parent / "figures", n_boot=n_boot).items():
        click.echo(f"{name}: {path}")
