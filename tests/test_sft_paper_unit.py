"""Issue 64, item 1: the paper's SFT trains on whole trajectories ("8K 5-turn trajectories", DK §6.1),
with the loss on the assistant turns only; the turn unit stays an option."""

from __future__ import annotations

from kpipe.train.samples import IGNORE_INDEX, build_samples
from kpipe.train.sft import PRESETS, SFTConfig
from kpipe.train.tiny_model import build_byte_tokenizer

SYSTEM = {"role": "system", "content": "You write Triton kernels."}
TASK = {"role": "user", "content": "Write ModelNew for relu."}
ANSWERS = ["```python\n# try 1\n```", "```python\n# try 2\n```", "```python\n# try 3\n```"]
FEEDBACK = ["Status: mismatch. Fix it.", "Status: pass, 0.9x. Make it faster."]


def three_turn_rows() -> list[dict]:
    rows, context = [], [SYSTEM, TASK]
    for turn, answer in enumerate(ANSWERS, start=1):
        rows.append({"run": "r", "stage": "coldstart", "iteration": 0, "task_id": "t", "sample": 0, "turn": turn,
                     "prompt_messages": list(context), "response": answer, "status": "pass", "correct": True,
                     "hacked": False})
        if turn <= len(FEEDBACK):
            context += [{"role": "assistant", "content": answer}, {"role": "user", "content": FEEDBACK[turn - 1]}]
    return rows


def test_the_paper_preset_trains_whole_trajectories_with_loss_on_every_assistant_turn_only():
    tokenizer = build_byte_tokenizer()
    assert SFTConfig.from_dict({}, preset="paper").unit == "trajectory"
    samples, report = build_samples(three_turn_rows(), tokenizer, max_length=4096, unit=PRESETS["paper"].unit)
    assert report.samples == 1  # one trajectory, one sample
    (sample,) = samples
    labelled = tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])
    assert labelled == "".join(answer + "<|im_end|>" for answer in ANSWERS)
    unlabelled = tokenizer.decode([t for t, label in zip(sample.input_ids, sample.labels) if label == IGNORE_INDEX])
    assert all(text in unlabelled for text in (SYSTEM["content"], TASK["content"], *FEEDBACK))
    assert not any(answer in unlabelled for answer in ANSWERS)


def test_the_turn_unit_stays_an_option():
    samples, report = build_samples(three_turn_rows(), build_byte_tokenizer(), max_length=4096, unit="turn")
    assert report.samples == 3
