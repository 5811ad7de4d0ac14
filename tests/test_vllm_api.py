"""kpipe's calls into vLLM against vLLM's interface as recorded from the wheel of every release the
`vllm` extra pins (`tests/data/vllm_api-<version>.json`, written by `scripts/vllm_api_record.py`
from the source, nothing imported: vLLM cannot be installed on our CPU machines): 0.26.0, the
release whose `torch==2.11.0` the GPU device has, and 0.33.0, the registry's newest. Every test
runs once per release: the `vllm serve` command line, the `LLM(...)` and `SamplingParams(...)`
arguments, the output fields read, the `LLM` methods and worker attribute of the RL weight push,
and the environment variables must exist in each."""

from __future__ import annotations

import json
import re
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from kpipe.llm.types import ChatRequest
from kpipe.llm.vllm_server import API_KEY_ENV, VLLMServerConfig, serve_args
from kpipe.train import rollouts
from kpipe.train.rl_config import RLConfig

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
RECORDED = sorted(REPO.glob("tests/data/vllm_api-*.json"))
APIS = {json.loads(path.read_text())["version"]: json.loads(path.read_text()) for path in RECORDED}
VERSIONS = sorted(APIS, key=lambda v: tuple(map(int, v.split("."))))


@pytest.fixture(params=VERSIONS)
def api(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One recorded release's interface (the tests run once per release)."""
    return APIS[request.param]


def minor(version: str) -> tuple[int, int]:
    major, minor_, *_ = map(int, version.split("."))
    return major, minor_


def test_the_vllm_extra_spans_exactly_the_recorded_releases():
    """The oldest recorded release is the one the GPU runs (its torch pin is the device's), the
    newest the registry's current one: the extra goes from the first's minor to below the next
    minor after the last, and each recorded file is the wheel of its own version."""
    [extra] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    requirement = Requirement(extra)
    (low_major, low), (high_major, high) = minor(VERSIONS[0]), minor(VERSIONS[-1])
    assert requirement.name == "vllm" and str(requirement.specifier) == f"<{high_major}.{high + 1},>={low_major}.{low}"
    assert {"0.26.0", "0.33.0"} <= set(VERSIONS)
    for version, api in APIS.items():
        assert api["wheel"].startswith(f"vllm-{version}-") and requirement.specifier.contains(version)


def test_every_vllm_serve_flag_we_pass_exists(api):
    config = VLLMServerConfig(model="/ckpt/sft", tensor_parallel_size=2, data_parallel_size=2, max_model_len=4096,
                              enable_prefix_caching=True)
    args = serve_args(config, 8000)
    assert args[0] == "serve" and api["serve_positionals"] == ["model_tag"]  # the checkpoint is positional
    flags = {arg for arg in args if arg.startswith("--")}
    assert flags == {"--host", "--port", "--served-model-name", "--tensor-parallel-size", "--gpu-memory-utilization",
                     "--dtype", "--seed", "--generation-config", "--data-parallel-size", "--max-model-len",
                     "--enable-prefix-caching"}
    assert flags <= set(api["serve_flags"]), flags - set(api["serve_flags"])
    assert API_KEY_ENV in api["env_vars"]


class FakeLLM:
    """Stands in for `vllm.LLM`: records what kpipe passes and answers `chat` with vLLM's output shape."""

    model_config = types.SimpleNamespace(dtype=torch.bfloat16)  # LLM.model_config: what push_weights_to_vllm casts to

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.calls, self.rpcs = kwargs, [], []

    def chat(self, messages, sampling_params, **kwargs):
        self.calls.append(("chat", len([messages, sampling_params]), kwargs))
        sample = types.SimpleNamespace(text="ok", token_ids=[5, 6], finish_reason="stop",
                                       logprobs=[{5: types.SimpleNamespace(logprob=-0.5)},
                                                 {6: types.SimpleNamespace(logprob=-0.25)}])
        return [types.SimpleNamespace(outputs=[sample], prompt_token_ids=[1, 2, 3]) for _ in messages]

    def collective_rpc(self, method, **kwargs):
        self.calls.append(("collective_rpc", 1, kwargs))
        self.rpcs.append((method, kwargs))

    def reset_prefix_cache(self, **kwargs):
        self.calls.append(("reset_prefix_cache", 0, kwargs))

    def sleep(self, **kwargs):
        self.calls.append(("sleep", 0, kwargs))

    def wake_up(self, **kwargs):
        self.calls.append(("wake_up", 0, kwargs))


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return module


def test_rl_rollout_engine_arguments_and_outputs_exist(fake_vllm, api):
    cfg = RLConfig(engine="vllm", max_context_tokens=4096)
    engine = rollouts.make_engine(cfg, None, None, Path("/ckpt/sft"), "rl-iter0", progress=False)
    kwargs = engine.llm.kwargs
    assert set(kwargs) <= set(api["llm_init_params"]) | set(api["engine_args_fields"])
    assert kwargs["logprobs_mode"] in api["logprobs_modes"] and kwargs["logprobs_mode"] == "processed_logprobs"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in api["env_vars"]  # set to 0 by make_engine: the core in process
    params = engine.sampling_params(ChatRequest(messages=[{"role": "user", "content": "hi"}], seed=3, logprobs=True))
    assert set(params) <= set(api["sampling_params_fields"]) and params["logprobs"] == 0
    [completion] = engine.generate([ChatRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True)])
    assert completion.logprobs == [-0.5, -0.25] and completion.prompt_tokens == 3
    # the fields kpipe reads (outputs[0].text/token_ids/finish_reason/logprobs, prompt_token_ids)
    read = set(re.findall(r"sample\.(\w+)", Path(sys.modules["kpipe.llm.vllm_engine"].__file__).read_text()))
    assert read <= set(api["completion_output_fields"]), read
    assert {"outputs", "prompt_token_ids"} <= set(api["request_output_params"])
    for method, positional, call_kwargs in engine.llm.calls:
        assert positional + len(call_kwargs) <= len(api["llm_methods"][method])
        assert set(call_kwargs) <= set(api["llm_methods"][method])


