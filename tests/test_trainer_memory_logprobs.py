"""kpipe.train.trainer_memory: the chunked log-probs and entropy equal the full logits' ones, values and
gradients, in float64 (issue 63), so the trainer can drop the tokens x vocab logits without changing a number."""

import pytest
import torch

from kpipe.train.trainer_memory import token_logprobs_and_entropy


def full_logprobs_and_entropy(hidden, weight, targets, temperature=1.0):
    log_probs = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets[..., None]).squeeze(-1), entropy


def inputs(seed=0, batch=2, tokens=13, width=8, vocab=37):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, tokens, width, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, tokens), generator=generator)
    upstream = (torch.randn(batch, tokens, generator=generator, dtype=torch.float64),
                torch.randn(batch, tokens, generator=generator, dtype=torch.float64))
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("chunk_tokens", [1, 5, 26, 1000])  # one token a chunk, a ragged last chunk, exact, one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_values_and_gradients_equal_the_full_logits_ones(chunk_tokens, temperature):
    hidden, weight, targets, (up_logprobs, up_entropy) = inputs()
    expected = full_logprobs_and_entropy(hidden, weight, targets, temperature)
    expected_grads = torch.autograd.grad((expected[0] * up_logprobs).sum() + (expected[1] * up_entropy).sum(),
                                         (hidden, weight))
    got = token_logprobs_and_entropy(hidden, weight, targets, chunk_tokens, temperature)
    got_grads = torch.autograd.grad((got[0] * up_logprobs).sum() + (got[1] * up_entropy).sum(), (hidden, weight))
    for value, reference in zip((*got, *got_grads), (*expected, *expected_grads)):
        assert value.dtype == torch.float64 and value.shape == reference.shape
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)


def test_a_loss_of_the_log_probs_alone_or_the_entropy_alone_has_the_full_gradient():
    hidden, weight, targets, _ = inputs(seed=1)
    for pick in (0, 1):  # the other output gets no gradient (None in the backward)
        expected = torch.autograd.grad(full_logprobs_and_entropy(hidden, weight, targets)[pick].sum(), (hidden, weight))
        got = torch.autograd.grad(token_logprobs_and_entropy(hidden, weight, targets, 4)[pick].sum(), (hidden, weight))
        for value, reference in zip(got, expected):
            torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)


def test_gradcheck_in_float64():
    hidden, weight, targets, _ = inputs(seed=2, batch=1, tokens=5, width=3, vocab=7)
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs_and_entropy(h, w, targets, 2), (hidden, weight))


def test_bad_shapes_and_arguments_are_refused_with_a_clear_error():
    hidden, weight, targets, _ = inputs()
    with pytest.raises(ValueError, match="does not match targets"):
        token_logprobs_and_entropy(hidden, weight, targets[:, :-1])
    with pytest.raises(ValueError, match="is not \\(vocab, 8\\)"):
        token_logprobs_and_entropy(hidden, weight.t(), targets)
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs_and_entropy(hidden, weight, targets, 0)
