"""The tiny offline model: a real Qwen3 checkpoint with a byte tokenizer, deterministic per seed."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kpipe.train.tiny_model import build_byte_tokenizer, build_tiny_model, stored_dtype, tiny_config


@pytest.fixture(scope="module")
def nano_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "nano", seed=3, size="nano")


def test_saved_model_and_tokenizer_load_with_auto_classes(nano_dir):
    model = AutoModelForCausalLM.from_pretrained(nano_dir)
    tokenizer = AutoTokenizer.from_pretrained(nano_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((nano_dir / "kpipe_model.json").read_text())["seed"] == 3


def test_tokenizer_round_trips_any_utf8_code():
    tokenizer = build_byte_tokenizer()
    text = 'def k(x):\n\t"""é 中文 🙂"""\r\n    return x  # ∑\x00\x7f'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # token id = byte value
    assert tokenizer.decode(ids) == text


def test_chat_template_is_chatml_and_special_tokens_are_single_ids(nano_dir):
    tokenizer = AutoTokenizer.from_pretrained(nano_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    assert tokenizer.decode(ids) == text


def test_generation_stops_within_the_tokenizer_vocab(nano_dir):
    model = AutoModelForCausalLM.from_pretrained(nano_dir)
    tokenizer = AutoTokenizer.from_pretrained(nano_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=20, do_sample=True)
    assert int(out.max()) < len(tokenizer)
    tokenizer.decode(out[0])


def test_same_seed_same_weights_other_seed_differs(tmp_path, nano_dir):
    again = load_file(build_tiny_model(tmp_path / "a", seed=3, size="nano") / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "b", seed=4, size="nano") / "model.safetensors")
    first = load_file(nano_dir / "model.safetensors")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_a_real_size_preset_is_stored_in_bf16_as_its_hub_model_from_the_same_fp32_draw(tmp_path, nano_dir):
    """The 8B base of config/paper_smoke.yaml is saved in bf16 (16.4 GB, as Qwen3-8B-Base on the hub); the CPU
    presets stay fp32. A bf16 build is the fp32 draw of its seed, rounded: rebuilt, it is the same bytes."""
    assert stored_dtype("qwen3-8b") == stored_dtype("qwen3-14b") == torch.bfloat16
    assert stored_dtype("nano") == torch.float32
    bf16 = build_tiny_model(tmp_path / "bf16", seed=3, size="nano", dtype=torch.bfloat16)
    weights, fp32 = load_file(bf16 / "model.safetensors"), load_file(nano_dir / "model.safetensors")
    assert all(torch.equal(weights[name], fp32[name].to(torch.bfloat16)) for name in fp32)
    assert json.loads((bf16 / "kpipe_model.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"


def test_tiny_preset_has_a_few_million_parameters():
    config = tiny_config("tiny", vocab_size=259, eos_token_id=258, pad_token_id=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert 1_000_000 < model.num_parameters() < 10_000_000


def test_qwen3_06b_preset_matches_the_real_model_size():
    config = tiny_config("qwen3-0.6b", vocab_size=259, eos_token_id=258, pad_token_id=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert config.vocab_size == 151936
    assert 590e6 < model.num_parameters() < 610e6  # Qwen3-0.6B: 596M with tied embeddings


@pytest.mark.parametrize("size, low, high", [("qwen3-8b", 8.1e9, 8.3e9), ("qwen3-14b", 14.6e9, 14.9e9)])
def test_paper_presets_match_the_real_model_sizes(size, low, high):
    """Qwen3-8B-Base has 8.19B parameters, Qwen3-14B-Base 14.77B, both with untied embeddings (hub configs)."""
    config = tiny_config(size, vocab_size=259, eos_token_id=258, pad_token_id=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert not config.tie_word_embeddings and config.vocab_size == 151936
    assert low < model.num_parameters() < high


def test_unknown_size_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model size"):
        tiny_config("huge", 259, 258, 256)


def test_bpe_of_the_policy_corpus_makes_prompts_and_kernels_short():
    from kpipe.data.kernelbench import load_problems
    from kpipe.gym.bank import list_solutions
    from kpipe.llm.prompts import first_turn_messages
    from kpipe.train.tiny_model import build_bpe_tokenizer, policy_corpus

    tokenizer = build_bpe_tokenizer(policy_corpus(), 4000)
    reference = next(p.code for p in load_problems("main") if (p.level, p.problem_id) == (1, 19))
    prompt = tokenizer.apply_chat_template(first_turn_messages(reference), tokenize=False, add_generation_prompt=True)
    kernel = list_solutions("legit")[0].source
    assert len(tokenizer(prompt).input_ids) < 600 < len(prompt) // 4  # byte tokens: ~3,300
    assert tokenizer.decode(tokenizer(kernel).input_ids) == kernel


def test_the_8b_smoke_tokenizer_decodes_every_id_of_the_real_151936_rows():
    """config/paper_smoke.yaml's 8B keeps Qwen's 151,936-row embedding and head; its byte tokenizer is padded to
    that many ids with filler tokens, so every id a random-weight policy samples decodes (issue 63)."""
    from kpipe.train.tiny_model import byte_tokenizer_for

    tokenizer = byte_tokenizer_for("qwen3-8b")
    assert len(tokenizer) == 151936
    assert tiny_config("qwen3-8b", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id).vocab_size == len(tokenizer)
    texts = tokenizer.batch_decode([[token] for token in range(len(tokenizer))])
    assert all(texts)  # every id decodes to something (a lone byte of a multi-byte character to U+FFFD)
    assert not any("\ufffd" in text for text in texts[256:])  # the specials and fillers are whole text
    assert len(set(texts[259:])) == len(texts) - 259  # distinct fillers
    byte = build_byte_tokenizer()
    text = "def kernel(x):\n    return x * 2  # é ✓"
    assert tokenizer.encode(text) == byte.encode(text) and tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (byte.eos_token_id, byte.pad_token_id) == (258, 256)
    assert len(byte_tokenizer_for("nano")) == 259  # scaled-down presets keep one row per token


def test_the_padded_tokenizer_survives_save_and_load(tmp_path):
    from transformers import AutoTokenizer

    build_byte_tokenizer(300).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == 300 and loaded.decode([299]) == build_byte_tokenizer(300).decode([299])
    with pytest.raises(ValueError, match="below the byte tokenizer"):
        build_byte_tokenizer(100)
