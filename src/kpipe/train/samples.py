"""SFT samples from `trajectories` rows: chat-templated token ids with assistant-only labels.

A trajectory row holds one turn: ``prompt_messages`` (the exact context the model saw) and
its ``response``. Two ways to cut samples:

- ``unit="trajectory"`` (the paper's "8K 5-turn trajectories" and the released code, verl multi-turn
  SFT): one sample per trajectory, its last turn's context plus response, loss on every assistant
  message in it.
- ``unit="turn"``: one sample per row, the context plus that turn's response, loss on that response
  only (as RL trains its turns; the offline default, whose tiny model learns faster from it).

Labels are found on the rendered text, not by rendering prefixes: templates such as Qwen3's
render an assistant turn differently once a later user turn follows it, so prefix renders are
not prefixes of the full render. Each message's content is located in order in the full
render and mapped to tokens with the fast tokenizer's character offsets.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from kpipe.data.io import read_table

IGNORE_INDEX = -100  # torch cross-entropy's ignore_index: positions without a loss
UNITS = ("turn", "trajectory")
OUTCOME_FILTERS = ("all", "passed_turns", "passed_trajectories")
OVERLONG = ("drop", "truncate")
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


@dataclass(frozen=True)
class Sample:
    """One training sequence; `labels[i]` is `input_ids[i]` where the loss applies, else IGNORE_INDEX."""

    key: str
    input_ids: list[int]
    labels: list[int]

    @property
    def n_label_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass
class SampleReport:
    """What happened to every input row, so a filtered-away dataset is visible, not silent."""

    rows: int = 0
    filtered_out: int = 0  # failed the outcome filter
    empty_responses: int = 0
    conversations: int = 0
    overlong: int = 0  # longer than max_length before dropping/truncating
    dropped_overlong: int = 0
    truncated: int = 0
    dropped_no_labels: int = 0  # truncation removed every labelled token
    samples: int = 0
    tokens: int = 0
    label_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Conversation:
    key: str
    messages: list[dict[str, str]]
    labelled: frozenset[int]  # indices of the assistant messages that carry the loss


def load_trajectory_rows(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """All rows of one or more `trajectories` Parquet files, schema-checked."""
    return read_table(paths, "trajectories").to_pylist()


def turn_passed(row: dict[str, Any]) -> bool:
    """A turn counts as passed only if it is correct and not flagged as a hack."""
    return row.get("status") == "pass" and bool(row.get("correct")) and not row.get("hacked")


def trajectory_id(row: dict[str, Any]) -> tuple:
    return (row.get("run"), row.get("stage"), row.get("iteration"), row.get("task_id"), row.get("sample"))


def filter_by_outcome(rows: Sequence[dict[str, Any]], keep: str) -> list[dict[str, Any]]:
    """Rows kept by an outcome filter: all, only passed turns, or every turn of a trajectory that passed once."""
    if keep not in OUTCOME_FILTERS:
        raise ValueError(f"unknown outcome filter {keep!r}; choose one of {OUTCOME_FILTERS}")
    if keep == "all":
        return list(rows)
    if keep == "passed_turns":
        return [row for row in rows if turn_passed(row)]
    passed = {trajectory_id(row) for row in rows if turn_passed(row)}
    return [row for row in rows if trajectory_id(row) in passed]


def to_conversations(rows: Sequence[dict[str, Any]], unit: str) -> list[Conversation]:
    """Cut rows into conversations to tokenise (see the module docstring for the two units)."""
    if unit not in UNITS:
        raise ValueError(f"unknown sample unit {unit!r}; choose one of {UNITS}")
    if unit == "trajectory":
        last_turns: dict[tuple, dict[str, Any]] = {}
        for row in rows:
            tid = trajectory_id(row)
            if tid not in last_turns or row["turn"] > last_turns[tid]["turn"]:
                last_turns[tid] = row
        rows = list(last_turns.values())
    conversations = []
    for row in rows:
        messages = [dict(m) for m in row["prompt_messages"]] + [{"role": "assistant", "content": row["response"]}]
        if unit == "turn":
            labelled = frozenset({len(messages) - 1})
        else:
            labelled = frozenset(i for i, m in enumerate(messages) if m["role"] == "assistant")
        key = f"{row.get('run')}/{row.get('task_id')}/s{row.get('sample')}/t{row.get('turn')}"
        conversations.append(Conversation(key, messages, labelled))
    return conversations


def label_spans(text: str, messages: Sequence[dict[str, str]], labelled: frozenset[int],
                end_markers: Sequence[str]) -> list[tuple[int, int]]:
    """Character spans of the labelled messages' contents (plus their end-of-turn marker) in `text`."""
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        content = message["content"] or ""
        start = text.find(content, cursor) if content else -1
        if start < 0:
            if index in labelled:
                raise ValueError(f"assistant message {index} does not appear verbatim in the chat-template render")
            continue
        end = start + len(content)
        cursor = end
        if index in labelled:
            marker = next((m for m in end_markers if m and text.startswith(m, end)), "")
            spans.append((start, end + len(marker)))
    return spans


