"""The HF engine on a tiny random Qwen3 model: left-padded batching and rollout log-probs."""

import pytest
import tokenizers
import torch
import transformers

from kpipe.llm.hf_engine import HFEngine, plain_chat_prompt
from kpipe.llm.types import ChatRequest


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["class ModelNew triton kernel forward return x * 2"] * 10, vocab_size=300,
                            min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, initializer_range=0.5,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return HFEngine(transformers.Qwen3ForCausalLM(config).eval(), tokenizer, "tiny", batch_size=4, progress=False)


def requests(temperature: float) -> list[ChatRequest]:
    prompts = ["x", "class ModelNew forward", "triton kernel " * 6]
    return [ChatRequest([{"role": "user", "content": p}], max_tokens=10, temperature=temperature, logprobs=True,
                        seed=i) for i, p in enumerate(prompts)]


def test_left_padded_batch_matches_one_by_one(engine):
    batched = engine.generate(requests(0.0))
    single = [engine.generate([r])[0] for r in requests(0.0)]
    assert len({tuple(c.token_ids) for c in batched}) > 1  # the prompts lead to different answers
    for a, b in zip(batched, single, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.completion_tokens == len(a.token_ids) and a.finish_reason in ("stop", "length")


def test_sampled_logprobs_match_a_teacher_forced_pass(engine):
    """The rollout log-probs are what the trainer recomputes: log_softmax(logits / T) of the sampled tokens."""
    temperature = 0.7
    for request, completion in zip(requests(temperature), engine.generate(requests(temperature)), strict=True):
        prompt = engine.tokenizer(engine.prompt_text(request.messages), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = engine.hf_model(ids).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
        assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
        assert completion.prompt_tokens == len(prompt)


def test_the_prompt_count_is_what_generate_encodes(engine):
    """The agent loop's context budget (kpipe.agent.loop.answer_budgets) counts prompts as generate does."""
    counts = engine.prompt_tokens([request.messages for request in requests(0.0)])
    assert counts == [completion.prompt_tokens for completion in engine.generate(requests(0.0))]


def test_the_vllm_engine_counts_a_prompt_as_llm_chat_renders_it(engine):
    """vLLM 0.26.0's chat path: the chat template as text, then the tokenizer without special tokens."""
    from kpipe.llm.vllm_engine import VLLMEngine

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=engine.tokenizer.backend_tokenizer,
                                                     eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    vllm_engine = object.__new__(VLLMEngine)  # no vLLM here: the engine's LLM stands in with its tokenizer
    vllm_engine.llm = type("LLM", (), {"get_tokenizer": lambda self: tokenizer})()
    messages = [{"role": "user", "content": "class ModelNew forward"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|endoftext|><user>")
    assert vllm_engine.prompt_tokens([messages, messages[:0] + [{"role": "user", "content": "x"}]])[0] == len(
        tokenizer(text, add_special_tokens=False)["input_ids"])


def test_sampling_is_reproducible_by_seed(engine):
    first = [c.token_ids for c in engine.generate(requests(1.0))]
    assert first == [c.token_ids for c in engine.generate(requests(1.0))]


def test_stops_at_eos_and_counts_it(engine):
    eos = engine.tokenizer.eos_token_id
    assert engine._response_length([5, 6, eos, eos]) == (3, "stop")
    assert engine._response_length([5, 6]) == (2, "length")


def test_plain_prompt_ends_with_assistant_tag():
    text = plain_chat_prompt([{"role": "user", "content": "hi"}])
    assert text == "<|user|>\nhi\n<|assistant|>\n"


def test_served_over_the_openai_api_like_in_process(engine):
    from kpipe.llm.cli import EngineResponder
    from kpipe.llm.openai_engine import OpenAIConfig, OpenAIEngine
    from kpipe.llm.server import BackgroundServer, make_app

    with BackgroundServer(make_app(EngineResponder(engine), "tiny")) as server:
        client = OpenAIEngine(OpenAIConfig(model="tiny", base_url=server.base_url, api_key_env=None, progress=False))
        remote = client.generate(requests(0.0))
    local = engine.generate(requests(0.0))
    assert [c.text for c in remote] == [c.text for c in local]
    assert [c.completion_tokens for c in remote] == [c.completion_tokens for c in local]


def test_vllm_engine_says_how_to_get_vllm():
    import importlib.util

    from kpipe.llm import make_engine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(RuntimeError, match="pip install 'kpipe\\[vllm\\]'"):
        make_engine({"kind": "vllm", "path": "/nonexistent"})


def test_a_row_is_handed_over_when_it_stops_and_the_answers_do_not_change(engine):
    """With `on_result`, a row that emits EOS is reported while its batch still decodes; the tokens,
    log-probs and texts are those of a run without the callback."""
    import copy

    greedy = engine.generate(requests(0.0))
    stop_token = greedy[1].token_ids[2]  # make a token of row 1's answer the EOS: row 1 stops at step 3
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(stop_token)
    stopping = HFEngine(engine.hf_model, tokenizer, "tiny", batch_size=4, progress=False)
    for temperature in (0.0, 1.0):
        plain = stopping.generate(requests(temperature))
        order: list[int] = []
        handed = stopping.generate(requests(temperature), on_result=lambda index, _: order.append(index))
        assert [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in handed] == [
            (c.text, c.token_ids, c.logprobs, c.finish_reason) for c in plain]
        assert sorted(order) == [0, 1, 2]
        if temperature == 0.0:
            assert plain[1].completion_tokens == 3 and order[0] == 1, order
