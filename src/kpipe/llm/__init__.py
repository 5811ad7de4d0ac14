"""Text generation behind one interface (`Engine.generate`), prompts and code extraction.

Engines: OpenAI-compatible HTTP (`OpenAIEngine`), Hugging Face transformers (`HFEngine`),
vLLM in process (`VLLMEngine`). `make_engine(spec)` builds one from a config mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kpipe.llm.extract import FORMAT_ERROR, Extracted, extract_code
from kpipe.llm.types import ChatRequest, Completion, Engine, Message, Usage

ENGINE_KINDS = ("openai", "hf", "vllm")


def make_engine(spec: Mapping[str, Any]) -> Engine:
    """An engine from config, e.g. {kind: openai, model: gpt-5, base_url: ..., api_key_env: OPENAI_API_KEY,
    concurrency: 8, prices: {gpt-5: {input_per_m: 1.25, output_per_m: 10}}} or {kind: hf, path: ckpt/}."""
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind == "openai":
        from kpipe.llm.openai_engine import OpenAIConfig, OpenAIEngine, Price

        prices = {name: Price(**price) for name, price in (spec.pop("prices", None) or {}).items()}
        seed = spec.pop("seed", 0)
        return OpenAIEngine(OpenAIConfig(prices=prices, **spec), seed=seed)
    if kind == "hf":
        from kpipe.llm.hf_engine import HFEngine

        return HFEngine.from_pretrained(spec.pop("path"), **spec)
    if kind == "vllm":
        from kpipe.llm.vllm_engine import VLLMEngine

        return VLLMEngine(spec.pop("path"), **spec)
    raise ValueError(f"unknown engine kind {kind!r}; choose one of {', '.join(ENGINE_KINDS)}")


__all__ = [
    "ChatRequest", "Completion", "Engine", "Message", "Usage", "Extracted", "extract_code", "FORMAT_ERROR",
    "make_engine",
]
