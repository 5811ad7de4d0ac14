"""``kpipe gym``: KernelGym from the command line. A failing kernel is a result (exit 0);
only bad usage exits non-zero."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from kpipe.gym.protocol import BASELINES, DEVICES, Protocol
from kpipe.gym.confine.sandbox import OPT_OUT_VARIABLE, SandboxUnavailable
from kpipe.gym.serve.scale_cli import eval_batch_command, serve_command, workers_command


@click.group()
@click.option("--unconfined", is_flag=True, envvar=OPT_OUT_VARIABLE,
              help=f"Run candidates without the kernel's confinement (kpipe.gym.confine.sandbox), where the machine cannot "
                   f"confine them. Candidates are hostile code: only for trusted programs. Same as {OPT_OUT_VARIABLE}=1.")
def gym(unconfined: bool) -> None:
    """KernelGym: isolated, hack-resistant evaluation of Triton kernels."""
    if unconfined:  # the workers and children this process starts inherit the opt-out
        os.environ[OPT_OUT_VARIABLE] = "1"


@gym.command("eval")
@click.option("--reference", "reference_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path), help="KernelBench-format reference program (class Model, get_inputs, get_init_inputs).")
@click.option("--candidate", "candidate_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Candidate program (class ModelNew + @triton.jit kernels).")
@click.option("--baseline", type=click.Choice(BASELINES), default="both", show_default=True)
@click.option("--correct-trials", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--perf-trials", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True, help="Seconds per child process.")
@click.option("--protocol", "protocol_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Protocol JSON; the options above override it.")
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON.")
@click.pass_context
def eval_command(
    ctx: click.Context,
    reference_path: Path,
    candidate_path: Path,
    baseline: str,
    correct_trials: int,
    perf_trials: int,
    device: str,
    timeout_s: float,
    protocol_path: Path | None,
    as_json: bool,
) -> None:
    """Evaluate one candidate against its reference and print the result."""
    from kpipe.gym.judge.evaluation import ReferenceFailure, evaluate

    settings = json.loads(protocol_path.read_text()) if protocol_path else {}
    for name in ("baseline", "correct_trials", "perf_trials", "device", "timeout_s"):
        source = ctx.get_parameter_source(name)
        if protocol_path is None or source != click.core.ParameterSource.DEFAULT:
            settings[name] = ctx.params[name]
    try:
        protocol = Protocol.from_dict(settings)
        result = evaluate(reference_path.read_text(), candidate_path.read_text(), protocol)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None
    except (ReferenceFailure, SandboxUnavailable) as exc:  # a broken reference, or no confinement: no result
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(result.to_json())
    else:
        click.echo(result.feedback)
        click.echo(f"key: {result.key}")


# the pool, batch and service commands live with their code
gym.add_command(eval_batch_command)
gym.add_command(serve_command)
gym.add_command(workers_command)
