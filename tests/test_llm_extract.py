"""Code extraction and prompt templates."""

import pytest

from kpipe.llm.extract import FORMAT_ERROR, extract_code
from kpipe.llm.prompts import first_turn_messages, load_template, refine_message, render

NEW = "import torch\n\nclass ModelNew(torch.nn.Module):\n    pass\n"


def fenced(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code}```"


def test_takes_the_last_block_defining_model_new():
    first = NEW.replace("pass", "x = 1")
    answer = f"Draft:\n{fenced(first)}\nFixed:\n{fenced(NEW)}\nUsage:\n{fenced('m = ModelNew()')}"
    assert extract_code(answer).code == NEW


def test_ignores_blocks_in_reasoning_and_other_languages():
    answer = f"<think>{fenced(NEW.replace('pass', 'wrong = 1'))}</think>{fenced('class ModelNew: ...', 'bash')}"
    assert extract_code(answer).status == FORMAT_ERROR
    assert extract_code(f"<think>plan</think>\n{fenced(NEW, 'py')}").code == NEW


def test_unclosed_reasoning_gives_no_code():
    assert extract_code(f"<think>still thinking {fenced(NEW)}").status == FORMAT_ERROR


@pytest.mark.parametrize(
    "answer, reason",
    [
        ("I cannot do this.", "no fenced"),
        (fenced("class Model:\n    pass\n"), "defines"),
        ("Here:\n```python\n" + NEW, "not closed"),
    ],
)
def test_format_errors_say_why(answer, reason):
    extracted = extract_code(answer)
    assert extracted.code is None and extracted.status == FORMAT_ERROR
    assert reason in extracted.reason


def test_first_turn_holds_instruction_example_and_reference():
    reference = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return {'a': x}\n"
    system, user = first_turn_messages(reference)
    assert system["role"] == "system" and user["role"] == "user"
    content = user["content"]
    assert "@triton.jit" in content and "class ModelNew" in content  # the worked example
    assert content.index("add_kernel") < content.index("return {'a': x}")  # example before the task
    assert "${" not in content


def test_refine_message_carries_feedback_and_turn():
    message = refine_message("Status: mismatch\nmax diff 3.0", turn=2)
    assert message["role"] == "user"
    assert "turn-2" in message["content"] and "max diff 3.0" in message["content"]


def test_templates_are_versioned_and_fields_required():
    with pytest.raises(FileNotFoundError, match="first_turn.v999.txt"):
        load_template("first_turn", "v999")
    with pytest.raises(KeyError):
        render("refine", feedback="x")  # turn missing
