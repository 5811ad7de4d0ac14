"""Hugging Face transformers generation for small or offline models (and RL rollouts on CPU).

Batched with left padding (decoder-only models continue from the right edge). Per-token
log-probabilities are those of the sampled tokens under the *sampling* distribution,
log_softmax(logits / temperature), which is what the trainer recomputes for the
mismatch ratio π_train/π_rollout (MRS); top-p truncation is not folded in.

With an `on_result` callback, each sequence is handed over the step it emits EOS, while the rest
of its batch still decodes (`FinishedRows`): the agent loop evaluates it meanwhile. The sampled
tokens do not change (the hand-over only reads the batch), so the completions are the same.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from itertools import groupby
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from kpipe.llm.types import ChatRequest, Completion, Message, ResultCallback, Usage

PLAIN_CHAT_ROLE = "<|{role}|>\n"  # used only when a tokenizer has no chat template
# Attention kernels for decoding: every one PyTorch has but cuDNN's. torch 2.11 prefers cuDNN's on
# an H100/H200, and it builds a cuDNN graph for every new key length, so every decode step: 23.7 ms
# of host time per call, 12 of the 15 s of an RL step's 64 rollouts on an H200 against ~3 s without
# (checks/gpu/rl_generation.py, `965801b:docs/gpu-results/rl_generation_2026-11-26_H200.md`).
DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def plain_chat_prompt(messages: list[Message]) -> str:
    """A role-tagged transcript for tokenizers without a chat template (tiny local models)."""
    parts = [PLAIN_CHAT_ROLE.format(role=m["role"]) + m["content"] + "\n" for m in messages]
    return "".join(parts) + PLAIN_CHAT_ROLE.format(role="assistant")


class SampledTokenLogprobs:
    """A generate() logits processor recording log_softmax(logits / T) of each sampled token as
    generation runs, holding one step's distribution at a time. `output_logits` would keep every
    step's full-vocabulary fp32 logits instead: 600 KB per token per sequence at Qwen's 151,936
    tokens, tens of GB for a batch of 8K-token answers.

    transformers applies user processors before its temperature and top-p warpers, so `scores`
    are the model's logits (the token sampled at step t shows as the last input id at step t+1)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0
        self.pending: torch.Tensor | None = None  # log-probs of the step whose token is not known yet
        self.values: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.values.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def row(self, row: int, last_token: int) -> list[float]:
        """One row's log-probs so far, given the token it sampled at the current step."""
        assert self.pending is not None, "generate() ran no step"
        return [float(step[row]) for step in self.values] + [float(self.pending[row, last_token])]

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) log-probs, given the tokens sampled at the last step."""
        assert self.pending is not None, "generate() ran no step"
        self.values.append(self.pending.gather(-1, last_tokens.unsqueeze(-1)).squeeze(-1))
        self.pending = None
        return torch.stack(self.values, dim=1)


class FinishedRows(StoppingCriteria):
    """Calls `report(row, new_token_ids)` at the step a row of a generate() batch first emits one of
    `eos_ids`, so it can be handed over while the other rows decode. Stops nothing itself (the EOS
    criterion does): it only reads the batch, so sampling is unchanged."""

    def __init__(self, prompt_len: int, eos_ids: set[int], report: Callable[[int, list[int]], None]) -> None:
        self.prompt_len, self.report = prompt_len, report
        self.eos = torch.tensor(sorted(eos_ids))
        self.done: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        finished = torch.isin(input_ids[:, -1], self.eos.to(input_ids.device))
        if self.done is None:
            self.done = torch.zeros_like(finished)
        for row in (finished & ~self.done).nonzero().flatten().tolist():
            self.report(row, input_ids[row, self.prompt_len:].tolist())
        self.done |= finished
        return torch.zeros_like(finished)


def batch_seed(requests: list[ChatRequest], base_seed: int) -> int:
    """One torch seed per batch, derived from its requests' seeds: same batch, same samples."""
    text = f"{base_seed}:" + ",".join(str(r.seed) for r in requests)
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


