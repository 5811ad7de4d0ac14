"""The offline teacher: a stand-in for the paper's API model (GPT-5) that needs no network.

It answers from the bank of known solutions (`kpipe.gym.bank`): it recognises the task
from the reference code in the first user turn, and behaves like a model that learns from
feedback — often a buggy variant first (compile error, wrong index, missing mask, wrong
dtype), the legit solution after feedback, and the legit one again once it has passed.
Every choice is seeded by the request's content (feedback by its statuses), so a rerun gets the
same answers (and the response cache's hashes stay valid). Unknown tasks get a code-less answer or a generic
attempt (the reference renamed to ModelNew, which KernelGym rejects): feedback still flows.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kpipe.data.source_text import normalise_source
from kpipe.llm.extract import FENCE_RE, extract_code
from kpipe.llm.server import approx_tokens
from kpipe.llm.types import ChatRequest, Completion

LEGIT = "legit"


class SolutionLike(Protocol):
    """What the teacher needs of a `kpipe.gym.bank.Solution`."""

    task_name: str
    level: int
    problem_id: int
    variant: str
    source: str


@dataclass(frozen=True)
class TeacherBehaviour:
    """How good the teacher is: P(legit at turn 1) and P(fixing a failed answer next turn)."""

    p_first_legit: float = 0.3
    p_fix: float = 0.7


def task_fingerprint(src: str) -> str | None:
    """A hash of a reference program that ignores its module-level integer constants.

    Tasks are given with sizes capped (`shrink_sizes`) or at full size; erasing every
    module-level int makes both forms of one task hash alike. Tasks differing only in sizes
    collide, which is harmless: their solutions do not depend on the sizes.
    None when the text is not a program defining `class Model`.
    """
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    if not any(isinstance(node, ast.ClassDef) and node.name == "Model" for node in tree.body):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and not isinstance(node.value, (ast.Lambda, ast.Call)):
            node.value = ast.Constant(0)
    return hashlib.sha256(normalise_source(ast.unparse(tree)).encode()).hexdigest()[:16]


def code_fingerprint(src: str) -> str:
    return hashlib.sha256(normalise_source(src).encode()).hexdigest()[:16]


# the judge's status: the first line of KernelGym's feedback that starts with it (the judge writes it
# before anything else, and quotes every line of the candidate's own text behind a prefix,
# kpipe.gym.judge.feedback), never a "Status:" the candidate's output forged further on
FEEDBACK_STATUS_RE = re.compile(r"^Status: (\w+)", re.MULTILINE)


def feedback_status(feedback: str) -> list[str]:
    """The judge's status of a feedback turn, as a list (empty when there is none)."""
    found = FEEDBACK_STATUS_RE.search(feedback)
    return [found.group(1)] if found else []


def content_rng(request: ChatRequest) -> random.Random:
    """A generator seeded by the request, so the same request gets the same answer. Feedback
    turns count by their KernelGym statuses only: their timings, memory garbage in a wrong
    kernel's outputs and scratch paths differ from run to run, and a rerun must still get the
    same answers."""
    first_user = next((i for i, m in enumerate(request.messages) if m["role"] == "user"), -1)
    seen = [
        m if m["role"] != "user" or i == first_user else {"role": "user", "statuses": feedback_status(m["content"])}
        for i, m in enumerate(request.messages)
    ]
    payload = json.dumps({"messages": seen, "seed": request.seed}, sort_keys=True)
    return random.Random(hashlib.sha256(payload.encode()).hexdigest())


def rename_model(src: str) -> str:
    """The reference with `Model` renamed to `ModelNew`: a lazy 'generic attempt'."""
    return re.sub(r"\bModel\b", "ModelNew", src)


