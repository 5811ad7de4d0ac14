"""Issue 55: Table 1's baseline rows (paper §6.2: GPT-5, Claude-4.5-Sonnet, DeepSeek-V3.2-Thinking, GLM-4.7,
Qwen3-8B, Qwen3-32B, Qwen3-Coder-30B-A3B, AutoTriton) as `models:` entries of config/paper.yaml. Each entry's
request is built by the code that sends it (kpipe.llm.openai_engine.request_params, through make_engine or a
`vllm serve` client) with the evaluation's sampling, and checked against the parameters its API accepts. The
APIs cannot be reached here: the table below is from the providers' documentation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpipe.agent.loop import sample_seed
from kpipe.evaluate.kernelbench import engine_spec, sampling_of, served_client, served_config
from kpipe.llm import make_engine
from kpipe.llm.openai_engine import OpenAIConfig, request_params
from kpipe.llm.types import ChatRequest
from kpipe.llm.vllm_server import VLLMServer

CONFIG = Path(__file__).resolve().parents[1] / "config"
ANY: Callable[[Any], bool] = lambda value: True  # noqa: E731
MESSAGES = [{"role": "user", "content": "Optimize the architecture named Model with custom Triton operators!"}]

# Parameters each API accepts (name -> accepted values), from its documentation:
# - OpenAI reasoning models (GPT-5, o-series), Chat Completions: `max_tokens` is refused ("Use
#   'max_completion_tokens' instead"); temperature and top_p: "Only the default (1) value is supported".
# - Anthropic's OpenAI SDK compatibility (docs.claude.com/en/api/openai-sdk): max_tokens and max_completion_tokens,
#   temperature in [0, 1], top_p supported, seed ignored; Claude Sonnet 4.5 refuses temperature and top_p together
#   ("`temperature` and `top_p` cannot both be specified for this model").
# - DeepSeek's deepseek-reasoner (thinking mode; api-docs.deepseek.com, "Reasoning Model"): max_tokens;
#   temperature, top_p and the penalties are "not supported" (accepted without effect), logprobs refused.
# - Z.ai's GLM chat completions (docs.z.ai): max_tokens, temperature in [0, 1], top_p in [0.01, 1]; no seed.
# - vLLM's OpenAI-compatible server: max_tokens, max_completion_tokens, temperature, top_p, seed.
OPENAI_REASONING = {"max_completion_tokens": ANY, "seed": ANY, "temperature": lambda v: v == 1, "top_p": lambda v: v == 1}
ACCEPTED: dict[str, dict[str, Callable[[Any], bool]]] = {
    "gpt-5": OPENAI_REASONING,
    "claude-sonnet-4-5": {"max_tokens": ANY, "max_completion_tokens": ANY, "temperature": lambda v: 0 <= v <= 1,
                          "top_p": lambda v: 0 < v <= 1},
    "deepseek-reasoner": {"max_tokens": ANY},
    "glm-4.7": {"max_tokens": ANY, "temperature": lambda v: 0 <= v <= 1, "top_p": lambda v: 0.01 <= v <= 1},
    "vllm": {"max_tokens": ANY, "max_completion_tokens": ANY, "temperature": lambda v: v >= 0,
             "top_p": lambda v: 0 < v <= 1, "seed": ANY},
}
NOT_TOGETHER = {"claude-sonnet-4-5": ("temperature", "top_p")}
TABLE1_BASELINES = {"gpt-5", "claude-4.5-sonnet", "deepseek-v3.2-thinking", "glm-4.7", "qwen3-8b", "qwen3-32b",
                    "qwen3-coder-30b-a3b", "autotriton"}


def paper() -> dict:
    return yaml.safe_load((CONFIG / "paper.yaml").read_text())


def client_config(entry: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[OpenAIConfig, str]:
    """The OpenAI client config an evaluation job builds for `entry`, and the API (ACCEPTED's key) it reaches."""
    if entry.get("serve") == "vllm":
        return VLLMServer(served_config(entry, checkpoint=entry.get("path"))).openai_config(**served_client(entry)), "vllm"
    if entry.get("api_key_env"):
        monkeypatch.setenv(entry["api_key_env"], "sk-test")
    return make_engine(engine_spec(entry, progress=False)).config, entry["model"]


def test_every_table1_baseline_is_an_entry():
    baselines = {entry["name"] for entry in paper()["models"] if entry["kind"] != "pipeline"}
    assert baselines == TABLE1_BASELINES


@pytest.mark.parametrize("name", sorted(TABLE1_BASELINES))
def test_each_baseline_builds_a_request_its_api_accepts(name, monkeypatch):
    config = paper()
    entry = next(entry for entry in config["models"] if entry["name"] == name)
    client, api = client_config(entry, monkeypatch)
    sampling = sampling_of(config["eval"], entry)
    request = ChatRequest(MESSAGES, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, seed=sample_seed("kb-main-L1-1", 0, config["eval"].get("seed", 0)))
    params = request_params(client, request)
    sent = {key: value for key, value in params.items() if key not in ("model", "messages")}
    accepted = ACCEPTED[api]
    refused = {key: value for key, value in sent.items() if key not in accepted or not accepted[key](value)}
    assert not refused, f"{name}: {api} refuses {refused}"
    assert {"max_tokens", "max_completion_tokens"} & set(sent), "no cap on generated tokens"
    assert sent.get("max_tokens", sent.get("max_completion_tokens")) == config["eval"]["sampling"]["max_tokens"]
    if api in NOT_TOGETHER:
        assert not set(NOT_TOGETHER[api]) <= set(sent), f"{name}: {api} refuses {NOT_TOGETHER[api]} together"
    if entry.get("base_url"):
        assert entry["base_url"].startswith("https://")


def test_the_old_gpt5_entry_would_have_been_refused():
    """The entry before issue 55 (max_tokens, top_p 0.95) fails the same check: the test can fail."""
    params = request_params(OpenAIConfig(model="gpt-5", api_key_env=None), ChatRequest(MESSAGES, top_p=0.95))
    assert "max_tokens" in params and not OPENAI_REASONING["top_p"](params["top_p"])


def test_bad_request_settings_fail_with_one_line():
    with pytest.raises(ValueError, match="omit_params: logprobs cannot be left out"):
        OpenAIConfig(model="m", omit_params=["logprobs"])
    with pytest.raises(ValueError, match="max_tokens_param must be one of"):
        OpenAIConfig(model="m", max_tokens_param="max_new_tokens")
