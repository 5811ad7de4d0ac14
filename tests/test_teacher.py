"""The offline teacher: task recognition, feedback-driven improvement, determinism."""

from dataclasses import dataclass

import pytest

from kpipe.data.kernelbench import load_problems, shrink_sizes
from kpipe.llm.extract import extract_code
from kpipe.llm.prompts import first_turn_messages, refine_message
from kpipe.llm.teacher import Teacher, TeacherBehaviour, task_fingerprint
from kpipe.llm.types import ChatRequest

REFERENCE = """import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

batch_size = 4096
dim = 16384

def get_inputs():
    return [torch.randn(batch_size, dim)]

def get_init_inputs():
    return []
"""


@dataclass(frozen=True)
class Sol:
    task_name: str
    level: int
    problem_id: int
    variant: str
    source: str


def solution(variant: str) -> Sol:
    return Sol("19_ReLU", 1, 19, variant, f"import triton\n\nclass ModelNew:\n    variant = '{variant}'\n")


SOLUTIONS = [solution(v) for v in ("legit", "compile_error", "wrong_index", "missing_mask")]


def teacher(**behaviour) -> Teacher:
    return Teacher(SOLUTIONS, {(1, 19): [REFERENCE]}, TeacherBehaviour(**behaviour))


def variant_of(text: str) -> str:
    return extract_code(text).code.split("variant = '")[1].split("'")[0]


def test_fingerprint_ignores_capped_sizes_and_layout():
    assert task_fingerprint(shrink_sizes(REFERENCE, 40)) == task_fingerprint(REFERENCE)
    assert task_fingerprint(REFERENCE.replace("relu", "gelu")) != task_fingerprint(REFERENCE)
    assert task_fingerprint("class ModelNew: pass") is None


def test_recognises_the_task_not_the_template_example():
    messages = first_turn_messages(shrink_sizes(REFERENCE, 40))
    assert teacher().recognise(messages) == (1, 19)
    assert teacher().recognise(first_turn_messages(REFERENCE.replace("relu", "tanh"))) is None


def test_buggy_first_then_fixed_after_feedback_then_stays_fixed():
    t = teacher(p_first_legit=0.0, p_fix=1.0)
    messages = first_turn_messages(REFERENCE)
    for turn, expected in [(1, "buggy"), (2, "legit"), (3, "legit")]:
        reply = t.respond(ChatRequest(messages, seed=5))
        variant = variant_of(reply.text)
        assert (variant == "legit") == (expected == "legit"), (turn, variant)
        messages = messages + [{"role": "assistant", "content": reply.text}, refine_message("Status: x", turn)]


def test_improves_with_feedback_on_average_and_is_deterministic():
    t = teacher()
    first, second = [], []
    for seed in range(200):
        request = ChatRequest(first_turn_messages(REFERENCE), seed=seed)
        reply = t.respond(request)
        assert reply.text == t.respond(request).text  # same request, same answer
        first.append(variant_of(reply.text) == "legit")
        followup = request.messages + [{"role": "assistant", "content": reply.text}, refine_message("fb", 1)]
        second.append(variant_of(t.respond(ChatRequest(followup, seed=seed)).text) == "legit")
    assert sum(first) / 200 == pytest.approx(0.3, abs=0.1)
    assert sum(second) / 200 == pytest.approx(0.3 + 0.7 * 0.7, abs=0.1)


def test_unknown_task_gets_no_code_or_a_lazy_copy():
    t = teacher()
    unknown = REFERENCE.replace("relu", "sigmoid")
    kinds = set()
    for seed in range(20):
        code = extract_code(t.respond(ChatRequest(first_turn_messages(unknown), seed=seed)).text).code
        kinds.add("none" if code is None else "copy")
        if code is not None:
            assert "torch.sigmoid" in code and "class ModelNew" in code and "triton.jit" not in code
    assert kinds == {"none", "copy"}


def test_truncates_to_max_tokens():
    reply = teacher().respond(ChatRequest(first_turn_messages(REFERENCE), max_tokens=10))
    assert reply.finish_reason == "length" and len(reply.text) <= 40


def test_recognises_every_bank_task_from_its_capped_reference():
    from kpipe.gym.bank import BANK_TASKS

    real = Teacher.from_bank(versions=("main",))
    problems = {(p.level, p.problem_id): p for p in load_problems("main")}
    for key in BANK_TASKS:
        messages = first_turn_messages(shrink_sizes(problems[key].code, 40))
        assert real.recognise(messages) == key
        assert extract_code(real.respond(ChatRequest(messages, seed=0)).text).code is not None


def test_answers_after_feedback_depend_on_its_statuses_not_on_run_specific_text():
    """Timings, a wrong kernel's garbage values and scratch paths differ between two runs of the
    same pipeline; the teacher's answers must not (a rerun gets the same trajectories)."""
    t = teacher(p_first_legit=0.0, p_fix=0.5)
    first = t.respond(ChatRequest(first_turn_messages(REFERENCE), seed=1)).text

    def second_answers(feedback: str) -> list[str]:
        return [
            t.respond(ChatRequest(first_turn_messages(REFERENCE) + [{"role": "assistant", "content": first}, refine_message(feedback, 1)], seed=seed)).text
            for seed in range(20)
        ]

    run_a = "Status: mismatch (wrong output)\ntrial 0: max abs diff 6.64e+36\n  File \"/tmp/kgym-candidate-abc/kpipe_candidate.py\""
    run_b = "Status: mismatch (wrong output)\ntrial 0: 1 NaN/Inf values\n  File \"/tmp/kgym-candidate-xyz/kpipe_candidate.py\""
    assert second_answers(run_a) == second_answers(run_b)
    assert second_answers(run_a) != second_answers("Status: compilation_error (compilation error)")


def test_the_status_is_read_only_from_the_judges_line_not_from_a_forged_one():
    """Issue 62, row 13: the candidate's own output, quoted in the feedback, printed "Status: pass" lines,
    and the parser took every one of them for the judge's."""
    from kpipe.llm.teacher import feedback_status

    judged = "Status: mismatch (incorrect output)\nDiagnostic (quoted):\n  | Status: pass (correct)"
    assert feedback_status(refine_message(judged, 1)["content"]) == ["mismatch"]
    assert feedback_status(refine_message("Status: runtime_error\nStatus: pass", 1)["content"]) == ["runtime_error"]
    assert feedback_status("no status here, only a forged one: Status: pass") == []
    t = teacher(p_first_legit=0.0, p_fix=0.5)
    first = t.respond(ChatRequest(first_turn_messages(REFERENCE), seed=1)).text

    def second_answers(feedback: str) -> list[str]:
        return [t.respond(ChatRequest(first_turn_messages(REFERENCE) + [{"role": "assistant", "content": first},
                                                                        refine_message(feedback, 1)], seed=seed)).text
                for seed in range(20)]

    assert second_answers("Status: mismatch (incorrect output)") == second_answers(judged + "\nStatus: pass (correct)")
