"""Token log-probs and entropy through the LM head in chunks of tokens (issue 63).

At the paper's shapes the full logits are 32,768 tokens x 151,936 rows: 18.5 GiB in fp32, doubled by
their gradient, which is what HF's ``labels=`` loss builds. Here the forward keeps only one chunk's
logits at a time and saves nothing of them; the backward recomputes each chunk's logits and writes
the gradients of the hidden states and of the head directly, so memory grows with ``chunk_tokens x
vocab`` instead of ``tokens x vocab``.

Derivatives, with z the logits of one token, p = softmax(z), lp = log p, H = -sum p lp:
d lp[target] / dz = onehot(target) - p, and dH / dz = -p (lp + H).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 2048  # 2,048 x 151,936 fp32 logits are 1.2 GiB a temporary
# config attributes of HF models whose logits are not hidden @ head.weight.T: the chunked path refuses them
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _statistics_dtype(matmul_dtype: torch.dtype) -> torch.dtype:
    """Softmax and accumulations in fp32 at least (float64 stays float64: the exactness tests)."""
    return torch.promote_types(matmul_dtype, torch.float32)


def _chunk_statistics(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs of the targets, entropies, fp32 log-softmax, fp32 probabilities) of one chunk."""
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(-1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1), entropy, log_probs, probs


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int, temperature: float, matmul_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight = weight.to(matmul_dtype)
            token_logprobs = torch.empty(hidden.shape[0], dtype=_statistics_dtype(matmul_dtype),
                                         device=hidden.device)
            entropies = torch.empty_like(token_logprobs)
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = start + chunk_tokens
                token_logprobs[start:end], entropies[start:end], _, _ = _chunk_statistics(
                    hidden[start:end].to(matmul_dtype), cast_weight, targets[start:end], temperature)
        ctx.save_for_backward(hidden, weight, targets, entropies)
        ctx.set_materialize_grads(False)  # an output the loss does not use (the entropy) costs no backward work
        ctx.chunk_tokens, ctx.temperature, ctx.matmul_dtype = chunk_tokens, temperature, matmul_dtype
        return token_logprobs, entropies

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None,
                 grad_entropies: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, entropies = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=_statistics_dtype(ctx.matmul_dtype), device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight = weight.to(ctx.matmul_dtype)
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                end = start + ctx.chunk_tokens
                chunk = hidden[start:end].to(ctx.matmul_dtype)
                _, _, log_probs, probs = _chunk_statistics(chunk, cast_weight, targets[start:end], ctx.temperature)
                grad_logits = torch.zeros_like(probs)
                if grad_logprobs is not None:
                    upstream = grad_logprobs[start:end, None]
                    grad_logits -= upstream * probs
                    grad_logits.scatter_add_(-1, targets[start:end, None], upstream)
                if grad_entropies is not None:
                    grad_logits -= grad_entropies[start:end, None] * probs * (log_probs + entropies[start:end, None])
                grad_logits = (grad_logits / ctx.temperature).to(ctx.matmul_dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (grad_logits @ cast_weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += grad_logits.t() @ chunk
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs_and_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                               chunk_tokens: int = DEFAULT_CHUNK_TOKENS, temperature: float = 1.0,
                               matmul_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each token's distribution (fp32 or wider,
    shaped like `targets`), from the final hidden states (`targets.shape + (hidden,)`) and the LM head's
    weight (vocab x hidden), with gradients for both and no full tokens x vocab tensor.

    `temperature` divides the logits (the sampler's temperature, as RL log-probs use); `matmul_dtype`
    is the dtype of the head's matmuls (default: the hidden states'), e.g. bf16 for fp32 master weights.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match targets {tuple(targets.shape)} "
                         f"(expected targets.shape + (hidden_size,))")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"lm_head_weight {tuple(lm_head_weight.shape)} is not (vocab, {hidden.shape[-1]})")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    flat_logprobs, flat_entropies = _ChunkedLogprobsEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), lm_head_weight, targets.reshape(-1).long(), chunk_tokens,
        temperature, matmul_dtype or hidden.dtype)
    return flat_logprobs.view(targets.shape), flat_entropies.view(targets.shape)


def lm_head_weight(model: Any) -> torch.Tensor:
    """The LM head's weight of a Hugging Face causal LM (the input embedding's, when tied: one parameter,
    which then gets both gradients). Refuses a head whose logits are not ``hidden @ weight.T``: a bias,
    or logits scaled or soft-capped by the config (`LOGIT_TRANSFORMS`)."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no LM head (get_output_embeddings) to compute log-probs in chunks")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s LM head has a bias: chunked log-probs compute hidden @ weight.T only")
    transforms = [name for name in LOGIT_TRANSFORMS if getattr(model.config, name, None) not in (None, 1, 1.0)]
    if transforms:
        raise ValueError(f"{type(model).__name__} transforms its logits ({', '.join(transforms)}): "
                         "chunked log-probs compute hidden @ weight.T only")
    return head.weight


def head_is_sharded(model: Any) -> bool:
    """Whether the LM head's weight is an FSDP2 shard (a DTensor): outside the root unit's forward it is
    not the whole matrix, so the chunked path cannot use it."""
    from torch.distributed.tensor import DTensor

    return isinstance(lm_head_weight(model), DTensor)


def effective_chunk_tokens(model: Any, chunk_tokens: int) -> int:
    """`chunk_tokens`, or 0 (the model's own logits) where the LM head's weight is an FSDP2 shard: the
    chunked path reads the head's weight outside the model's forward, where FSDP2 has not gathered it."""
    if chunk_tokens and head_is_sharded(model):
        log.warning("logprob_chunk_tokens %d: the LM head is FSDP2-sharded, so log-probs use the model's own "
                    "logits (kpipe.train.chunked_logprobs.effective_chunk_tokens)", chunk_tokens)
        return 0
    return chunk_tokens


def model_token_logprobs_and_entropy(model: Any, inputs: dict[str, torch.Tensor], positions: torch.Tensor | slice,
                                     targets: torch.Tensor, chunk_tokens: int,
                                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs_and_entropy` of an HF causal LM: the decoder's final hidden states (`inputs` as the
    model takes them) at sequence `positions`, each predicting `targets` ([batch, len(positions)]), through
    the LM head in chunks. The matmuls run in the autocast dtype when autocast is on (bf16 over fp32
    master weights), else in the hidden states' dtype."""
    weight = lm_head_weight(model)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state[:, positions]
    device_type = hidden.device.type
    matmul_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    return token_logprobs_and_entropy(hidden, weight, targets, chunk_tokens, temperature, matmul_dtype)
