"""`vllm serve` as an OpenAI-compatible server for the life of a job (evaluation, distillation).

A job that holds GPUs (its lease, or SLURM's CUDA_VISIBLE_DEVICES) starts the server on them,
waits until it answers ``GET /health``, talks to it through ``kpipe.llm.openai_engine`` like
any API, and stops it (its whole process group) when done::

    with VLLMServer(VLLMServerConfig(model="results/models/sft-paper", tensor_parallel_size=2)) as server:
        engine = OpenAIEngine(server.openai_config())

Flags are those of ``vllm serve`` in vLLM 0.26 and 0.33 (the `vllm` extra; checked against each release's
argument parser source by ``tests/test_vllm_api.py``, never run here): ``--tensor-parallel-size``,
``--data-parallel-size``, ``--served-model-name``, ``--max-model-len``,
``--gpu-memory-utilization``, ``--dtype``, ``--seed``, ``--enable-prefix-caching``,
``--generation-config vllm`` (sampling defaults from the request and vLLM, never from the
checkpoint's generation_config.json: results must not depend on what a checkpoint ships).
The server binds to 127.0.0.1 on a free port unless told otherwise; with a non-loopback host
it requires a key (``VLLM_API_KEY``, passed through the environment, never the command line).
The in-process rollout engine with weight updates between RL steps is
``kpipe.llm.vllm_engine``; this module is for jobs that only generate. A model entry with
``serve: vllm`` (``kpipe.evaluate.kernelbench``) reaches its checkpoint through ``served_engine``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from kpipe.llm.openai_engine import OpenAIConfig, OpenAIEngine
from kpipe.infra.process import tied_to_this_process

READY_POLL_S = 1.0
STOP_GRACE_S = 30.0
LOG_TAIL_CHARS = 3000
API_KEY_ENV = "VLLM_API_KEY"  # read by `vllm serve` itself and by OpenAIConfig(api_key_env=...)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# requests a served model's client keeps in flight: enough for vLLM's continuous batching to
# fill its batch (a job sends all samples of a turn at once); `concurrency` overrides it
SERVED_CONCURRENCY = 256


@dataclass(frozen=True)
class VLLMServerConfig:
    """How to serve one model. `model`: a local checkpoint directory or a hub id."""

    model: str
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int | None = 32768  # the paper's total context
    gpu_memory_utilization: float = 0.90
    dtype: str = "auto"
    seed: int = 0
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    enable_prefix_caching: bool = True  # multi-turn prompts share their history
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def name(self) -> str:
        """The model name requests use (default: the checkpoint directory's name)."""
        return self.served_model_name or Path(self.model.rstrip("/")).name

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @classmethod
    def from_settings(cls, model: str, served_model_name: str, settings: Mapping[str, Any], where: str
                      ) -> VLLMServerConfig:
        """From a config mapping of the other fields (e.g. a model entry's `vllm_server:`);
        `where` names that mapping in the one-line error about a key it does not know."""
        known = {f.name for f in fields(cls)} - {"model", "served_model_name"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(known))})")
        values = dict(settings)
        values["extra_args"] = tuple(values.get("extra_args", ()))
        return cls(model=model, served_model_name=served_model_name, **values)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def vllm_executable() -> list[str]:
    """The `vllm` entry point of this interpreter's environment (a job's PATH may lack it)."""
    beside = Path(sys.executable).with_name("vllm")
    found = str(beside) if beside.exists() else shutil.which("vllm")
    if found is None:
        raise RuntimeError("vllm is not installed: pip install 'kpipe[vllm]' on a GPU machine")
    return [found]


def serve_args(config: VLLMServerConfig, port: int) -> list[str]:
    """The ``vllm serve`` arguments for `config` (without the executable)."""
    args = ["serve", config.model, "--host", config.host, "--port", str(port),
            "--served-model-name", config.name,
            "--tensor-parallel-size", str(config.tensor_parallel_size),
            "--gpu-memory-utilization", str(config.gpu_memory_utilization),
            "--dtype", config.dtype, "--seed", str(config.seed), "--generation-config", "vllm"]
    if config.data_parallel_size > 1:
        args += ["--data-parallel-size", str(config.data_parallel_size)]
    if config.max_model_len is not None:
        args += ["--max-model-len", str(config.max_model_len)]
    if config.enable_prefix_caching:
        args.append("--enable-prefix-caching")
    return [*args, *config.extra_args]


