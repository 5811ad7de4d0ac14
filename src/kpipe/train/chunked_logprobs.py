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

from typing import Any

import torch

DEFAULT_CHUNK_TOKENS = 2048  # 2,048 x 151,936 fp32 logits are 1.2 GiB a temporary


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
