"""The multi-turn loop and its history policies, with a scripted engine and evaluator."""

import threading
from dataclasses import dataclass

import pytest

from kpipe.agent.history import (
    BestWindow, FullHistory, KevinSummaries, PastTurn, TopW, best_window, make_policy, top_w_turns,
)
from kpipe.agent.loop import GENERATION_ERROR, AgentTask, Sampling, clipped_speedup_reward, run_episodes
from kpipe.data.io import to_table
from kpipe.llm.types import FINISH_ERROR, ChatRequest, Completion

TASKS = [AgentTask("t-a", "class Model:\n    a = 1\n"), AgentTask("t-b", "class Model:\n    b = 2\n")]


def answer(turn: int, quality: str) -> str:
    return (f"<think>secret reasoning {turn}</think>Plan {turn}.\n```python\nclass ModelNew:\n"
            f"    turn = {turn}\n    quality = '{quality}'\n```\nSummary: attempt {turn}.")


class ScriptedEngine:
    """Answers turn t of every episode with `script[t-1]` ("good"/"bad"/"nocode"/"fail")."""

    model = "scripted"

    def __init__(self, script):
        self.script = script
        self.calls: list[list[ChatRequest]] = []

    def generate(self, requests, on_result=None):
        self.calls.append(requests)
        out = []
        for request in requests:
            turn = 1 + sum(m["role"] == "assistant" for m in request.messages)
            kind = self.script[min(turn, len(self.script)) - 1]
            if kind == "fail":
                out.append(Completion("", FINISH_ERROR, error="RateLimitError: gave up"))
            elif kind == "nocode":
                out.append(Completion("I would rather not.", "stop", prompt_tokens=10, completion_tokens=4))
            else:
                out.append(Completion(answer(turn, kind), "stop", prompt_tokens=10, completion_tokens=20))
        return out


@dataclass
class FakeResult:
    key: str
    status: str
    correct: bool
    hacked: bool
    speedup_eager: float | None
    speedup_compile: float | None
    pr: float | None
    feedback: str


class FakeEvaluator:
    """Passes code marked good with speedup 1.5 * turn; everything else mismatches."""

    def __init__(self):
        self.batches: list[list[tuple[str, str]]] = []

    def evaluate_many(self, jobs):
        self.batches.append(jobs)
        results = []
        for reference, candidate in jobs:
            turn = int(candidate.split("turn = ")[1].split("\n")[0])
            good = "'good'" in candidate
            results.append(FakeResult(
                key=f"k{turn}", status="pass" if good else "mismatch", correct=good, hacked=False,
                speedup_eager=1.5 * turn if good else None, speedup_compile=None, pr=0.5 if good else None,
                feedback=f"feedback of turn {turn}: {'pass' if good else 'mismatch'}",
            ))
        return results


