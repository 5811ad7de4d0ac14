"""`kpipe serve ...` (OpenAI-compatible servers) and `kpipe llm ...` (one-off generation)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import click

from kpipe.llm.server import BackgroundServer, FaultConfig, Responder, make_app


def run_forever(responder: Responder, model: str, host: str, port: int, faults: FaultConfig | None,
                ready_file: str | None) -> None:
    """Serve until interrupted; with `ready_file`, write the base URL there once listening."""
    with BackgroundServer(make_app(responder, model, faults), host, port) as server:
        click.echo(f"kpipe serve: {model} at {server.base_url}", err=True)
        if ready_file:
            Path(ready_file).write_text(server.base_url)
        try:
            while server.thread.is_alive():
                server.thread.join(timeout=1)
        except KeyboardInterrupt:
            pass


@click.group()
def serve() -> None:
    """OpenAI-compatible chat-completions servers (the offline teacher, a local HF model)."""


def server_options(function):
    function = click.option("--host", default="127.0.0.1", show_default=True)(function)
    function = click.option("--port", default=8000, show_default=True, help="0 picks a free port.")(function)
    return click.option("--ready-file", type=click.Path(dir_okay=False), help="Write the base URL here when up.")(
        function
    )


@serve.command("teacher")
@server_options
@click.option("--model-name", default="kpipe-teacher", show_default=True)
@click.option("--faults", default="", help='Fault rates per attempt, e.g. "429=0.1,500=0.05,delay=0.05,'
              'truncate=0.05,codeless=0.05".')
@click.option("--fault-delay-s", default=5.0, show_default=True, help="Delay of a 'delay' fault.")
@click.option("--seed", default=0, show_default=True, help="Seed of the fault draws.")
@click.option("--p-first-legit", default=0.3, show_default=True, help="P(correct solution at turn 1).")
@click.option("--p-fix", default=0.7, show_default=True, help="P(fixing a failed answer at the next turn).")
@click.option("--kernelbench-versions", default="main,v0", show_default=True,
              help="Problem sets whose references identify tasks.")
def serve_teacher(host: str, port: int, ready_file: str | None, model_name: str, faults: str, fault_delay_s: float,
                  seed: int, p_first_legit: float, p_fix: float, kernelbench_versions: str) -> None:
    """The offline teacher: answers from the bank of known Triton solutions and bugs."""
    from kpipe.llm.teacher import Teacher, TeacherBehaviour

    teacher = Teacher.from_bank(kernelbench_versions.split(","), TeacherBehaviour(p_first_legit, p_fix))
    fault_config = FaultConfig.parse(faults, fault_delay_s, seed) if faults else None
    run_forever(teacher, model_name, host, port, fault_config, ready_file)


class EngineResponder:
    """Serialises requests onto one in-process engine (HF models are not thread-safe)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()

    def respond(self, request):
        with self.lock:
            return self.engine.generate([request])[0]


@serve.command("hf")
@server_options
@click.option("--path", "model_path", required=True, type=click.Path(exists=True, file_okay=False),
              help="Local HF checkpoint directory.")
@click.option("--model-name", default=None, help="Name clients use (default: the path).")
@click.option("--device", default=None, help="cuda / cpu (default: cuda when available).")
def serve_hf(host: str, port: int, ready_file: str | None, model_path: str, model_name: str | None,
             device: str | None) -> None:
    """A local HF checkpoint behind the OpenAI API (one request at a time; `vllm serve` for scale)."""
    from kpipe.llm.hf_engine import HFEngine

    engine = HFEngine.from_pretrained(model_path, device=device, name=model_name or model_path, progress=False)
    run_forever(EngineResponder(engine), engine.model, host, port, None, ready_file)


@click.group()
def llm() -> None:
    """One-off generation through the engines kpipe uses."""


@llm.command("chat")
@click.argument("message", required=False)
@click.option("--reference", type=click.Path(exists=True, dir_okay=False),
              help="Send the paper's first-turn prompt for this KernelBench-format reference instead of MESSAGE.")
@click.option("--base-url", default=None, help="OpenAI-compatible endpoint (default: OpenAI).")
@click.option("--model", required=True)
@click.option("--api-key-env", default="OPENAI_API_KEY", show_default=True,
              help="Variable holding the key; 'none' for local servers.")
@click.option("--max-tokens", default=2048, show_default=True)
@click.option("--temperature", default=1.0, show_default=True)
def chat(message: str | None, reference: str | None, base_url: str | None, model: str, api_key_env: str,
         max_tokens: int, temperature: float) -> None:
    """Send one chat request and print the answer, its code extraction and usage."""
    from kpipe.llm.extract import extract_code
    from kpipe.llm.openai_engine import OpenAIConfig, OpenAIEngine
    from kpipe.llm.prompts import first_turn_messages
    from kpipe.llm.types import ChatRequest

    if (message is None) == (reference is None):
        raise click.UsageError("give either MESSAGE or --reference")
    messages = first_turn_messages(Path(reference).read_text()) if reference else [{"role": "user", "content": message}]
    engine = OpenAIEngine(OpenAIConfig(model=model, base_url=base_url, progress=False,
                                       api_key_env=None if api_key_env.lower() == "none" else api_key_env))
    completion = engine.generate([ChatRequest(messages, max_tokens=max_tokens, temperature=temperature)])[0]
    if completion.failed:
        raise click.ClickException(completion.error or "generation failed")
    click.echo(completion.text)
    extracted = extract_code(completion.text)
    summary = {"finish_reason": completion.finish_reason, "prompt_tokens": completion.prompt_tokens,
               "completion_tokens": completion.completion_tokens, "attempts": completion.attempts,
               "code": "ok" if extracted.code else f"format_error: {extracted.reason}"}
    click.echo(json.dumps(summary), err=True)