def labels_from_spans(offsets: np.ndarray, input_ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Labels for tokens whose characters overlap a labelled span; IGNORE_INDEX elsewhere."""
    inside = np.zeros(len(input_ids), dtype=bool)
    if len(offsets):
        starts, ends = offsets[:, 0], offsets[:, 1]
        for span_start, span_end in spans:
            inside |= (starts < span_end) & (ends > span_start)
    ids = np.asarray(input_ids, dtype=np.int64)
    return np.where(inside, ids, IGNORE_INDEX).tolist()


def tokenize_conversations(tokenizer: Any, conversations: Sequence[Conversation],
                           chunk: int = 256) -> list[Sample]:
    """Render each conversation with the tokenizer's chat template and label its assistant tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template; set sft.chat_template to 'chatml' or use a chat model's tokenizer")
    end_markers = tuple(dict.fromkeys([tokenizer.eos_token or "", *END_OF_TURN_MARKERS]))
    samples = []
    for begin in tqdm(range(0, len(conversations), chunk), desc="tokenise", unit="chunk", leave=False):
        batch = conversations[begin:begin + chunk]
        texts = [tokenizer.apply_chat_template(c.messages, tokenize=False) for c in batch]
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for conv, text, ids, offsets in zip(batch, texts, encoded["input_ids"], encoded["offset_mapping"]):
            spans = label_spans(text, conv.messages, conv.labelled, end_markers)
            labels = labels_from_spans(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), ids, spans)
            samples.append(Sample(conv.key, list(ids), labels))
    return samples


def fit_length(sample: Sample, max_length: int, overlong: str) -> Sample | None:
    """`sample` if it fits; else dropped (None) or cut to its first `max_length` tokens."""
    if len(sample.input_ids) <= max_length:
        return sample
    if overlong == "drop":
        return None
    return Sample(sample.key, sample.input_ids[:max_length], sample.labels[:max_length])


def build_samples(rows: Sequence[dict[str, Any]], tokenizer: Any, max_length: int, overlong: str = "drop",
                  keep: str = "all", unit: str = "turn") -> tuple[list[Sample], SampleReport]:
    """SFT samples from trajectory rows, and a report of how many were filtered, dropped or cut."""
    if overlong not in OVERLONG:
        raise ValueError(f"unknown overlong policy {overlong!r}; choose one of {OVERLONG}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    report = SampleReport(rows=len(rows))
    kept_rows = filter_by_outcome(rows, keep)
    report.filtered_out = len(rows) - len(kept_rows)
    with_response = [row for row in kept_rows if row.get("response")]
    report.empty_responses = len(kept_rows) - len(with_response)
    conversations = to_conversations(with_response, unit)
    report.conversations = len(conversations)
    samples = []
    for sample in tokenize_conversations(tokenizer, conversations):
        fitted = fit_length(sample, max_length, overlong)
        report.overlong += len(sample.input_ids) > max_length
        if fitted is None:
            report.dropped_overlong += 1
        elif fitted.n_label_tokens == 0:
            report.dropped_no_labels += 1
        else:
            report.truncated += fitted is not sample
            samples.append(fitted)
    report.samples = len(samples)
    report.tokens = sum(len(s.input_ids) for s in samples)
    report.label_tokens = sum(s.n_label_tokens for s in samples)
    return samples, report