def check_gpus(config: VLLMServerConfig, visible: Sequence[str]) -> None:
    """Fail at once, not after minutes of loading, when the job holds too few GPUs."""
    if config.gpus > len(visible):
        raise ValueError(f"vllm serve needs {config.gpus} GPU(s) (tensor x data parallel) but the job holds "
                         f"{len(visible)} ({','.join(visible) or 'none'})")


def log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


class VLLMServer:
    """A `vllm serve` process owned by this job: started ready, stopped with its children."""

    def __init__(self, config: VLLMServerConfig, log_path: str | os.PathLike[str] | None = None,
                 startup_timeout_s: float = 1800.0, command: Sequence[str] | None = None) -> None:
        self.config = config
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else Path(f"logs/vllm/{config.name}-{os.getpid()}.log")
        self.command = list(command) if command else None  # tests swap the executable
        self.port = config.port or free_port(config.host)
        # a non-loopback server needs a key: the user's VLLM_API_KEY, else a fresh one that this
        # process's environment carries for its own client until stop()
        self._own_key = config.host not in LOOPBACK and not os.environ.get(API_KEY_ENV)
        self._api_key = None if config.host in LOOPBACK else os.environ.get(API_KEY_ENV) or secrets.token_urlsafe(24)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}/v1"

    def openai_config(self, **overrides: object) -> OpenAIConfig:
        """An OpenAIConfig that reaches this server (the key, if any, through VLLM_API_KEY)."""
        key_env = API_KEY_ENV if self._api_key else None
        return OpenAIConfig(model=self.config.name, base_url=self.base_url, api_key_env=key_env, **overrides)  # type: ignore[arg-type]

    def start(self) -> VLLMServer:
        from kpipe.infra.gpu import visible_gpus

        if self.command is None:
            check_gpus(self.config, visible_gpus())
        if self._own_key:
            os.environ[API_KEY_ENV] = self._api_key  # type: ignore[assignment]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # SIGTERM when this job dies, even by SIGKILL: vLLM then stops its engine and workers itself
        command = tied_to_this_process((self.command or vllm_executable()) + serve_args(self.config, self.port),
                                       signal.SIGTERM)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Poll ``/health`` until 200; a server that exits or outlasts the timeout is an error
        that quotes the end of its log (vLLM says there why it could not start)."""
        assert self._process is not None
        health = self.base_url.removesuffix("/v1") + "/health"
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self._process.poll()
            if code is not None:
                raise RuntimeError(f"vllm serve exited with status {code} while starting; log {self.log_path}:\n"
                                   f"{log_tail(self.log_path)}")
            try:
                if httpx.get(health, timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve was not ready within {self.startup_timeout_s:g} s; log {self.log_path}:\n"
                                   f"{log_tail(self.log_path)}")
            time.sleep(READY_POLL_S)

    def stop(self) -> None:
        """SIGTERM to the server's process group (its engine and tensor-parallel workers), then
        SIGKILL after a grace period; the group is swept even when its leader already died, so
        no orphan keeps GPU memory."""
        if self._own_key:
            os.environ.pop(API_KEY_ENV, None)
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the whole group is gone already
        process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def served_engine(config: VLLMServerConfig, **client: Any) -> Iterator[OpenAIEngine]:
    """An OpenAI engine on a `vllm serve` of `config` started for the block and stopped when it
    ends, also by an exception. `client`: OpenAIConfig fields (concurrency, timeout_s, ...)."""
    with VLLMServer(config) as server:
        yield OpenAIEngine(server.openai_config(**{"concurrency": SERVED_CONCURRENCY, **client}))
