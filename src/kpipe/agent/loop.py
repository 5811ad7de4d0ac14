"""The one multi-turn loop: prompt -> generate -> extract -> evaluate -> feedback -> next turn.

Distillation, RL rollouts, evaluation and STTS all call `run_episodes`; they differ only in
the engine, the history policy, the number of turns and what they do with the rows.
Each turn of every active episode is generated in one engine call, so engines batch. With
`overlap` each answer is extracted and handed to the evaluator as the engine
finishes it (`on_result`), and an `EvaluationStream` judges it while the engine decodes the others;
without it, the turn's answers are evaluated in one `evaluate_many` call after generation. Results
are filed by episode, so both give the same rows with an evaluator whose results depend only on
the job (KernelGym's timings vary between runs either way). Overlap is opt-in: where the engine
decodes on the GPUs KernelGym times kernels on, it would slow the timed runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from kpipe.agent.evaluator import EvaluationStream, Evaluator, result_field
from kpipe.agent.history import FullHistory, HistoryPolicy, PastTurn, replay
from kpipe.llm.extract import FORMAT_ERROR, Extracted, extract_code
from kpipe.llm.prompts import PROMPT_VERSION, first_turn_messages
from kpipe.llm.types import ChatRequest, Completion, Engine, Message, prompt_tokens

GENERATION_ERROR = "generation_error"  # the engine gave up on the request (after its retries)
SPEEDUP_CLIP = 3.0


@dataclass(frozen=True)
class AgentTask:
    task_id: str
    reference_src: str


@dataclass(frozen=True)
class Sampling:
    """Per-turn generation settings (paper RL: temperature 1.0, 8,192 tokens per turn)."""

    max_tokens: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: bool = False


@dataclass
class Episode:
    task: AgentTask
    sample: int
    turns: list[PastTurn] = field(default_factory=list)
    done: bool = False


@dataclass(frozen=True)
class TurnRecord:
    """One finished turn, handed to `on_turn` callbacks (e.g. the distillation summary)."""

    row: dict[str, Any]
    completion: Completion


def clipped_speedup_reward(result: Any) -> float:
    """The default reward (paper Eq. 1): C + C * min(speedup_eager, 3); hacked or failed = 0.
    RL runs pass the paper's other rewards from `kpipe.train` instead."""
    if not result_field(result, "correct") or result_field(result, "hacked"):
        return 0.0
    speedup = result_field(result, "speedup_eager") or 0.0
    return 1.0 + min(float(speedup), SPEEDUP_CLIP)


def profiled_reward(result: Any) -> float:
    """DR. KERNEL's training reward (paper Eq. 8): C + C * min(speedup_eager, 3) + C * PR; hacked or
    failed = 0. STTS ranks past turns by it (paper §6.3: "the top-w turns with the highest rewards").
    A correct turn without a profile (profiling off) adds no PR term."""
    reward = clipped_speedup_reward(result)
    pr = result_field(result, "pr")
    if reward and pr is not None:
        reward += min(max(float(pr), 0.0), 1.0)
    return reward