def test_rl_weight_push_uses_existing_methods(fake_vllm, api):
    engine = rollouts.make_engine(RLConfig(engine="vllm"), None, None, Path("/ckpt/sft"), "rl", progress=False)
    model = torch.nn.Linear(2, 2)
    assert rollouts.push_weights_to_vllm(engine, model) == 1  # both tensors in one bucket
    assert [call[0] for call in engine.llm.calls] == ["collective_rpc", "reset_prefix_cache"]
    for method, _, call_kwargs in engine.llm.calls:
        assert set(call_kwargs) <= set(api["llm_methods"][method])
    # on the worker: model_runner.get_model().load_weights(weights=...), with HF parameter names
    loaded = {}
    bare = types.SimpleNamespace(load_weights=lambda weights: loaded.update(weights))
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: bare))
    for function, kwargs in engine.llm.rpcs:  # one bucket per call
        function(worker, *kwargs["args"])
    assert set(loaded) == {"weight", "bias"} and all(t.dtype == torch.bfloat16 for t in loaded.values())
    assert "get_model" in api["model_runner_methods"]  # both the V1 and the V2 GPU model runner


def test_rl_engines_of_several_processes_join_the_launcher(fake_vllm, api):
    """`kpipe launch --gpus N` with engine vllm: each process's engine joins the launcher's group."""
    engine = rollouts.make_engine(RLConfig(engine="vllm"), None, None, Path("/ckpt/sft"), "rl", progress=False,
                                     processes=2)
    kwargs = engine.llm.kwargs
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert "external_launcher" in api["executor_backends"]
    assert set(kwargs) <= set(api["llm_init_params"]) | set(api["engine_args_fields"])
    assert "distributed_executor_backend" not in rollouts.vllm_engine_args(RLConfig(engine="vllm"), 1)


def test_the_sleeping_engine_uses_existing_arguments_and_methods(fake_vllm, api):
    """rl.vllm_sleep: the engine is built with enable_sleep_mode, sleeps at level 2, wakes tag by tag with
    the tags vLLM knows (0.26.0: vllm/entrypoints/llm.py:821-835), around a bucketed push."""
    cfg = RLConfig(engine="vllm", vllm_sleep=True)
    engine = rollouts.make_engine(cfg, None, None, Path("/ckpt/sft"), "rl", progress=False)
    assert engine.llm.kwargs["enable_sleep_mode"] is True and "enable_sleep_mode" in api["engine_args_fields"]
    assert "enable_sleep_mode" not in rollouts.vllm_engine_args(RLConfig(engine="vllm"), 1)
    engine.sleep()
    rollouts.feed_vllm(engine, torch.nn.Linear(2, 2))
    assert [call[0] for call in engine.llm.calls] == ["sleep", "wake_up", "collective_rpc", "reset_prefix_cache",
                                                      "wake_up"]
    sleep, first_wake, last_wake = (engine.llm.calls[i][2] for i in (0, 1, 4))
    assert sleep == {"level": 2} and first_wake == {"tags": ["weights"]} and last_wake == {"tags": ["kv_cache"]}
    for method, positional, call_kwargs in engine.llm.calls:
        assert positional + len(call_kwargs) <= len(api["llm_methods"][method])
        assert set(call_kwargs) <= set(api["llm_methods"][method])
    assert not engine.asleep
