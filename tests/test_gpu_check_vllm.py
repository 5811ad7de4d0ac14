"""checks.gpu.vllm's pure parts (statistics, log parsing, verdict) and its refusals on a CPU; and
kpipe.train.rollouts.make_engine reusing one in-process vLLM engine across RL iterations."""

from __future__ import annotations

import argparse
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from checks.gpu import CHECKS
from checks.gpu import vllm as check
from checks.gpu.harness import CheckFailed, Report, sections_of
from kpipe.train import rollouts
from kpipe.train.rl_config import RLConfig


def test_listed_last_with_expected_seconds_that_fit_one_call():
    assert CHECKS[-2:] == ("vllm", "paper_units")  # the checks that need vLLM's install come last
    assert list(sections_of(check)) == ["version", "throughput", "mismatch", "serve"]
    assert sum(s.seconds for s in check.SECTIONS) <= 480


def test_quantiles_match_numpy():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    got = check.quantiles(values)
    for q in check.QUANTILES:
        assert got[f"q{q:g}"] == pytest.approx(float(np.quantile(values, q)))
    assert check.quantiles([]) == {} and check.quantiles([float("nan")]) == {}


def test_tokens_per_s_and_speedup_verdict():
    assert check.tokens_per_s([100, 156], 2.0) == 128.0 and math.isnan(check.tokens_per_s([1], 0))
    results = {"nano": {"vllm": {16: 100.0, 64: 900.0}, "hf": {16: 50.0, 64: 100.0}},
               "qwen3-0.6b": {"vllm": {"64": 300.0}, "hf": {"64": 100.0}}}
    verdict = check.speedup_verdict(results)
    assert verdict["ratios"] == {"nano": 9.0, "qwen3-0.6b": 3.0} and verdict["ok"]
    assert not check.speedup_verdict({"nano": {"vllm": {64: 400.0}, "hf": {64: 100.0}}})["ok"]
    assert not check.speedup_verdict({"nano": {"vllm": {}, "hf": {64: 100.0}}})["ok"]  # nothing measured


def test_parse_vllm_log():
    log = "\n".join([
        "INFO 11-26 [cuda.py:483] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN'].",
        "INFO 11-26 [flash_attn.py:777] Using FlashAttention version 3",
        "INFO 11-26 [monitor.py:40] torch.compile takes 23.41 s in total",
        "INFO 11-26 [gpu_model_runner.py:1] Graph capturing finished in 7 secs, took 0.20 GiB",
        "INFO 11-26 [core.py:1] init engine (profile, create kv cache, warmup model) took 41.20 s",
        "INFO 11-26 [api_server.py:1] vLLM API server version 0.26.0",
        "ERROR 11-26 something broke",
    ])
    found = check.parse_vllm_log(log)
    assert found["attention_backends"] == ["FLASH_ATTN"] and found["flash_attn_version"] == 3
    assert found["torch_compile_s"] == 23.41 and found["cuda_graph_capture_s"] == 7.0
    assert found["init_engine_s"] == 41.2 and found["server_version"] == "0.26.0"
    assert len(found["error_lines"]) == 1
    assert check.parse_vllm_log("INFO Using FLEX_ATTENTION backend.")["attention_backends"] == ["FLEX_ATTENTION"]
    assert check.parse_vllm_log("")["flash_attn_version"] is None


def test_mismatch_stats():
    log_w = [0.0, math.log(1.0005), math.log(1.01), 0.0]
    stats = check.mismatch_stats(log_w, [True, True, False, False], [True, True, True, False],
                                 train_nll=20.0, rollout_nll=21.0, tokens=10, token_log_ratios=[0.0, -0.1, 0.1])
    assert stats["sequences"] == 3 and stats["mrs_kept"] == 2 and stats["mrs_rejected"] == 1
    assert stats["w"]["q1"] == pytest.approx(1.01) and stats["w"]["q0"] == pytest.approx(1.0)
    assert stats["train_ppl"] == pytest.approx(math.exp(2.0)) and stats["rollout_ppl"] == pytest.approx(math.exp(2.1))


