"""History policies: which earlier turns the model sees when it writes the next one.

Every policy starts from the first-turn messages (system + task) and then replays a
selection of earlier turns, each as (assistant answer, user feedback-and-refine request):

- `full`: every turn (the paper's training and "vanilla extrapolation" in STTS);
- `top_w`: the w turns with the highest reward, in their original order (paper §6.3, w = 4);
- `best_window`: the w consecutive turns with the highest summed reward (the released code);
- `kevin`: every turn, with earlier answers' reasoning replaced by their summary and code
  (Kevin-32B strips earlier chains of thought to keep the context bounded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kpipe.llm.extract import FENCE_RE, strip_reasoning
from kpipe.llm.prompts import PROMPT_VERSION, refine_message, summarised_answer
from kpipe.llm.types import Message

SUMMARY_CHARS = 1500  # an earlier turn's summary is cut to this (it spends the policy's context)


@dataclass(frozen=True)
class PastTurn:
    """What a policy needs of an earlier turn."""

    turn: int  # 1-based
    response: str
    code: str | None
    feedback: str
    reward: float


class HistoryPolicy(Protocol):
    name: str

    def select(self, turns: Sequence[PastTurn]) -> list[PastTurn]:
        """The earlier turns to replay, in order."""
        ...

    def answer_text(self, turn: PastTurn, version: str) -> str:
        """How an earlier answer is shown."""
        ...


def replay(first: list[Message], policy: HistoryPolicy, turns: Sequence[PastTurn],
           version: str = PROMPT_VERSION) -> list[Message]:
    """The context for the next turn under `policy`."""
    messages = list(first)
    for turn in policy.select(turns):
        messages.append({"role": "assistant", "content": policy.answer_text(turn, version)})
        messages.append(refine_message(turn.feedback, turn.turn, version))
    return messages


@dataclass(frozen=True)
class FullHistory:
    name: str = "full"

    def select(self, turns: Sequence[PastTurn]) -> list[PastTurn]:
        return list(turns)

    def answer_text(self, turn: PastTurn, version: str) -> str:
        return turn.response


def top_w_turns(turns: Sequence[PastTurn], w: int) -> list[PastTurn]:
    """The w highest-reward turns (ties: the later turn wins), in chronological order."""
    ranked = sorted(turns, key=lambda t: (t.reward, t.turn), reverse=True)[:w]
    return sorted(ranked, key=lambda t: t.turn)


def best_window(turns: Sequence[PastTurn], w: int) -> list[PastTurn]:
    """The w consecutive turns with the highest summed reward (ties: the latest window)."""
    if len(turns) <= w:
        return list(turns)
    starts = range(len(turns) - w + 1)
    best = max(starts, key=lambda s: (sum(t.reward for t in turns[s : s + w]), s))
    return list(turns[best : best + w])


@dataclass(frozen=True)
class TopW:
    w: int = 4
    name: str = "top_w"

    def select(self, turns: Sequence[PastTurn]) -> list[PastTurn]:
        return top_w_turns(turns, self.w)

    def answer_text(self, turn: PastTurn, version: str) -> str:
        return turn.response


@dataclass(frozen=True)
class BestWindow:
    w: int = 4
    name: str = "best_window"

    def select(self, turns: Sequence[PastTurn]) -> list[PastTurn]:
        return best_window(turns, self.w)

    def answer_text(self, turn: PastTurn, version: str) -> str:
        return turn.response


def answer_summary(response: str) -> str:
    """The visible prose of an answer outside its code blocks and reasoning (our prompt asks
    for a closing summary), cut to SUMMARY_CHARS."""
    prose = FENCE_RE.sub("", strip_reasoning(response)).strip()
    return prose[-SUMMARY_CHARS:]


@dataclass(frozen=True)
class KevinSummaries:
    name: str = "kevin"

    def select(self, turns: Sequence[PastTurn]) -> list[PastTurn]:
        return list(turns)

    def answer_text(self, turn: PastTurn, version: str) -> str:
        return summarised_answer(turn.turn, answer_summary(turn.response), turn.code, version)


POLICIES = {"full": FullHistory, "top_w": TopW, "best_window": BestWindow, "kevin": KevinSummaries}


def make_policy(name: str, w: int = 4) -> HistoryPolicy:
    """A policy by config name; `w` applies to top_w and best_window."""
    if name not in POLICIES:
        raise ValueError(f"unknown history policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](w=w) if name in ("top_w", "best_window") else POLICIES[name]()
