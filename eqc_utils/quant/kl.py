"""The QAD loss: forward KL(teacher || student) per token at temperature T (docs/recipe.md §2.4).

Both models see the same tokens, so position i of the student is compared with position i of the
teacher (no label shift). The per-token value is sum_v p_t(v) (log p_t(v) - log p_s(v)) on
logits / T (no T^2 factor); the loss is the weighted mean over tokens (weight 0 = padding, or,
when prompts are masked, positions whose next token is a prompt token: position i predicts token i+1).

Full-vocabulary logits are the memory problem (16384 x 248K fp32 = 16 GiB per model), so
`chunked_forward_kl` starts from the final hidden states and applies each model's head one chunk of
tokens at a time, inside non-reentrant activation checkpointing: logits exist for one chunk at a
time, in the forward and again in the backward. `forward_kl` is the plain full computation that
the chunked one must equal (values and gradients), kept for tests and benchmarks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class VocabMismatchError(ValueError):
    """Teacher and student do not share one vocabulary: a per-token KL between them is meaningless."""


def check_same_vocab(student_head: nn.Module, teacher_head: nn.Module) -> None:
    s, t = student_head.weight.shape[0], teacher_head.weight.shape[0]
    if s != t:
        raise VocabMismatchError(
            f"the student's output layer has {s} rows, the teacher's {t}: distillation needs the same "
            f"tokenizer and vocabulary on both sides (check assets.teacher and the init checkpoint)")


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token KL(teacher || student) for [..., V] logits, computed in fp32."""
    student_logp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher_logp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(dim=-1)


def forward_kl(student_logits, teacher_logits, weights, temperature: float = 1.0) -> torch.Tensor:
    """Weighted mean per-token KL over full [B, L, V] logits (the reference computation)."""
    weights = weights.float()
    per_token = token_kl(student_logits, teacher_logits, temperature)
    return (per_token * weights).sum() / weights.sum().clamp_min(1.0)


def _chunk_sums(student_hidden, teacher_hidden, weights, student_head, teacher_head, temperature):
    student_logits = student_head(student_hidden)
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_hidden)
    per_token = token_kl(student_logits, teacher_logits, temperature)
    agree = (student_logits.argmax(-1) == teacher_logits.argmax(-1)).float()
    return (per_token * weights).sum(), (agree * weights).sum().detach()


def chunked_forward_kl(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, weights: torch.Tensor,
                       student_head: nn.Module, teacher_head: nn.Module, temperature: float = 1.0,
                       chunk_tokens: int = 2048, with_agreement: bool = False):
    """Weighted mean KL from final hidden states [B, L, H], one chunk of tokens at a time.

    Returns the loss, or (loss, top-1 agreement, token weight) with `with_agreement`.
    """
    check_same_vocab(student_head, teacher_head)
    if chunk_tokens < 1:
        raise ValueError(f"qad.kl_chunk_tokens must be >= 1, got {chunk_tokens}")
    student_flat = student_hidden.reshape(-1, student_hidden.shape[-1])
    teacher_flat = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach()
    weights = weights.reshape(-1).float().to(student_flat.device)
    recompute = torch.is_grad_enabled() and student_flat.requires_grad

    kl_sum = student_flat.new_zeros((), dtype=torch.float32)
    agree_sum = torch.zeros((), dtype=torch.float32, device=student_flat.device)
    for start in range(0, student_flat.shape[0], chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        args = (student_flat[piece], teacher_flat[piece], weights[piece], student_head, teacher_head, temperature)
        if recompute:
            chunk_kl, chunk_agree = checkpoint(_chunk_sums, *args, use_reentrant=False)
        else:
            chunk_kl, chunk_agree = _chunk_sums(*args)
        kl_sum = kl_sum + chunk_kl
        agree_sum = agree_sum + chunk_agree
    total = weights.sum().clamp_min(1.0)
    if with_agreement:
        return kl_sum / total, agree_sum / total, total
    return kl_sum / total
