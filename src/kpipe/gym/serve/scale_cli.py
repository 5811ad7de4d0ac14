"""``kpipe gym eval-batch``, ``kpipe gym serve`` and ``kpipe gym workers``: KernelGym at scale.

Registered on the ``gym`` group of ``kpipe.gym.cli``. Protocol options match ``kpipe gym eval``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kpipe.gym.protocol import BASELINES, DEVICES, Protocol

PROTOCOL_OPTIONS = ("baseline", "correct_trials", "perf_trials", "device", "timeout_s")


def protocol_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The protocol options of ``kpipe gym eval``: a JSON file, overridden by explicit flags."""
    options = [
        click.option("--protocol", "protocol_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Protocol JSON; the options below override it."),
        click.option("--baseline", type=click.Choice(BASELINES), default="both", show_default=True),
        click.option("--correct-trials", type=click.IntRange(min=1), default=5, show_default=True),
        click.option("--perf-trials", type=click.IntRange(min=1), default=100, show_default=True),
        click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True),
        click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True, help="Seconds per child process."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def protocol_from(ctx: click.Context) -> Protocol:
    path = ctx.params.pop("protocol_path")
    settings = json.loads(path.read_text()) if path else {}
    for name in PROTOCOL_OPTIONS:
        value = ctx.params.pop(name)
        if path is None or ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT:
            settings[name] = value
    try:
        return Protocol.from_dict(settings)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None


