"""vLLM in process, for RL rollouts and evaluation at scale (GPU machines only).

Thin on purpose: vLLM cannot be installed on CPU-only machines, so nothing here runs in CI;
`tests/test_vllm_api.py` checks the arguments and fields below against the source of vLLM 0.26.0 and 0.33.0 (the
`vllm` extra's pin). The offline API: `LLM.chat(list_of_conversations,
sampling_params)` returns one `RequestOutput` per conversation, whose `outputs[0]` carries
`text`, `token_ids`, `finish_reason` and, with `SamplingParams(logprobs=0)`, `logprobs` =
one {token_id: Logprob} dict per generated token holding the sampled token (a list, or vLLM's
`FlatLogprobs`, which indexes and iterates the same way).
Rollout log-probabilities for MRS should come from the sampling distribution: start the
engine with `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) so they include temperature.

Sleep mode (RL's colocated engine, `rl.vllm_sleep`): built with `enable_sleep_mode=True`, the engine
can give the trainer its GPU memory between generations (`sleep`) and take it back tag by tag
(`wake_up`), as vLLM 0.26.0's `LLM.sleep`/`LLM.wake_up` do (`vllm/entrypoints/llm.py:796-835`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from kpipe.llm.types import ChatRequest, Completion, Message, ResultCallback, Usage


def _require_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise RuntimeError("the vllm engine needs vLLM: pip install 'kpipe[vllm]' on a GPU machine") from error
    return vllm


class VLLMEngine:
    """One `vllm.LLM` held for the life of the engine; `llm_kwargs` go to its constructor."""

    def __init__(self, model_path: str, name: str | None = None, seed: int = 0, **llm_kwargs: Any) -> None:
        vllm = _require_vllm()
        self._vllm = vllm
        self.model = name or model_path
        self.seed = seed
        self.usage = Usage()
        self.llm = vllm.LLM(model=model_path, seed=seed, **llm_kwargs)
        self.asleep: set[str] = set()  # the memory tags (weights, kv_cache) the engine has not taken back yet

    def sleep(self) -> None:
        """Level 2: the weights and the KV cache leave the GPU, nothing is copied to the host (vLLM 0.26.0,
        `vllm/v1/worker/gpu_worker.py:192-225`). Right when the next use starts with a push of new weights
        anyway. The scheduler pauses and the prefix cache is cleared (`vllm/v1/engine/core.py:860-896`)."""
        self.llm.sleep(level=2)
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tag: str) -> None:
        """Take back one memory tag: ``weights`` (allocated, not restored: a level-2 sleep discarded them) or
        ``kv_cache``. Scheduling resumes only once both are back (`vllm/v1/engine/core.py:898-914`)."""
        self.llm.wake_up(tags=[tag])
        self.asleep.discard(tag)

    def sampling_params(self, request: ChatRequest) -> Any:
        return self._vllm.SamplingParams(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_tokens,
            seed=request.seed,
            logprobs=0 if request.logprobs else None,
        )

    def prompt_tokens(self, chats: list[list[Message]]) -> list[int]:
        """Each prompt's tokens as `LLM.chat` renders it: the model's chat template, then its tokenizer without
        special tokens (vLLM 0.26.0's default for chat); a prompt of `max_model_len` tokens or more it refuses."""
        tokenizer = self.llm.get_tokenizer()
        texts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) for messages in chats]
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def generate(self, requests: list[ChatRequest], on_result: ResultCallback | None = None) -> list[Completion]:
        import torch

        # the RL trainer generates under its accelerator's bf16 autocast (for HF rollouts); the in-process
        # engine core runs in this thread, and vLLM's own eager ops (sampler, attention glue) must
        # compute as vLLM configured them, as they would in a separate process
        with torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext():
            outputs = self.llm.chat(
                [r.messages for r in requests], [self.sampling_params(r) for r in requests], use_tqdm=True
            )
        completions = []
        for index, (request, output) in enumerate(zip(requests, outputs, strict=True)):
            sample = output.outputs[0]
            logprobs = None
            if request.logprobs and sample.logprobs is not None:
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids, strict=True)]
            completion = Completion(
                text=sample.text,
                finish_reason=sample.finish_reason or "stop",
                prompt_tokens=len(output.prompt_token_ids or []),
                completion_tokens=len(sample.token_ids),
                token_ids=list(sample.token_ids),
                logprobs=logprobs,
            )
            self.usage.add(completion)
            if on_result is not None:
                on_result(index, completion)
            completions.append(completion)
        return completions