class HFEngine:
    """Generation from an in-memory HF causal LM (the RL trainer passes its live policy)."""

    def __init__(self, model: Any, tokenizer: Any, name: str, batch_size: int = 8, seed: int = 0,
                 progress: bool = True) -> None:
        self.hf_model = model
        self.tokenizer = tokenizer
        self.model = name
        self.batch_size = batch_size
        self.seed = seed
        self.progress = progress
        self.usage = Usage()
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token

    @classmethod
    def from_pretrained(cls, path: str, device: str | None = None, dtype: str = "auto", **kwargs: Any) -> HFEngine:
        """Load a local checkpoint (no network: `local_files_only`)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
        return cls(model.eval(), tokenizer, name=kwargs.pop("name", str(path)), **kwargs)

    def prompt_text(self, messages: list[Message]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return plain_chat_prompt(messages)

    def prompt_tokens(self, chats: list[list[Message]]) -> list[int]:
        """Each prompt's tokens as `_generate_batch` encodes it."""
        encoded = self.tokenizer([self.prompt_text(messages) for messages in chats], add_special_tokens=False)
        return [len(ids) for ids in encoded["input_ids"]]

    def generate(self, requests: list[ChatRequest], on_result: ResultCallback | None = None) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc=f"generate {self.model}", disable=not self.progress, leave=False) as bar:
            for indices in self._batches(requests):

                def finished(row: int, completion: Completion, indices: list[int] = indices) -> None:
                    results[indices[row]] = completion
                    self.usage.add(completion)
                    if on_result is not None:
                        on_result(indices[row], completion)

                self._generate_batch([requests[i] for i in indices], finished, early=on_result is not None)
                bar.update(len(indices))
        return results  # type: ignore[return-value]

    def _batches(self, requests: list[ChatRequest]) -> Iterator[list[int]]:
        """Index batches of requests sharing sampling parameters (one `generate` call each)."""
        def params(i: int) -> tuple:
            r = requests[i]
            return (r.temperature, r.top_p, r.max_tokens, r.logprobs)

        for _, group in groupby(sorted(range(len(requests)), key=params), key=params):
            group = list(group)
            for start in range(0, len(group), self.batch_size):
                yield group[start : start + self.batch_size]

    @torch.no_grad()
    def _generate_batch(self, batch: list[ChatRequest], finished: Callable[[int, Completion], None],
                        early: bool) -> None:
        """Generate one batch, calling `finished(row, completion)` once per row: at the step it emits
        EOS when `early`, else (and for rows cut at `max_tokens`) after the batch."""
        first = batch[0]
        device = next(self.hf_model.parameters()).device
        encoded = self.tokenizer([self.prompt_text(r.messages) for r in batch], return_tensors="pt", padding=True,
                                 add_special_tokens=False).to(device)
        prompt_len = encoded["input_ids"].shape[1]
        sampling = first.temperature > 0
        torch.manual_seed(batch_seed(batch, self.seed))
        recorder = SampledTokenLogprobs(first.temperature) if first.logprobs else None
        started = time.perf_counter()
        reported: set[int] = set()

        def report(row: int, ids: list[int], logprobs: list[float] | None) -> None:
            reported.add(row)
            latency = (time.perf_counter() - started) / len(batch)
            finished(row, self._completion(ids, logprobs, int(encoded["attention_mask"][row].sum()), latency))

        def report_early(row: int, ids: list[int]) -> None:
            report(row, ids, recorder.row(row, ids[-1]) if recorder else None)

        criteria = [FinishedRows(prompt_len, self._eos_ids(), report_early)] if early and self._eos_ids() else []
        with sdpa_kernel(DECODE_ATTENTION):
            out = self.hf_model.generate(
                **encoded,
                do_sample=sampling,
                temperature=first.temperature if sampling else None,
                top_p=first.top_p if sampling else None,
                top_k=None,
                max_new_tokens=first.max_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                return_dict_in_generate=True,
                logits_processor=LogitsProcessorList([recorder]) if recorder else None,
                stopping_criteria=StoppingCriteriaList(criteria) if criteria else None,
            )
        new_tokens = out.sequences[:, prompt_len:]
        logprobs = recorder.finish(new_tokens[:, -1]).cpu() if recorder else None
        for row in range(len(batch)):
            if row not in reported:
                report(row, new_tokens[row].tolist(), logprobs[row].tolist() if logprobs is not None else None)

    def _completion(self, ids: list[int], logprobs: list[float] | None, prompt_tokens: int,
                    latency: float) -> Completion:
        n, finish = self._response_length(ids)
        return Completion(text=self.tokenizer.decode(ids[:n], skip_special_tokens=True), finish_reason=finish,
                          prompt_tokens=prompt_tokens, completion_tokens=n, token_ids=ids[:n],
                          logprobs=logprobs[:n] if logprobs is not None else None, latency_s=latency)

    def _eos_ids(self) -> set[int]:
        eos = self.tokenizer.eos_token_id
        return {token for token in (eos if isinstance(eos, list) else [eos]) if token is not None}

    def _response_length(self, ids: list[int]) -> tuple[int, str]:
        """Tokens up to and including the first EOS ("stop"), else all of them ("length")."""
        eos_ids = self._eos_ids()
        for position, token in enumerate(ids):
            if token in eos_ids:
                return position + 1, "stop"
        return len(ids), "length"