def pool_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--workers", type=click.IntRange(min=1), default=None, help="GPUs to use (default: every visible GPU); without GPUs, worker count (default: half the cores)."),
        click.option("--per-gpu", type=click.IntRange(min=1), default=None, help="Workers per GPU (default 2): their untimed work overlaps, their timed regions take turns (docs/kernelgym-at-scale.md)."),
        click.option("--cache", "cache_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Result cache (SQLite); default $KPIPE_GYM_CACHE or results/gym/cache.sqlite."),
        click.option("--reuse-reference", is_flag=True, help="Run each reference once per worker (cheaper; the baseline is then not timed next to each candidate)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def open_cache(path: Path | None) -> Any:
    from kpipe.gym.serve.cache import ResultCache, default_cache_path

    return ResultCache(path or default_cache_path())


@click.command("eval-batch")
@click.option("--input", "input_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Candidates Parquet: reference_src + candidate_src, or task_id + code.")
@click.option("--output", "output_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help="evals-table Parquet, one row per input row.")
@click.option("--references", "references_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="tasks/queries Parquet resolving task_id (with task_id + code input).")
@click.option("--on-reference-error", type=click.Choice(["row", "fail", "skip"]), default="row", show_default=True, help="A reference that fails to run: a row with the status reference_error and the reason, fail the command (after the rest is cached), or leave its rows out.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@pool_options
@protocol_options
@click.pass_context
def eval_batch_command(ctx: click.Context, **_: Any) -> None:
    """Evaluate a Parquet of candidates into an evals table; a rerun evaluates only what is missing."""
    from kpipe.gym.serve.batch import BatchInputError, eval_batch

    protocol = protocol_from(ctx)
    p = ctx.params
    started = time.monotonic()
    try:
        summary = eval_batch(p["input_path"], p["output_path"], protocol, open_cache(p["cache_path"]),
                             references=p["references_path"], workers=p["workers"], per_gpu=p["per_gpu"], reuse_reference=p["reuse_reference"],
                             on_reference_error=p["on_reference_error"], progress=not p["quiet"])
    except BatchInputError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"{summary.line()} in {time.monotonic() - started:.1f} s -> {p['output_path']}")


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address; anything but loopback needs a token.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True, help="0: any free port (--record tells which).")
@click.option("--token", envvar="KPIPE_GYM_TOKEN", default=None, help="Bearer token clients must send (env KPIPE_GYM_TOKEN).")
@click.option("--max-request-mb", type=click.FloatRange(min=0.01), default=16.0, show_default=True)
@click.option("--no-cache", is_flag=True, help="Keep no result cache (gym.cache: null).")
@click.option("--record", "record_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Once serving, write the address, token, pid and settings here as JSON (mode 0600); removed at exit.")
@click.option("--owner", type=click.IntRange(min=1), default=None,
              help="Exit when this process ends (the snakemake run that owns the service: kpipe.gym.serve.run_service).")
@pool_options
@protocol_options
@click.pass_context
def serve_command(ctx: click.Context, **_: Any) -> None:
    """Serve KernelGym over HTTP (OpenAPI at /docs) on a pool of workers with one fixed protocol."""
    import socket
    import threading

    import uvicorn

    from kpipe.gym.serve import run_service
    from kpipe.gym.serve.client import TOKEN_ENV
    from kpipe.gym.serve.pool import GymPool
    from kpipe.gym.confine.sandbox import opted_out
    from kpipe.gym.serve.service import create_app, is_loopback

    protocol = protocol_from(ctx)
    p = ctx.params
    if not is_loopback(p["host"]) and not p["token"]:
        raise click.UsageError(f"binding {p['host']} (not loopback) needs --token or KPIPE_GYM_TOKEN")
    os.environ.pop(TOKEN_ENV, None)  # the pool's workers and their children never hold the token
    if p["owner"] is not None and run_service.process_start(p["owner"]) is None:
        raise click.ClickException(f"owner process {p['owner']} is not running")
    # bound before the pool starts: port 0 picks a free port, and the URL is known up front
    listener = socket.create_server((p["host"], p["port"]), family=socket.AF_INET6 if ":" in p["host"] else socket.AF_INET)
    host, port = listener.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    cache = None if p["no_cache"] else open_cache(p["cache_path"])
    with GymPool(protocol, workers=p["workers"], per_gpu=p["per_gpu"], cache=cache, reuse_reference=p["reuse_reference"],
                 progress=False) as pool:
        app = create_app(pool, token=p["token"], max_request_bytes=int(p["max_request_mb"] * 1024 * 1024))
        server = uvicorn.Server(uvicorn.Config(app, log_level="info"))
        click.echo(f"KernelGym on {url} ({len(pool.states)} workers, {pool.device_kind})", err=True)
        if p["owner"] is not None:
            threading.Thread(target=run_service.exit_with_owner, args=(p["owner"], lambda: setattr(server, "should_exit", True)),
                             daemon=True, name="owner-watch").start()
        if p["record_path"] is not None:
            settings = run_service.service_settings(protocol, p["reuse_reference"], cache.path if cache is not None else None,
                                                    p["workers"], opted_out(), p["per_gpu"])
            record = run_service.serving_record(url, p["owner"], p["token"], settings)
            threading.Thread(target=publish_when_serving, args=(server, p["record_path"], record), daemon=True).start()
        try:
            server.run(sockets=[listener])
        finally:
            if p["record_path"] is not None and (run_service.read_record(p["record_path"]) or {}).get("pid") == os.getpid():
                p["record_path"].unlink(missing_ok=True)


def publish_when_serving(server: Any, path: Path, record: dict[str, Any]) -> None:
    """Write `record` once uvicorn accepts connections (what a waiting job reads as 'ready')."""
    from kpipe.gym.serve.run_service import write_record

    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    write_record(path, record)


@click.command("workers")
@click.option("--url", default=None, help="A running service: print its workers. Without it: the slots a local pool would start.")
@click.option("--workers", type=click.IntRange(min=1), default=None)
def workers_command(url: str | None, workers: int | None) -> None:
    """Show evaluation workers (of a service, or the ones a local pool would start)."""
    if url:
        from kpipe.gym.serve.client import GymClient

        with GymClient(url, progress=False) as client:
            for worker in client.workers():
                click.echo(json.dumps(worker))
        return
    from kpipe.gym.serve.pool import default_slots

    for slot, gpu in enumerate(default_slots(workers)):
        target = f"GPU {gpu}" if gpu is not None else f"CPU interpreter ({os.cpu_count()} cores shared)"
        click.echo(f"worker {slot}: {target}")
