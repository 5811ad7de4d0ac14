"""SFT samples: assistant-only labels, the two sample units, outcome filters, overlong handling."""

from __future__ import annotations

import pytest

from kpipe.data.io import write_table
from kpipe.train.samples import (
    IGNORE_INDEX,
    build_samples,
    filter_by_outcome,
    load_trajectory_rows,
)
from kpipe.train.tiny_model import build_byte_tokenizer

SYSTEM = {"role": "system", "content": "You write Triton kernels."}
TASK = {"role": "user", "content": "Write ModelNew for relu."}
RESPONSE_1 = "```python\n@triton.jit\ndef relu_v1(x): ...\n```"
FEEDBACK = {"role": "user", "content": "Status: mismatch (max diff 1.0). Fix it."}
RESPONSE_2 = "```python\n@triton.jit\ndef relu_v2(x): ...  # fixed\n```"


def turn_row(turn: int, prompt: list[dict], response: str, passed: bool, sample: int = 0, task: str = "t0") -> dict:
    return {"run": "r", "stage": "coldstart", "iteration": 0, "task_id": task, "sample": sample, "turn": turn,
            "prompt_messages": prompt, "response": response, "status": "pass" if passed else "mismatch",
            "correct": passed, "hacked": False}


def two_turn_trajectory(task: str = "t0", second_passes: bool = True) -> list[dict]:
    first = turn_row(1, [SYSTEM, TASK], RESPONSE_1, passed=False, task=task)
    history = [SYSTEM, TASK, {"role": "assistant", "content": RESPONSE_1}, FEEDBACK]
    second = turn_row(2, history, RESPONSE_2, passed=second_passes, task=task)
    return [first, second]


def labelled_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def test_per_turn_samples_label_only_their_own_response(tokenizer):
    samples, report = build_samples(two_turn_trajectory(), tokenizer, max_length=4096)
    assert report.samples == 2 and report.conversations == 2
    first, second = samples
    assert labelled_text(tokenizer, first) == RESPONSE_1 + "<|im_end|>"
    # turn 2 sees turn 1's response in its context, but is trained only on its own
    assert labelled_text(tokenizer, second) == RESPONSE_2 + "<|im_end|>"
    context = tokenizer.decode(second.input_ids)
    assert RESPONSE_1 in context and FEEDBACK["content"] in context
    assert context == tokenizer.apply_chat_template(
        two_turn_trajectory()[1]["prompt_messages"] + [{"role": "assistant", "content": RESPONSE_2}], tokenize=False)


def test_labelled_tokens_are_a_contiguous_suffix_ending_at_im_end(tokenizer):
    sample = build_samples(two_turn_trajectory()[:1], tokenizer, max_length=4096)[0][0]
    flags = [label != IGNORE_INDEX for label in sample.labels]
    first = flags.index(True)
    assert all(flags[first:first + sum(flags)])
    assert sample.labels[first:first + sum(flags)] == sample.input_ids[first:first + sum(flags)]
    assert tokenizer.decode(sample.input_ids[:first]).endswith("<|im_start|>assistant\n")


def test_trajectory_unit_labels_every_assistant_turn_once(tokenizer):
    samples, report = build_samples(two_turn_trajectory(), tokenizer, max_length=4096, unit="trajectory")
    assert report.samples == 1
    assert labelled_text(tokenizer, samples[0]) == RESPONSE_1 + "<|im_end|>" + RESPONSE_2 + "<|im_end|>"


def test_templates_that_rewrite_history_still_label_the_right_tokens(tokenizer):
    # Like Qwen3's template: the final assistant turn gets an empty think block, earlier ones do not,
    # so rendering prefixes would not give prefixes of the full render.
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{%- if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{%- endif %}"
        "{{ m['content'] }}<|im_end|>\n{%- endfor %}")
    samples, _ = build_samples(two_turn_trajectory(), tokenizer, max_length=4096, unit="trajectory")
    assert labelled_text(tokenizer, samples[0]) == RESPONSE_1 + "<|im_end|>" + RESPONSE_2 + "<|im_end|>"


def test_outcome_filters(tokenizer):
    rows = two_turn_trajectory("a", second_passes=True) + two_turn_trajectory("b", second_passes=False)
    assert [r["task_id"] for r in filter_by_outcome(rows, "passed_turns")] == ["a"]
    assert [r["task_id"] for r in filter_by_outcome(rows, "passed_trajectories")] == ["a", "a"]
    hacked = dict(rows[1], hacked=True)
    assert filter_by_outcome([hacked], "passed_turns") == []
    _, report = build_samples(rows, tokenizer, max_length=4096, keep="passed_turns")
    assert (report.rows, report.filtered_out, report.samples) == (4, 3, 1)


def test_overlong_samples_are_dropped_or_truncated_and_counted(tokenizer):
    rows = two_turn_trajectory()
    full, _ = build_samples(rows, tokenizer, max_length=100_000)
    short_len, long_len = sorted(len(s.input_ids) for s in full)
    limit = long_len - 5  # cuts into the longer sample's response only

    kept, dropped = build_samples(rows, tokenizer, max_length=limit, overlong="drop")
    assert (dropped.overlong, dropped.dropped_overlong, dropped.truncated, dropped.samples) == (1, 1, 0, 1)
    assert len(kept[0].input_ids) == short_len

    cut, truncated = build_samples(rows, tokenizer, max_length=limit, overlong="truncate")
    assert (truncated.overlong, truncated.dropped_overlong, truncated.truncated, truncated.samples) == (1, 0, 1, 2)
    assert max(len(s.input_ids) for s in cut) == limit


def test_truncation_that_removes_every_label_drops_the_sample(tokenizer):
    rows = two_turn_trajectory()[1:]
    _, report = build_samples(rows, tokenizer, max_length=20, overlong="truncate")
    assert (report.dropped_no_labels, report.samples) == (1, 0)


def test_empty_responses_are_skipped_and_counted(tokenizer):
    rows = two_turn_trajectory()
    rows[0]["response"] = ""
    _, report = build_samples(rows, tokenizer, max_length=4096)
    assert (report.empty_responses, report.samples) == (1, 1)


def test_rows_round_trip_through_parquet(tmp_path, tokenizer):
    path = write_table(two_turn_trajectory(), tmp_path / "part-0.parquet", "trajectories")
    rows = load_trajectory_rows(path)
    samples, _ = build_samples(rows, tokenizer, max_length=4096)
    assert labelled_text(tokenizer, samples[1]) == RESPONSE_2 + "<|im_end|>"


def test_bad_options_are_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="overlong"):
        build_samples([], tokenizer, max_length=10, overlong="wrap")
    with pytest.raises(ValueError, match="outcome filter"):
        build_samples(two_turn_trajectory(), tokenizer, max_length=10, keep="best")
    with pytest.raises(ValueError, match="sample unit"):
        build_samples(two_turn_trajectory(), tokenizer, max_length=10, unit="episode")