def test_rows_batching_and_full_history():
    engine, evaluator = ScriptedEngine(["bad", "good", "good"]), FakeEvaluator()
    rows = run_episodes(TASKS, engine, evaluator, FullHistory(), n_samples=2, max_turns=3, run="r", stage="rl",
                        iteration=4, progress=False)
    assert len(rows) == 2 * 2 * 3
    assert [len(call) for call in engine.calls] == [4, 4, 4]  # one engine call per turn, all episodes
    assert [len(batch) for batch in evaluator.batches] == [4, 4, 4]  # one evaluation batch per turn
    to_table(rows, "trajectories")  # every row fits the schema
    third = [r for r in rows if r["task_id"] == "t-b" and r["sample"] == 1 and r["turn"] == 3][0]
    assert (third["run"], third["stage"], third["iteration"]) == ("r", "rl", 4)
    roles = [m["role"] for m in third["prompt_messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third["prompt_messages"][2]["content"] == answer(1, "bad")  # the exact earlier answer
    assert "feedback of turn 1: mismatch" in third["prompt_messages"][3]["content"]
    assert "feedback of turn 2: pass" in third["prompt_messages"][5]["content"]
    assert third["status"] == "pass" and third["correct"] and third["reward"] == pytest.approx(1 + 3.0)
    first_turn = [r for r in rows if r["turn"] == 1]
    assert all(r["reward"] == 0.0 and r["status"] == "mismatch" for r in first_turn)


class CallingBackEngine(ScriptedEngine):
    """Hands each answer over as it is done and, after the first, waits until the evaluator has it:
    evaluation demonstrably runs while the engine is still generating."""

    def __init__(self, script, evaluating: threading.Event):
        super().__init__(script)
        self.evaluating = evaluating

    def generate(self, requests, on_result=None):
        out = super().generate(requests)
        for index, completion in enumerate(out):
            if on_result is not None:
                on_result(index, completion)
                if index == 0:
                    assert self.evaluating.wait(10), "the first answer was not evaluated during generation"
        return out


def test_evaluation_overlaps_generation_and_gives_the_same_rows():
    class SignallingEvaluator(FakeEvaluator):
        def __init__(self):
            super().__init__()
            self.called = threading.Event()

        def evaluate_many(self, jobs):
            self.called.set()
            return super().evaluate_many(list(reversed(jobs)))[::-1]  # order-independent results

    rows = {}
    for overlap in (False, True):
        evaluator = SignallingEvaluator()
        engine = CallingBackEngine(["bad", "good", "nocode"], evaluator.called if overlap else threading.Event())
        rows[overlap] = run_episodes(TASKS, engine, evaluator, n_samples=2, max_turns=3, progress=False,
                                     overlap=overlap)
        assert sum(len(batch) for batch in evaluator.batches) == 8  # turns 1 and 2 of 4 episodes
        if overlap:
            assert len(evaluator.batches) > 2  # more than one evaluation call per turn
    timing = ("gen_s", "eval_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in rows[True]] == [
        {k: v for k, v in r.items() if k not in timing} for r in rows[False]]


def test_an_evaluator_error_reaches_the_loop():
    class Broken(FakeEvaluator):
        def evaluate_many(self, jobs):
            raise RuntimeError("pool died")

    started = threading.Event()
    started.set()
    with pytest.raises(RuntimeError, match="pool died"):
        run_episodes(TASKS, CallingBackEngine(["good"], started), Broken(), max_turns=1, progress=False, overlap=True)


def test_samples_get_distinct_seeds_that_repeat_across_turns():
    engine = ScriptedEngine(["bad"])
    run_episodes(TASKS[:1], engine, FakeEvaluator(), n_samples=3, max_turns=2, progress=False)
    seeds_turn1 = [r.seed for r in engine.calls[0]]
    assert len(set(seeds_turn1)) == 3 and seeds_turn1 == [r.seed for r in engine.calls[1]]


def test_format_and_generation_errors_are_recorded_outcomes():
    evaluator = FakeEvaluator()
    rows = run_episodes(TASKS[:1], ScriptedEngine(["nocode", "fail", "good"]), evaluator, max_turns=3,
                        progress=False)
    assert [r["status"] for r in rows] == ["format_error", GENERATION_ERROR]  # the failure ends the episode
    assert rows[0]["code"] is None and "```python" in rows[0]["feedback"]
    assert evaluator.batches == []  # nothing without code reaches the evaluator
    assert rows[1]["finish_reason"] == FINISH_ERROR and "gave up" in rows[1]["feedback"]


def test_context_limit_ends_episode():
    rows = run_episodes(TASKS[:1], ScriptedEngine(["bad"]), FakeEvaluator(), max_turns=3, max_context_tokens=30,
                        progress=False)
    assert [r["turn"] for r in rows] == [1]


class CountingEngine(ScriptedEngine):
    """A scripted engine that counts a prompt's tokens as its characters (a local model's tokenizer)."""

    def prompt_tokens(self, chats):
        return [sum(len(m["content"]) for m in messages) for messages in chats]


def test_a_turn_whose_prompt_leaves_no_room_is_not_sent_and_answers_are_cut_to_the_room_left():
    """A later turn's prompt re-renders the answers and adds the feedback: it may pass the context cap that the
    turn before stayed under (vLLM refuses such a prompt: issue 63's second RL step on an H200). The turn that
    still fits generates at most what the cap leaves."""
    unlimited = CountingEngine(["bad", "bad", "bad"])
    run_episodes(TASKS[:1], unlimited, FakeEvaluator(), max_turns=3, progress=False)
    first, second, third = unlimited.prompt_tokens([call[0].messages for call in unlimited.calls])
    limit = second + 100  # room for turn 2's answer, none for turn 3's prompt (the answers are 20 tokens)
    assert third >= limit
    engine = CountingEngine(["bad", "bad", "bad"])
    rows = run_episodes(TASKS[:1], engine, FakeEvaluator(), max_turns=3, max_context_tokens=limit, progress=False,
                        sampling=Sampling(max_tokens=200))
    assert [r["turn"] for r in rows] == [1, 2]
    assert [[request.max_tokens for request in call] for call in engine.calls] == [[200], [100]]


def test_an_engine_that_does_not_count_its_prompts_gets_the_turns_budget():
    engine = ScriptedEngine(["bad", "bad"])
    run_episodes(TASKS[:1], engine, FakeEvaluator(), max_turns=2, max_context_tokens=10_000, progress=False,
                 sampling=Sampling(max_tokens=8192))
    assert [[request.max_tokens for request in call] for call in engine.calls] == [[8192], [8192]]


def past(rewards):
    return [PastTurn(i + 1, answer(i + 1, "x"), f"code{i + 1}", f"fb{i + 1}", r) for i, r in enumerate(rewards)]


def test_top_w_keeps_best_rewards_in_order():
    assert [t.turn for t in top_w_turns(past([3, 0, 2, 0, 1]), 2)] == [1, 3]
    assert [t.turn for t in top_w_turns(past([1, 1, 1]), 2)] == [2, 3]  # ties: later turns
    assert [t.turn for t in top_w_turns(past([1, 2]), 4)] == [1, 2]


def test_best_window_is_contiguous():
    assert [t.turn for t in best_window(past([0, 3, 0, 2, 2]), 2)] == [4, 5]
    assert [t.turn for t in best_window(past([5, 0, 0, 0, 1]), 3)] == [1, 2, 3]
    assert [t.turn for t in best_window(past([1, 1]), 4)] == [1, 2]


@pytest.mark.parametrize("policy, expected_turns", [(TopW(w=2), [2, 3]), (BestWindow(w=2), [2, 3]),
                                                    (FullHistory(), [1, 2, 3])])
def test_policies_shape_the_loop_context(policy, expected_turns):
    engine = ScriptedEngine(["bad", "good", "good", "good"])
    run_episodes(TASKS[:1], engine, FakeEvaluator(), policy, max_turns=4, progress=False)
    context = engine.calls[3][0].messages  # the prompt of turn 4
    shown = [m["content"] for m in context if m["role"] == "assistant"]
    assert shown == [answer(t, "bad" if t == 1 else "good") for t in expected_turns]


def test_kevin_summaries_strip_reasoning_keep_code_and_summary():
    engine = ScriptedEngine(["bad", "good", "good"])
    run_episodes(TASKS[:1], engine, FakeEvaluator(), KevinSummaries(), max_turns=3, progress=False)
    shown = [m["content"] for m in engine.calls[2][0].messages if m["role"] == "assistant"]
    assert len(shown) == 2
    assert all("secret reasoning" not in text for text in shown)
    assert "Summary: attempt 1." in shown[0] and "quality = 'bad'" in shown[0]


def test_make_policy_by_name():
    assert make_policy("top_w", w=3) == TopW(w=3)
    with pytest.raises(ValueError, match="unknown history policy"):
        make_policy("everything")


def test_default_reward_is_papers_clipped_speedup():
    assert clipped_speedup_reward({"correct": True, "hacked": False, "speedup_eager": 5.0}) == 4.0
    assert clipped_speedup_reward({"correct": True, "hacked": True, "speedup_eager": 2.0}) == 0.0
    assert clipped_speedup_reward({"correct": False, "speedup_eager": 2.0}) == 0.0