class Teacher:
    """A `Responder` over a bank of solutions and the references of their tasks."""

    def __init__(self, solutions: Iterable[SolutionLike], references: dict[tuple[int, int], list[str]],
                 behaviour: TeacherBehaviour = TeacherBehaviour()) -> None:
        self.behaviour = behaviour
        self.by_task: dict[tuple[int, int], list[SolutionLike]] = {}
        for solution in solutions:
            self.by_task.setdefault((solution.level, solution.problem_id), []).append(solution)
        self.task_of_fingerprint: dict[str, tuple[int, int]] = {}
        for key in self.by_task:
            for reference in references.get(key, []):
                fingerprint = task_fingerprint(reference)
                if fingerprint is not None:
                    self.task_of_fingerprint.setdefault(fingerprint, key)
        self.variant_of_code = {code_fingerprint(s.source): s for group in self.by_task.values() for s in group}

    @classmethod
    def from_bank(cls, versions: Iterable[str] = ("main", "v0"), behaviour: TeacherBehaviour = TeacherBehaviour()
                  ) -> Teacher:
        """The teacher over `kpipe.gym.bank.list_solutions()` and the vendored KernelBench references."""
        from kpipe.data.kernelbench import load_problems
        from kpipe.gym.bank import list_solutions

        references: dict[tuple[int, int], list[str]] = {}
        for version in versions:
            for problem in load_problems(version):
                references.setdefault((problem.level, problem.problem_id), []).append(problem.code)
        return cls(list_solutions(), references, behaviour)

    def recognise(self, messages: list[dict[str, str]]) -> tuple[int, int] | None:
        """The (level, problem_id) whose reference appears in the first user turn (last match wins:
        the task's reference comes after the template's example)."""
        first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
        for match in reversed(list(FENCE_RE.finditer(first_user))):
            fingerprint = task_fingerprint(match.group("code"))
            if fingerprint in self.task_of_fingerprint:
                return self.task_of_fingerprint[fingerprint]
        return None

    def previous_solution(self, messages: list[dict[str, str]]) -> SolutionLike | None:
        """The bank entry this teacher answered last turn, if the last answer was one."""
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        if not answers:
            return None
        code = extract_code(answers[-1]).code
        return self.variant_of_code.get(code_fingerprint(code)) if code else None

    def choose(self, solutions: list[SolutionLike], previous: SolutionLike | None, turn: int,
               rng: random.Random) -> SolutionLike:
        legit = [s for s in solutions if s.variant == LEGIT]
        buggy = [s for s in solutions if s.variant != LEGIT]
        if not legit or not buggy:
            return rng.choice(legit or buggy)
        if previous is not None and previous.variant == LEGIT:
            return rng.choice(legit)
        p_legit = self.behaviour.p_first_legit if turn == 1 else self.behaviour.p_fix
        if rng.random() < p_legit:
            return rng.choice(legit)
        others = [s for s in buggy if previous is None or s.variant != previous.variant]
        return rng.choice(others or buggy)

    def answer_text(self, request: ChatRequest, rng: random.Random) -> str:
        turn = 1 + sum(m["role"] == "assistant" for m in request.messages)
        task = self.recognise(request.messages)
        if task is None:
            return self.unknown_task_answer(request, rng)
        previous = self.previous_solution(request.messages)
        solution = self.choose(self.by_task[task], previous, turn, rng)
        opening = (
            "The reference's operators can be fused into a Triton kernel that reads each input once."
            if turn == 1
            else "Based on the feedback, I revise the previous implementation."
        )
        return (
            f"{opening}\n\n```python\n{solution.source.strip()}\n```\n\n"
            f"Summary: Triton implementation of {solution.task_name} (turn {turn})."
        )

    def unknown_task_answer(self, request: ChatRequest, rng: random.Random) -> str:
        first_user = next((m["content"] for m in request.messages if m["role"] == "user"), "")
        blocks = [m.group("code") for m in FENCE_RE.finditer(first_user) if task_fingerprint(m.group("code"))]
        if not blocks or rng.random() < 0.5:
            return "This architecture is unfamiliar to me; I need more information before writing a kernel."
        return f"A first attempt:\n\n```python\n{rename_model(blocks[-1]).strip()}\n```\n"

    def respond(self, request: ChatRequest) -> Completion:
        text = self.answer_text(request, content_rng(request))
        prompt_tokens = sum(approx_tokens(m["content"]) for m in request.messages)
        if approx_tokens(text) > request.max_tokens:
            text, finish = text[: request.max_tokens * 4], "length"
        else:
            finish = "stop"
        return Completion(text=text, finish_reason=finish, prompt_tokens=prompt_tokens,
                          completion_tokens=approx_tokens(text))