def test_every_section_refuses_a_cpu_clearly(tmp_path):
    facts = {"device": "cpu", "gpus": 0, "date": "2026-01-01 00:00 UTC"}
    args = argparse.Namespace(cpu=False, policies="nano", gpu_util=0.3, mismatch_n=8, keep_work=False)
    for section in check.SECTIONS:
        report = Report("vllm", check.TITLE, facts, (), None)
        report.begin(section.name)
        with pytest.raises(CheckFailed, match="no CPU mode"):
            section.run(report, args)
    with pytest.raises(CheckFailed, match="unknown policies"):
        check.chosen_policies(argparse.Namespace(policies="nano,big"))


def test_child_entry_point_refuses_direct_use():
    import subprocess

    done = subprocess.run([sys.executable, "-m", "checks.gpu.vllm"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0 and "python3 -m checks.gpu vllm" in done.stderr


class FakeLLM:
    built = 0
    model_config = types.SimpleNamespace(dtype=torch.bfloat16)

    def __init__(self, **kwargs):
        FakeLLM.built += 1
        self.kwargs, self.rpcs, self.wakes = kwargs, [], []

    def collective_rpc(self, method, **kwargs):
        self.rpcs.append((method, kwargs))

    def reset_prefix_cache(self, **kwargs):
        pass

    def sleep(self, level):
        pass

    def wake_up(self, tags):
        self.wakes.append(tags)


def test_make_engine_reuses_the_process_engine_and_pushes_the_new_policy(monkeypatch):
    """RL iterations in one process (checks.gpu.rl_learns --engine vllm) share one engine: a second
    one would take another share of the GPU that vLLM never gives back."""
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, dict
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(rollouts, "_LIVE_VLLM", {})
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    FakeLLM.built = 0
    cfg = RLConfig(engine="vllm")
    first = rollouts.make_engine(cfg, torch.nn.Linear(2, 2), None, Path("/ckpt/sft"), "rl-iter0", progress=False)
    assert FakeLLM.built == 1 and first.llm.rpcs == []  # built from the checkpoint, nothing pushed
    second = rollouts.make_engine(cfg, torch.nn.Linear(2, 2), None, Path("/ckpt/iter0"), "rl-iter1",
                                     progress=False)
    assert second is first and FakeLLM.built == 1 and second.model == "rl-iter1"
    [(_, pushed)] = first.llm.rpcs  # the new policy's two tensors, one bucket
    assert [name for name, _ in pushed["args"][0]] == ["weight", "bias"]
    other = rollouts.make_engine(RLConfig(engine="vllm", vllm_gpu_memory_utilization=0.5), None, None,
                                    Path("/ckpt/x"), "other", progress=False)
    assert other is not first and FakeLLM.built == 2  # other arguments: another engine
    asleep = rollouts.make_engine(RLConfig(engine="vllm", vllm_sleep=True), None, None, Path("/ckpt/s"), "s",
                                  progress=False)
    asleep.sleep()  # the previous iteration's last update: a later iteration wakes it around its push
    assert rollouts.make_engine(RLConfig(engine="vllm", vllm_sleep=True), torch.nn.Linear(2, 2), None,
                                Path("/ckpt/s1"), "s1", progress=False) is asleep
    assert asleep.llm.wakes == [["weights"], ["kv_cache"]] and len(asleep.llm.rpcs) == 1 and not asleep.asleep
    fresh = types.ModuleType("vllm")
    fresh.LLM, fresh.SamplingParams = FakeLLM, dict
    monkeypatch.setitem(sys.modules, "vllm", fresh)
    assert rollouts.make_engine(RLConfig(engine="vllm", vllm_gpu_memory_utilization=0.5), None, None,
                                   Path("/ckpt/x"), "other", progress=False) is not other
