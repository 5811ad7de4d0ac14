"""A tiny Qwen3-architecture policy built locally, for runs with no model download.

The offline pipeline must exercise the same code paths as the paper's run (chat template,
assistant-only loss, HF checkpoints, generation), only smaller. So the tiny model is a real
``Qwen3ForCausalLM`` with random weights and a byte-level tokenizer (token id = byte value,
plus ChatML special tokens): it round-trips any UTF-8 text and needs no training corpus,
which keeps it deterministic given a seed. Given a corpus, the tokenizer is instead a
byte-level BPE trained on it: sub-word tokens make prompts and kernels several times shorter,
which the learning checks need (a policy that must emit a 1 KB kernel byte by byte learns
slowly and generates slowly).
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen's ChatML layout; every turn ends with <|im_end|>, which is also the end-of-generation token.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Architecture presets. "qwen3-0.6b", "qwen3-8b" and "qwen3-14b" mirror Qwen/Qwen3-*-Base's configs (GPU
# throughput checks and config/paper_smoke.yaml: the paper's architecture without a download); the others are
# scaled down for CPU runs.
SIZE_PRESETS: dict[str, dict[str, Any]] = {
    "nano": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=192),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=768),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, intermediate_size=1536),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=32768,
                     tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                      head_dim=128, intermediate_size=17408, vocab_size=151936, max_position_embeddings=32768,
                      tie_word_embeddings=False),
}

# the hub model whose shapes a real-size preset copies (what its cost is priced as: kpipe.report.cost)
PRESET_HUB_MODELS = {"qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen3-8b": "Qwen/Qwen3-8B-Base", "qwen3-14b": "Qwen/Qwen3-14B-Base"}


def stored_dtype(size: str) -> torch.dtype:
    """The dtype a preset's weights are saved in: a real-size preset's in bf16, as the hub checkpoint whose
    shapes it copies (half the disk: 16.4 GB at 8B, what lets config/paper_smoke_1gpu.yaml fit 64 GiB; the
    trainer loads it into fp32 master weights as it would the hub's); the CPU presets' in fp32."""
    return torch.bfloat16 if size in PRESET_HUB_MODELS else torch.float32


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return chars


def filler_tokens(count: int) -> list[str]:
    """`count` distinct strings of 2 and then 3 printable ASCII characters ('!'..'~', each its own byte
    symbol in GPT-2's map): valid UTF-8 when decoded, and never produced by encoding (no merges)."""
    printable = [chr(code) for code in range(ord("!"), ord("~") + 1)]
    fillers: list[str] = []
    for length in (2, 3):
        for combination in itertools.product(printable, repeat=length):
            if len(fillers) == count:
                return fillers
            fillers.append("".join(combination))
    if len(fillers) < count:
        raise ValueError(f"{count} filler tokens asked; at most {len(fillers)} can be made")
    return fillers


def build_byte_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (id = byte value, no merges) with ChatML special tokens and template.

    With `vocab_size` (a real-size preset's 151,936 rows, config/paper_smoke.yaml's 8B) the ids after the
    specials up to `vocab_size` are filler tokens that decode to short ASCII strings: every id a
    random-weight policy can sample decodes, while encoding stays one token a byte and the embedding and
    head keep their real size, a real part of the cost. (Restricting sampling to the 259 byte ids instead
    would change the engine's sampling path and leave HF's generation unrestricted.)"""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    base = len(vocab) + len(SPECIAL_TOKENS)
    if vocab_size is not None:
        if vocab_size < base:
            raise ValueError(f"vocab_size {vocab_size} is below the byte tokenizer's {base} tokens")
        vocab |= {token: len(vocab) + index for index, token in enumerate(SPECIAL_TOKENS)}  # ids 256-258
        vocab |= {token: base + index for index, token in enumerate(filler_tokens(vocab_size - base))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=ENDOFTEXT)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def byte_tokenizer_for(size: str) -> PreTrainedTokenizerFast:
    """The byte tokenizer of a size preset: a real-size preset's (fixed vocab_size) padded to its rows
    with decodable filler tokens, so that every id its model can sample decodes."""
    if size not in SIZE_PRESETS:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZE_PRESETS)}")
    return build_byte_tokenizer(SIZE_PRESETS[size].get("vocab_size"))


def build_bpe_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `corpus`, with ChatML special tokens and template
    (round-trips any UTF-8 text: the 256 byte symbols are its initial alphabet)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=ENDOFTEXT)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


TEMPLATE_WEIGHT = 50  # every prompt repeats the templates: weighted so that BPE gives them few tokens


def policy_corpus(template_weight: int = TEMPLATE_WEIGHT) -> list[str]:
    """The texts the offline policy reads and writes, for its BPE tokenizer: the prompt templates
    (repeated `template_weight` times, as they open every prompt), the bank's kernels and every
    KernelBench reference of the vendored `main` set.

    Independent of the run's task and query selection, so the tokenizer (and everything trained
    on it) stays the same when the selection changes. A 4,000-token BPE of it makes a first-turn
    prompt ~240 tokens and a bank kernel ~130 (byte tokens: ~3,300 and ~1,000), which is what
    lets the default run train and sample the policy on a CPU in minutes.
    """
    from kpipe.data.kernelbench import load_problems
    from kpipe.gym.bank import list_solutions
    from kpipe.llm.prompts import first_turn_messages, refine_message

    templates = [message["content"] for message in first_turn_messages("")] + [refine_message("", 1)["content"]]
    kernels = sorted(solution.source for solution in list_solutions())  # the bank's layout may change, not its programs
    return templates * template_weight + kernels + [problem.code for problem in load_problems("main")]


def tiny_config(size: str, vocab_size: int, eos_token_id: int, pad_token_id: int,
                exact_vocab: bool = False) -> Qwen3Config:
    """The Qwen3Config of a size preset.

    The embedding has exactly one row per token unless the preset fixes it (the 0.6B preset
    keeps Qwen's 151,936 rows for realistic throughput; `exact_vocab` overrides that): padding
    rows would let a sampling policy emit ids the tokenizer cannot decode. RoPE keeps the
    library default so transformers 4.x (``rope_theta``) and 5.x (``rope_parameters``) read
    the same config.
    """
    if size not in SIZE_PRESETS:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZE_PRESETS)}")
    arch = {"vocab_size": vocab_size, "max_position_embeddings": 32768, "tie_word_embeddings": True, **SIZE_PRESETS[size]}
    if exact_vocab:
        arch["vocab_size"] = vocab_size
    return Qwen3Config(
        **arch,
        rms_norm_eps=1e-6,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def build_tiny_model(out_dir: str | Path, seed: int = 0, size: str = "tiny",
                     corpus: Iterable[str] | None = None, vocab_size: int = 800,
                     dtype: torch.dtype | None = None) -> Path:
    """Build a random-weight Qwen3 model + tokenizer and save both in HF format to `out_dir`:
    the byte tokenizer, or with `corpus` a BPE of `vocab_size` tokens trained on it (then the
    embedding has exactly one row per token, whatever the preset). The weights are drawn in fp32 from
    `seed` and saved in `dtype` (default: the preset's `stored_dtype`).

    Written to a temporary sibling directory and renamed into place, so a killed build never
    leaves a half-saved model that a later stage would load.
    """
    out_dir = Path(out_dir)
    tokenizer = byte_tokenizer_for(size) if corpus is None else build_bpe_tokenizer(corpus, vocab_size)
    config = tiny_config(size, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id,
                         exact_vocab=corpus is not None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    dtype = dtype or stored_dtype(size)
    model.to(dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_class(tmp / "tokenizer_config.json")
        (tmp / "kpipe_model.json").write_text(json.dumps({"builder": "kpipe.train.tiny_model", "size": size,
                                                          "seed": seed, "tokenizer": "byte" if corpus is None else "bpe", "parameters": model.num_parameters(),
                                                          "dtype": str(dtype).removeprefix("torch.")}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def tiny_model_job(out_dir: str | Path, size: str = "tiny", seed: int = 0, tokenizer: str = "byte",
                   vocab_size: int = 4000) -> Path:
    """Rule `tiny_model` and ``kpipe train tiny-model``: the model with the byte tokenizer, or
    (`tokenizer` "bpe") a BPE of `vocab_size` tokens trained on :func:`policy_corpus`."""
    if tokenizer not in ("byte", "bpe"):
        raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
    corpus = policy_corpus() if tokenizer == "bpe" else None
    path = build_tiny_model(out_dir, seed=seed, size=size, corpus=corpus, vocab_size=vocab_size)
    print(f"tiny model ({size}, seed {seed}, {tokenizer} tokenizer) -> {path}")
    return path


def _portable_tokenizer_class(config_path: Path) -> None:
    """Name the tokenizer class that transformers 4.x (vLLM's pin) and 5.x both resolve."""
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))
