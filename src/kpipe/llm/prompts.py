"""The paper's prompt templates (Appendix F), as versioned files in `llm/prompts/`.

Templates use `string.Template` (`${name}`) so that braces in code never need escaping.
A new wording is a new version (`first_turn.v2.txt`, ...), never an edit of an old one:
trajectories record the version they were generated with, and SFT data must match RL.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from string import Template

from kpipe.llm.types import Message

PROMPT_VERSION = "v1"


@cache
def load_template(name: str, version: str = PROMPT_VERSION) -> str:
    """The text of template `name` (e.g. "first_turn", "example_triton.py") at `version`."""
    stem, _, suffix = name.partition(".")
    filename = f"{stem}.{version}.{suffix or 'txt'}"
    path = resources.files("kpipe.llm") / "prompts" / filename
    if not path.is_file():
        raise FileNotFoundError(f"no prompt template {filename} in kpipe/llm/prompts")
    return path.read_text()


def render(name: str, version: str = PROMPT_VERSION, **fields: object) -> str:
    """Template `name` with `fields` substituted; a missing field is an error, not a blank."""
    return Template(load_template(name, version)).substitute({k: str(v) for k, v in fields.items()}).strip()


def first_turn_messages(reference_src: str, version: str = PROMPT_VERSION) -> list[Message]:
    """System prompt + the first user turn: instruction, example Triton code, reference code."""
    user = render(
        "first_turn",
        version,
        example_reference=load_template("example_reference.py", version).strip(),
        example_triton=load_template("example_triton.py", version).strip(),
        reference_src=reference_src.strip(),
    )
    return [{"role": "system", "content": render("system", version)}, {"role": "user", "content": user}]


def refine_message(feedback: str, turn: int, version: str = PROMPT_VERSION) -> Message:
    """The user turn after turn `turn`: KernelGym's feedback and the request to refine."""
    return {"role": "user", "content": render("refine", version, feedback=feedback.strip(), turn=turn)}


def summarised_answer(turn: int, summary: str, code: str | None, version: str = PROMPT_VERSION) -> str:
    """An earlier answer with its reasoning replaced by its summary (Kevin-style history)."""
    return render("summary_turn", version, turn=turn, summary=summary.strip() or "(none)", code=(code or "").strip())
