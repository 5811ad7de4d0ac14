"""Pulling the candidate program out of a model's answer.

Rule: drop reasoning (`<think>...</think>`), then take the last closed fenced code block
(```python, ```py or bare ```) that defines `class ModelNew`. The last one because models
revise in place ("here is the fixed version"); one defining ModelNew because answers often
also quote the reference or a usage snippet. Anything else is a `format_error`, reported
as a status so it costs the turn, not the episode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORMAT_ERROR = "format_error"
THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
FENCE_RE = re.compile(r"```[ \t]*(?P<lang>[\w+-]*)[ \t]*\r?\n(?P<code>.*?)```", re.DOTALL)
CODE_LANGS = {"", "python", "py", "python3"}
MODEL_NEW_RE = re.compile(r"^\s*class\s+ModelNew\b", re.MULTILINE)


@dataclass(frozen=True)
class Extracted:
    """The candidate code, or why there is none (`reason` then explains the format error)."""

    code: str | None
    reason: str | None = None

    @property
    def status(self) -> str | None:
        return None if self.code is not None else FORMAT_ERROR


def strip_reasoning(text: str) -> str:
    """The answer without `<think>` blocks; an unclosed `<think>` means no answer was given."""
    text = THINK_RE.sub("", text)
    opened = text.find("<think>")
    return text[:opened] if opened >= 0 else text


def extract_code(response: str) -> Extracted:
    """The last fenced Python block of `response` that defines `class ModelNew`."""
    answer = strip_reasoning(response)
    blocks = [m.group("code") for m in FENCE_RE.finditer(answer) if m.group("lang").lower() in CODE_LANGS]
    candidates = [code for code in blocks if MODEL_NEW_RE.search(code)]
    if candidates:
        return Extracted(candidates[-1].strip() + "\n")
    if answer.count("```") % 2 == 1 and MODEL_NEW_RE.search(answer.rsplit("```", 1)[-1]):
        return Extracted(None, "the code block defining ModelNew is not closed (answer truncated?)")
    if blocks:
        return Extracted(None, "no code block defines `class ModelNew`")
    return Extracted(None, "no fenced ```python code block in the answer")
