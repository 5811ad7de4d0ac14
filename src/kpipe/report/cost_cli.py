"""``kpipe plan --cost``: the cost model (kpipe.report.cost) for a run's config files, before the run."""

from __future__ import annotations

from pathlib import Path

import click

from kpipe.infra.config import ConfigError, load_config
from kpipe.report.cost import format_comparison, format_plan, load_units, plan_cost


@click.command("plan")
@click.option("--cost", is_flag=True, help="print GPU-hours per stage, the critical path and the wall time")
@click.option("--configfile", "configfiles", multiple=True, required=True,
              help="config files layered over --base as Snakemake layers them (more may follow as arguments)")
@click.argument("overlays", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--base", default="config/config.yaml", show_default=True, type=click.Path(exists=True, dir_okay=False),
              help="the workflow's own config file, under every --configfile")
@click.option("--units", default="config/cost_units.yaml", show_default=True,
              type=click.Path(exists=True, dir_okay=False), help="the cost model's units and their sources")
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs of the machine the run gets")
@click.option("--gpu-kind", type=click.Choice(["h100", "h200"], case_sensitive=False), required=True)
@click.option("--gym-gpus", type=click.IntRange(min=0), default=0, show_default=True,
              help="GPUs of --gpus that judge kernels only (the paper's layout); 0: KernelGym shares the jobs' GPUs")
@click.option("--host-memory-gib", type=click.FloatRange(min=0), help="the machine's host memory (default: the units' per GPU)")
@click.option("--disk-gib", type=click.FloatRange(min=0), help="the machine's disk (default: the units' per GPU)")
@click.option("--measured", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="the logs/ folder of a finished run of this config: compare its timed stages with the plan")
def plan(cost: bool, configfiles: tuple[str, ...], overlays: tuple[str, ...], base: str, units: str, gpus: int,
         gpu_kind: str, gym_gpus: int, host_memory_gib: float | None, disk_gib: float | None,
         measured: Path | None) -> None:
    """Plan a run's cost from its config (kpipe plan --cost --configfile config/paper.yaml --gpus 8 --gpu-kind h100)."""
    if not cost:
        raise click.UsageError("kpipe plan prints the cost model: pass --cost")
    files = [*configfiles, *overlays]
    try:
        config = load_config(base, *files)
        cost_plan = plan_cost(config, load_units(units), gpus, gpu_kind.lower(), gym_gpus,
                              None if host_memory_gib is None else host_memory_gib * 2**30,
                              None if disk_gib is None else disk_gib * 2**30)
        report = format_plan(cost_plan, files)
        if measured is not None:
            report += f"\n\nmeasured ({measured}):\n" + format_comparison(cost_plan, measured)
    except (ConfigError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    click.echo(report)