def sample_seed(task_id: str, sample: int, base_seed: int) -> int:
    """A 31-bit seed per (task, sample): parallel samples differ, reruns repeat."""
    digest = hashlib.sha256(f"{base_seed}:{task_id}:{sample}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def format_error_feedback(reason: str) -> str:
    return (f"Status: format_error\n{reason}. Answer with the complete program in one ```python code block "
            "that defines `class ModelNew`.")


def local_result(status: str, feedback: str) -> dict[str, Any]:
    """The evaluation fields of a turn that never reached KernelGym."""
    return {"status": status, "correct": False, "hacked": False, "feedback": feedback}


def run_episodes(
    tasks: Sequence[AgentTask],
    engine: Engine,
    evaluator: Evaluator,
    policy: HistoryPolicy = FullHistory(),
    n_samples: int = 1,
    max_turns: int = 3,
    *,
    sampling: Sampling = Sampling(),
    reward_fn: Callable[[Any], float] = clipped_speedup_reward,
    run: str = "default",
    stage: str = "eval",
    iteration: int = 0,
    seed: int = 0,
    prompt_version: str = PROMPT_VERSION,
    max_context_tokens: int | None = None,
    on_turn: Callable[[int, list[TurnRecord]], None] | None = None,
    progress: bool = True,
    overlap: bool = False,
) -> list[dict[str, Any]]:
    """Run n_samples episodes per task for up to max_turns turns; one `trajectories` row per turn.

    An episode ends early when the engine fails for good (status "generation_error") or when
    its last prompt + answer reached `max_context_tokens`, or its next prompt would leave no room
    for an answer in it (``answer_budgets``: a later turn's prompt re-renders the answers and adds
    the feedback, so it can pass the cap the last turn stayed under). `overlap`: evaluate answers
    while the engine generates the others (module docstring).
    """
    episodes = [Episode(task, sample) for task in tasks for sample in range(n_samples)]
    first = {task.task_id: first_turn_messages(task.reference_src, prompt_version) for task in tasks}
    rows: list[dict[str, Any]] = []
    for turn in tqdm(range(1, max_turns + 1), desc=f"{stage} turns", disable=not progress):
        waiting = [e for e in episodes if not e.done]
        replayed = [replay(first[e.task.task_id], policy, e.turns, prompt_version) for e in waiting]
        room = answer_budgets(engine, replayed, sampling.max_tokens, max_context_tokens)
        for episode, budget in zip(waiting, room, strict=True):
            episode.done = budget == 0
        active = [e for e, budget in zip(waiting, room, strict=True) if budget]
        contexts = [context for context, budget in zip(replayed, room, strict=True) if budget]
        budgets = [budget for budget in room if budget]
        if not active:
            break
        requests = [
            ChatRequest(messages=context, max_tokens=budget, temperature=sampling.temperature,
                        top_p=sampling.top_p, seed=sample_seed(e.task.task_id, e.sample, seed),
                        logprobs=sampling.logprobs)
            for e, context, budget in zip(active, contexts, budgets, strict=True)
        ]
        extracted: dict[int, Extracted | None] = {}
        jobs: dict[int, tuple[str, str]] = {}
        with EvaluationStream(evaluator) if overlap else contextlib.nullcontext() as stream:

            def hand_over(i: int, completion: Completion) -> None:
                extracted[i] = extract_code(completion.text) if not completion.failed else None
                if extracted[i] is not None and extracted[i].code is not None:
                    jobs[i] = (active[i].task.reference_src, extracted[i].code)
                    if stream is not None:
                        stream.put(i, jobs[i])

            started = time.perf_counter()
            completions = engine.generate(requests, on_result=hand_over if stream is not None else None)
            gen_s = (time.perf_counter() - started) / len(requests)
            for i, completion in enumerate(completions):
                if i not in extracted:  # an engine that did not call back, or no overlap
                    hand_over(i, completion)
            if stream is not None:
                results: dict[int, Any] = stream.results()
                busy_s = stream.busy_s
            else:
                started = time.perf_counter()
                order = sorted(jobs)
                results = dict(zip(order, evaluator.evaluate_many([jobs[i] for i in order]), strict=True)) if jobs else {}
                busy_s = time.perf_counter() - started
        eval_s = busy_s / max(1, len(jobs))
        records = []
        for i, (episode, context, completion) in enumerate(zip(active, contexts, completions, strict=True)):
            if completion.failed:
                result: Any = local_result(GENERATION_ERROR, f"Status: {GENERATION_ERROR}\n{completion.error}")
            elif i not in results:
                result = local_result(FORMAT_ERROR, format_error_feedback(extracted[i].reason or "no code"))
            else:
                result = results[i]
            reward = reward_fn(result)
            feedback = result_field(result, "feedback") or f"Status: {result_field(result, 'status')}"
            code = extracted[i].code if extracted[i] is not None else None
            row = trajectory_row(episode, turn, context, completion, code, result, feedback, reward,
                                 run=run, stage=stage, iteration=iteration, model=engine.model,
                                 gen_s=completion.latency_s or gen_s,
                                 eval_s=(result_field(result, "wall_s") or eval_s) if i in results else 0.0)
            rows.append(row)
            records.append(TurnRecord(row, completion))
            episode.turns.append(PastTurn(turn, completion.text, code, feedback, reward))
            used = completion.prompt_tokens + completion.completion_tokens
            if completion.failed or (max_context_tokens is not None and used >= max_context_tokens):
                episode.done = True
        if on_turn is not None:
            on_turn(turn, records)
    return rows


def answer_budgets(engine: Engine, contexts: list[list[Message]], max_tokens: int,
                   max_context_tokens: int | None) -> list[int]:
    """The tokens each turn may generate: `max_tokens`, cut to what the context cap leaves after its prompt
    where the engine counts its prompts' tokens (0: no room, the episode ends before the turn; an engine
    such as vLLM refuses a prompt of its whole context)."""
    used = prompt_tokens(engine, contexts) if max_context_tokens is not None and contexts else None
    if used is None:
        return [max_tokens] * len(contexts)
    return [max(0, min(max_tokens, max_context_tokens - count)) for count in used]


def trajectory_row(episode: Episode, turn: int, context: list[dict[str, str]], completion: Completion,
                   code: str | None, result: Any, feedback: str, reward: float, *, run: str, stage: str,
                   iteration: int, model: str, gen_s: float, eval_s: float) -> dict[str, Any]:
    """A `trajectories` row (kpipe.data.schemas.TRAJECTORIES); training fields stay null here."""
    return {
        "run": run,
        "stage": stage,
        "iteration": iteration,
        "task_id": episode.task.task_id,
        "sample": episode.sample,
        "turn": turn,
        "model": model,
        "prompt_messages": context,
        "response": completion.text,
        "finish_reason": completion.finish_reason,
        "code": code,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "response_token_ids": completion.token_ids,
        "response_logprobs": completion.logprobs,
        "eval_key": result_field(result, "key"),
        "status": result_field(result, "status"),
        "correct": bool(result_field(result, "correct", False)),
        "kb_correct": result_field(result, "kb_correct"),
        "hacked": bool(result_field(result, "hacked", False)),
        "speedup_eager": result_field(result, "speedup_eager"),
        "speedup_compile": result_field(result, "speedup_compile"),
        "pr": result_field(result, "pr"),
        "feedback": feedback,
        "reward": reward,
        "gen_s": gen_s,
        "eval_s": eval_s,
    }
