"""VLLMServer against a stand-in `vllm` executable (vLLM needs a GPU): the command line carries
the configured flags, start waits for /health, a server that dies or never gets ready is an
error quoting its log, and stop() leaves no process of the group (tensor-parallel workers).
A `serve: vllm` model entry: the eval job (what workflow/scripts/eval.py runs) starts the stand-in
found on PATH, generates through it and stops it, also when the job fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kpipe.llm.openai_engine import OpenAIEngine
from kpipe.llm.types import ChatRequest
from kpipe.data.io import read_table
from kpipe.evaluate.kernelbench import check_model, eval_job, model_gpus
from kpipe.llm.vllm_server import VLLMServer, VLLMServerConfig, check_gpus, serve_args
from test_eval_stage import write_tasks

# Behaves like `vllm serve` from outside: parses the same flags, starts a "worker" child in its
# process group, takes FAKE_VLLM_DELAY seconds to load, then answers /health, /v1/models (with
# the flags it saw) and /v1/chat/completions. FAKE_VLLM_FAIL makes it die while loading;
# FAKE_VLLM_ARGS names a file for the flags it was started with.
FAKE_VLLM = r'''
import argparse, json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("command"); parser.add_argument("model")
for flag in ("--host", "--port", "--served-model-name", "--tensor-parallel-size", "--gpu-memory-utilization",
             "--dtype", "--seed", "--generation-config", "--data-parallel-size", "--max-model-len"):
    parser.add_argument(flag)
parser.add_argument("--enable-prefix-caching", action="store_true")
args = parser.parse_args()
if os.environ.get("FAKE_VLLM_ARGS"):
    open(os.environ["FAKE_VLLM_ARGS"], "w").write(json.dumps(vars(args)))
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["FAKE_VLLM_PIDS"], "w").write(f"{os.getpid()} {worker.pid}")
time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0")))
if os.environ.get("FAKE_VLLM_FAIL"):
    print("torch.OutOfMemoryError: CUDA out of memory while loading weights", flush=True)
    sys.exit(1)
key = os.environ.get("VLLM_API_KEY")

class Handler(BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)

    def authorised(self):
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self.send_response(401); self.end_headers(); return False
        return True

    def do_GET(self):
        if self.path == "/health":
            self.send_response(200); self.end_headers()
        elif self.authorised():
            self.reply({"data": [{"id": args.served_model_name, "args": vars(args)}]})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.authorised():
            self.reply({"id": "x", "object": "chat.completion", "created": 0, "model": request["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "served by " + request["model"]}}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})

    def log_message(self, *a):
        pass

ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
'''


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(tmp_path / "pids"))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return [sys.executable, str(script)]


def pids(tmp_path: Path) -> list[int]:
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Exited within `within_s` (a zombie not yet reaped by its new parent counts as exited)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_serve_args_carry_the_configuration() -> None:
    config = VLLMServerConfig(model="results/models/sft-paper/", tensor_parallel_size=4, max_model_len=32768,
                              extra_args=("--max-num-seqs", "256"))
    args = serve_args(config, 8123)
    assert args[:2] == ["serve", "results/models/sft-paper/"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert {k: flags[k] for k in ("--port", "--served-model-name", "--tensor-parallel-size", "--max-model-len",
                                  "--generation-config")} == {"--port": "8123", "--served-model-name": "sft-paper",
                                                              "--tensor-parallel-size": "4", "--max-model-len": "32768",
                                                              "--generation-config": "vllm"}
    assert "--enable-prefix-caching" in args and args[-2:] == ["--max-num-seqs", "256"]
    assert "--data-parallel-size" not in args


def test_too_few_gpus_fail_before_anything_starts() -> None:
    check_gpus(VLLMServerConfig(model="m", tensor_parallel_size=2), ["0", "1"])
    with pytest.raises(ValueError, match="needs 4 GPU"):
        check_gpus(VLLMServerConfig(model="m", tensor_parallel_size=2, data_parallel_size=2), ["0", "1"])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMServerConfig(model="m", gpu_memory_utilization=1.5)


def test_server_is_ready_usable_and_stopped_with_its_workers(fake_vllm, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_DELAY", "1.5")
    config = VLLMServerConfig(model="/ckpt/drkernel-8b", tensor_parallel_size=2)
    server = VLLMServer(config, log_path=tmp_path / "vllm.log", command=fake_vllm)
    started = time.monotonic()
    with server:
        assert time.monotonic() - started >= 1.5  # waited for the model to load
        models = httpx.get(server.base_url + "/models").json()["data"][0]
        assert models["id"] == "drkernel-8b" and models["args"]["tensor_parallel_size"] == "2"
        engine = OpenAIEngine(server.openai_config(progress=False))
        [answer] = engine.generate([ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=16)])
        assert answer.text == "served by drkernel-8b"
        leader, worker = pids(tmp_path)
    assert gone(leader) and gone(worker)


def test_a_job_killed_outright_takes_its_server_with_it(fake_vllm, tmp_path) -> None:
    """SIGKILL of the job (no finally runs) still stops the server: it was started with
    PR_SET_PDEATHSIG = SIGTERM, so it cannot hold its GPUs as an orphan."""
    job = tmp_path / "job.py"
    job.write_text(
        "import sys, time\n"
        "from kpipe.llm.vllm_server import VLLMServer, VLLMServerConfig\n"
        f"server = VLLMServer(VLLMServerConfig(model='/ckpt/m'), log_path={str(tmp_path / 'vllm.log')!r}, "
        f"command={fake_vllm!r}).start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen([sys.executable, str(job)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        leader, _ = pids(tmp_path)
        assert not gone(leader, within_s=0.5)
    finally:
        process.kill()
        process.wait()
    assert gone(leader, within_s=10.0)


def test_non_loopback_server_requires_a_key(fake_vllm, tmp_path) -> None:
    config = VLLMServerConfig(model="/ckpt/m", host="0.0.0.0")
    with VLLMServer(config, log_path=tmp_path / "vllm.log", command=fake_vllm) as server:
        assert httpx.get(f"http://127.0.0.1:{server.port}/v1/models").status_code == 401
        engine = OpenAIEngine(server.openai_config(progress=False))
        [answer] = engine.generate([ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=16)])
        assert answer.text == "served by m"
    assert "VLLM_API_KEY" not in os.environ


def test_a_server_that_dies_while_loading_is_an_error_quoting_its_log(fake_vllm, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(RuntimeError, match="(?s)exited with status 1.*CUDA out of memory"):
        VLLMServer(VLLMServerConfig(model="m"), log_path=tmp_path / "vllm.log", command=fake_vllm).start()
    assert all(gone(pid) for pid in pids(tmp_path))  # its worker did not outlive it


def test_a_server_that_never_gets_ready_is_stopped(fake_vllm, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_DELAY", "60")
    server = VLLMServer(VLLMServerConfig(model="m"), log_path=tmp_path / "vllm.log", startup_timeout_s=2,
                        command=fake_vllm)
    with pytest.raises(RuntimeError, match="not ready within 2 s"):
        server.start()
    assert all(gone(pid) for pid in pids(tmp_path))


@pytest.fixture
def vllm_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in as the `vllm` executable on PATH, on a job holding GPU "0"; the job's cwd
    (where the server log goes) is `tmp_path`. Returns the file the flags are written to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable = bin_dir / "vllm"
    executable.write_text(f"#!{sys.executable}\n{FAKE_VLLM}")
    executable.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # what the job's GPU lease sets
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("FAKE_VLLM_ARGS", str(tmp_path / "args.json"))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "args.json"


SERVED = {"name": "drk-rl", "kind": "pipeline", "source": "rl", "serve": "vllm", "concurrency": 4,
          "vllm_server": {"tensor_parallel_size": 1, "max_model_len": 16384}}
SETTINGS = {"samples": 2, "turns": 2, "max_tasks": 1, "sampling": {"max_tokens": 16}}
GYM = {"backend": "local", "protocol": {"device": "cpu"}}


def test_served_entries_are_checked_and_hold_their_servers_gpus() -> None:
    assert model_gpus({**SERVED, "vllm_server": {"tensor_parallel_size": 4, "data_parallel_size": 2}}) == 8
    assert model_gpus({"name": "drk", "kind": "pipeline", "source": "rl"}) == 1
    for bad, message in [({**SERVED, "kind": "openai", "model": "gpt-5"}, "needs serve: vllm and a checkpoint kind"),
                         ({**SERVED, "serve": "sglang"}, "needs serve: vllm"),
                         ({**SERVED, "vllm_server": {"tensor_parallel": 2}}, "vllm_server: unknown key.*tensor_parallel"),
                         ({**SERVED, "device": "cuda"}, "other keys are the openai client's; unknown: device"),
                         ({"name": "drk", "kind": "hf", "path": "/ckpt", "vllm_server": {}}, "need `serve: vllm`")]:
        with pytest.raises(ValueError, match=message):
            check_model(bad)


def test_the_eval_job_serves_its_checkpoint_with_vllm_and_stops_it(vllm_on_path: Path, tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.parquet")
    checkpoint = str(tmp_path / "models" / "rl-default" / "iter=1")
    out = tmp_path / "part-0.parquet"
    eval_job(tasks, out, tmp_path / "cache.jsonl", SERVED, SETTINGS, level=1, gym=GYM, checkpoint=checkpoint,
             progress=False)
    rows = read_table(out, "trajectories").to_pylist()
    assert len(rows) == 2 * 2 and {row["model"] for row in rows} == {"drk-rl"}
    assert {row["response"] for row in rows} == {"served by drk-rl"}  # every answer came from the server
    flags = json.loads(vllm_on_path.read_text())
    assert (flags["model"], flags["served_model_name"], flags["tensor_parallel_size"], flags["max_model_len"]) == (
        checkpoint, "drk-rl", "1", "16384")
    assert all(gone(pid) for pid in pids(tmp_path))  # the server and its worker are stopped


def test_a_failing_eval_job_stops_its_server(vllm_on_path: Path, tmp_path: Path, monkeypatch) -> None:
    answers = []

    def generate_then_fail(tasks, engine, *args, **kwargs):
        answers.extend(engine.generate([ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=8)]))
        raise RuntimeError("the loop failed")

    monkeypatch.setattr("kpipe.evaluate.kernelbench.evaluate_shard", generate_then_fail)
    with pytest.raises(RuntimeError, match="the loop failed"):
        eval_job(write_tasks(tmp_path / "tasks.parquet"), tmp_path / "part-0.parquet", tmp_path / "cache.jsonl",
                 SERVED, SETTINGS, level=1, gym=GYM, checkpoint=str(tmp_path / "ckpt"), progress=False)
    assert [answer.text for answer in answers] == ["served by drk-rl"]
    assert all(gone(pid) for pid in pids(tmp_path))
