"""The colocated vLLM engine's weight push and sleep cycle (issue 63), on fake engines that record what
they are asked: buckets within their byte budget, every tensor pushed once and cast to the engine's dtype,
and the order sleep -> wake weights -> push -> reset -> wake KV cache under the step's phase timers."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from kpipe.llm.vllm_engine import VLLMEngine
from kpipe.train import rollouts
from kpipe.train.rl import PhaseTimer
from kpipe.train.rl_config import RLConfig


class RecordingLLM:
    """`vllm.LLM` as the push and the sleep cycle use it: every call in order, the tensors of each bucket."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model_config = types.SimpleNamespace(dtype=dtype)
        self.calls: list[tuple[str, Any]] = []
        self.buckets: list[list[tuple[str, torch.Tensor]]] = []

    def collective_rpc(self, method: Any, args: tuple = ()) -> None:
        [bucket] = args
        self.buckets.append(bucket)
        self.calls.append(("push", len(bucket)))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tags))


def recording_engine(dtype: torch.dtype = torch.bfloat16) -> VLLMEngine:
    """kpipe's engine class around a recording LLM (its sleep and wake_up are the ones under test)."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.asleep = RecordingLLM(dtype), set()
    return engine


def model_of(sizes: list[int]) -> torch.nn.Module:
    """An fp32 model whose parameters have these element counts, named p0, p1, ..."""
    model = torch.nn.Module()
    for index, size in enumerate(sizes):
        model.register_parameter(f"p{index}", torch.nn.Parameter(torch.randn(size)))
    return model


@pytest.mark.parametrize("budget", [8, 40, 64, 1000])
def test_buckets_keep_to_their_budget_and_carry_every_tensor_once_cast(budget):
    model = model_of([4, 10, 3, 30, 1, 7, 16])  # bf16: 8, 20, 6, 60, 2, 14, 32 bytes
    buckets = list(rollouts.weight_buckets(rollouts.full_weights(model), torch.bfloat16, budget))
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == [f"p{i}" for i in range(7)]  # each once, in order
    for bucket in buckets:
        size = sum(tensor.numel() * 2 for _, tensor in bucket)
        assert size <= budget or len(bucket) == 1, (budget, [n for n, _ in bucket])  # a larger tensor goes alone
        assert all(tensor.dtype == torch.bfloat16 for _, tensor in bucket)
    for name, tensor in (item for bucket in buckets for item in bucket):
        assert torch.equal(tensor, getattr(model, name).detach().to(torch.bfloat16))
    # the buckets are full: no two neighbours would fit the budget together
    sizes = [sum(tensor.numel() * 2 for _, tensor in bucket) for bucket in buckets]
    assert all(a + b > budget for a, b in zip(sizes, sizes[1:]))


def test_an_fp32_trainer_pushes_bf16_buckets_then_resets_the_prefix_cache():
    engine = recording_engine()
    model = model_of([100, 100, 300, 50])
    assert rollouts.push_weights_to_vllm(engine, model, bucket_bytes=400) == 3
    assert engine.llm.calls == [("push", 2), ("push", 1), ("push", 1), ("reset_prefix_cache", None)]
    pushed = dict(item for bucket in engine.llm.buckets for item in bucket)
    assert set(pushed) == {"p0", "p1", "p2", "p3"} and {t.dtype for t in pushed.values()} == {torch.bfloat16}
    fp32 = recording_engine(torch.float32)  # an engine in fp32 gets the trainer's tensors uncast
    rollouts.push_weights_to_vllm(fp32, model)
    assert all(t.dtype == torch.float32 for bucket in fp32.llm.buckets for _, t in bucket)


def test_a_sleeping_engine_wakes_for_its_weights_takes_the_push_then_wakes_for_its_kv_cache():
    engine, timer = recording_engine(), PhaseTimer()
    engine.sleep()
    assert engine.asleep == {"weights", "kv_cache"}
    rollouts.feed_vllm(engine, model_of([4, 4]), timer)
    assert engine.llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("push", 2), ("reset_prefix_cache", None),
                                ("wake_up", ["kv_cache"])]
    assert not engine.asleep and set(timer.metrics()) == {"sleep_wake_s", "push_s"}
    # awake (sleep mode off, or the iteration's first push): the push alone
    awake, timer = recording_engine(), PhaseTimer()
    rollouts.feed_vllm(awake, model_of([4]), timer)
    assert awake.llm.calls == [("push", 1), ("reset_prefix_cache", None)] and set(timer.metrics()) == {"push_s"}


def test_vllm_sleep_asks_for_sleep_mode_and_refuses_generating_during_the_update():
    assert rollouts.vllm_engine_args(RLConfig(engine="vllm", vllm_sleep=True), 1)["enable_sleep_mode"] is True
    with pytest.raises(ValueError, match="vllm_sleep"):
        RLConfig(engine="vllm", vllm_sleep=True, async_mode="off_policy_1")
    RLConfig(engine="hf", vllm_sleep=True, async_mode="off_policy_1")  # no vLLM engine: nothing sleeps
    RLConfig(engine="vllm", vllm_sleep=True, async_mode="eval")
