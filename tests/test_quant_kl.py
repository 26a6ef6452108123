"""Chunked KL equals the full computation, values and gradients; vocab mismatch is a clear error."""
import pytest
import torch
from torch import nn

from eqc_utils.quant.kl import VocabMismatchError, chunked_forward_kl, forward_kl


def _setup(vocab=97, hidden=16, tokens=37, seed=0):
    torch.manual_seed(seed)
    s_head, t_head = nn.Linear(hidden, vocab, bias=False), nn.Linear(hidden, vocab, bias=False)
    s_hidden = torch.randn(2, tokens, hidden, requires_grad=True)
    t_hidden = torch.randn(2, tokens, hidden)
    weights = (torch.rand(2, tokens) > 0.2).float()
    return s_head, t_head, s_hidden, t_hidden, weights


@pytest.mark.parametrize("chunk,temperature", [(1, 1.0), (7, 1.0), (16, 2.0), (1000, 0.7)])
def test_chunked_equals_full(chunk, temperature):
    s_head, t_head, s_hidden, t_hidden, weights = _setup()
    full = forward_kl(s_head(s_hidden), t_head(t_hidden).detach(), weights, temperature)
    full.backward()
    grads_full = (s_hidden.grad.clone(), s_head.weight.grad.clone())
    s_hidden.grad = None
    s_head.weight.grad = None
    chunked = chunked_forward_kl(s_hidden, t_hidden, weights, s_head, t_head, temperature, chunk)
    chunked.backward()
    assert torch.allclose(full, chunked, rtol=1e-5, atol=1e-7)
    assert torch.allclose(grads_full[0], s_hidden.grad, rtol=1e-4, atol=1e-7)
    assert torch.allclose(grads_full[1], s_head.weight.grad, rtol=1e-4, atol=1e-7)
    assert t_head.weight.grad is None


def test_kl_is_zero_for_identical_models_and_ignores_masked_tokens():
    s_head, _, s_hidden, _, weights = _setup()
    kl = chunked_forward_kl(s_hidden, s_hidden.detach(), weights, s_head, s_head, 1.0, 5)
    assert abs(float(kl)) < 1e-6
    _, t_head, _, t_hidden, _ = _setup(seed=1)
    only_first = torch.zeros_like(weights)
    only_first[0, 0] = 1
    garbage = t_hidden.clone()
    garbage[0, 1:] = 100.0
    a = chunked_forward_kl(s_hidden, t_hidden, only_first, s_head, t_head, 1.0, 4)
    b = chunked_forward_kl(s_hidden, garbage, only_first, s_head, t_head, 1.0, 4)
    assert torch.allclose(a, b)


def test_vocab_mismatch_is_a_clear_error():
    s_head, _, s_hidden, t_hidden, weights = _setup()
    with pytest.raises(VocabMismatchError, match="same tokenizer"):
        chunked_forward_kl(s_hidden, t_hidden, weights, s_head, nn.Linear(16, 98, bias=False))
