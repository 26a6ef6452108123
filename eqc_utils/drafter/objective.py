"""The DFlash training objective (docs/recipe.md §3.2): anchors, block inputs, labels, weights, loss.

Per sequence, up to `num_anchors` anchor positions are drawn uniformly among assistant positions p
with p + block_size <= length (the whole block lies inside the sequence). Block n is
[x[anchor_n], MASK, ..., MASK] at positions anchor_n + 0..B-1; block position k learns to predict
x[anchor_n + k] (same-position labels). Slot 0 is the given anchor token, so it is never scored;
slot k >= 1 is weighted by exp(-(k-1)/gamma) (early slots matter most: a draft is only accepted up to
its first miss) and only where x[anchor + k] is an assistant token.

The head is the target's and frozen, so the only gradient the loss sends back is d loss / d hidden.
`fused_head_loss` computes it chunk by chunk in the forward pass (softmax minus one-hot, times the
head) and keeps only that [scored, hidden] tensor: no [scored, vocab] logits are stored for the
backward pass (the idea of fused linear + cross-entropy kernels). `weighted_loss` is the plain
autograd computation it must equal.
"""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator | None = None, *, fixed_count: bool = False,
                   key_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [B, N] (ascending per row) and valid [B, N]; N = min(num_anchors, most candidates in
    the batch), or with `fixed_count` N = min(num_anchors, width) whatever the batch holds (one shape for every
    batch of a width: what a compiled drafter needs). Rows with fewer candidates are padded with disabled blocks
    (anchor 0, valid False). The random keys are drawn for `key_width` positions (default: the batch width) and
    cut to the batch width, so batches padded to different widths draw the same anchors."""
    batch, width = loss_mask.shape
    pos = torch.arange(width, device=loss_mask.device)
    candidates = loss_mask.bool() & (pos[None, :] + block_size <= lengths[:, None])
    if fixed_count:
        n = min(num_anchors, width)
    else:
        n = int(min(num_anchors, candidates.sum(1).max().item()))
        if n <= 0:
            raise ValueError("no anchor fits in this batch: every sequence has fewer than block_size tokens after "
                             "its first assistant token")
    # uniform random subset: random keys, candidates first, take the n smallest keys
    draw = max(width, key_width or 0)
    keys = torch.rand(batch, draw, generator=generator, device="cpu")[:, :width].to(loss_mask.device)
    keys = keys.masked_fill(~candidates, 2.0)
    chosen = keys.topk(n, dim=1, largest=False).indices
    valid = torch.gather(candidates, 1, chosen)
    anchors = torch.where(valid, chosen, torch.zeros_like(chosen))
    # ascending order with disabled blocks last
    order = torch.sort(torch.where(valid, anchors, width + 1), dim=1).indices
    return torch.gather(anchors, 1, order), torch.gather(valid, 1, order)


def decay_weights(block_size: int, gamma: float, device=None, slots: int | None = None) -> torch.Tensor:
    """[block_size]: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1; with `slots`, 0 also past slot `slots`
    (drafter.loss_slots: the head and its gradient then run on those slots only)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    if slots is not None:
        w[slots + 1:] = 0.0
    return w


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                  valid: torch.Tensor, block_size: int, mask_token_id: int, gamma: float,
                  label_ids: torch.Tensor | None = None,
                  target_last: torch.Tensor | None = None, loss_slots: int | None = None) -> dict[str, torch.Tensor]:
    """Block token ids, their positions, labels and loss weights, each [B, N*block_size]. Labels come from
    `label_ids` when given (e.g. the target's greedy tokens, [B, S] like input_ids); the anchor is always the
    data token. With `target_last` (the target's final hidden states, [B, S, H]) the result also holds
    `teacher_hidden` [B, N*block_size, H]: for the slot at position p the target's state at p - 1, whose head
    output is the target's distribution of the token at p (soft labels). `loss_slots`: see `decay_weights`."""
    batch, n = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors[:, :, None] + offsets                          # [B, N, block]
    inside = positions < lengths[:, None, None]
    safe = positions.clamp(max=input_ids.shape[1] - 1)
    tokens = torch.gather(input_ids, 1, safe.flatten(1)).view(batch, n, block_size)
    labels = tokens if label_ids is None else torch.gather(label_ids, 1, safe.flatten(1)).view(batch, n, block_size)
    scored = torch.gather(loss_mask, 1, safe.flatten(1)).view(batch, n, block_size).bool()
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, :, 0] = torch.where(valid, tokens[:, :, 0], torch.full_like(tokens[:, :, 0], mask_token_id))
    live = valid[:, :, None] & inside & scored
    weights = decay_weights(block_size, gamma, anchors.device, loss_slots)[None, None, :] * live
    out = {"block_ids": block_ids.flatten(1), "positions": positions.flatten(1),
           "labels": labels.flatten(1), "weights": weights.flatten(1)}
    if target_last is not None:   # slot 0 (never scored) would read p - 1 = anchor - 1 >= 0: clamped anyway
        before = (safe - 1).clamp(min=0).flatten(1)
        out["teacher_hidden"] = torch.gather(target_last, 1, before[:, :, None].expand(-1, -1, target_last.shape[-1]))
    return out


def weighted_loss(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, weights: torch.Tensor,
                  chunk: int = 4096, teacher_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted hard-label cross-entropy through the target's LM head, computed only at positions with
    a non-zero weight (slot 0, disabled blocks and prompt tokens never reach the full-vocabulary head).
    With `teacher_hidden` (`block_targets`' soft labels) the label is the target's whole distribution there,
    softmax(head(teacher_hidden)), and accuracy counts agreement with its argmax (what greedy verification accepts).
    Returns (loss, stats) with stats = accuracy over scored positions (a 0-dim tensor on the hidden states'
    device, NaN where nothing is scored) and the number scored."""
    keep = weights > 0
    h, y, w = hidden[keep], labels[keep], weights[keep]
    t = teacher_hidden[keep] if teacher_hidden is not None else None
    if h.shape[0] == 0:
        zero = hidden.sum() * 0.0
        return zero, {"accuracy": torch.full((), math.nan, device=hidden.device), "scored": 0}
    losses, correct = [], 0
    for start in range(0, h.shape[0], chunk):
        logits = head(h[start:start + chunk])
        if t is None:
            target = answer = y[start:start + chunk]
        else:
            with torch.no_grad():
                teacher_logits = head(t[start:start + chunk]).float()
            target, answer = torch.softmax(teacher_logits, -1), teacher_logits.argmax(-1)
        losses.append(F.cross_entropy(logits.float(), target, reduction="none"))
        correct = correct + (logits.argmax(-1) == answer).sum()
    loss = (torch.cat(losses) * w).sum() / (w.sum() + 1e-6)
    # accuracy stays a device scalar: reading it here would make the CPU wait for the GPU every step
    return loss, {"accuracy": correct.float() / h.shape[0], "scored": int(h.shape[0])}


def _head_ce_chunk(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                   total: torch.Tensor):
    """One chunk: (weighted CE sum, correct count, d(loss)/d(h)) with loss = sum(w * CE) / total."""
    logits = (h @ head_weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels[:, None]).squeeze(1)
    ce_sum = ((lse - picked) * weights).sum()
    correct = (logits.argmax(-1) == labels).sum()
    grad_logits = torch.exp(logits - lse[:, None])
    grad_logits.scatter_add_(1, labels[:, None], -torch.ones_like(picked[:, None]))
    grad_logits = grad_logits * (weights / total)[:, None]
    return ce_sum, correct, grad_logits.to(h.dtype) @ head_weight.to(h.dtype)


def _head_soft_ce_chunk(h: torch.Tensor, head_weight: torch.Tensor, teacher_h: torch.Tensor, weights: torch.Tensor,
                        total: torch.Tensor):
    """`_head_ce_chunk` with soft labels: p = softmax(teacher_h @ head^T), CE = lse - sum(p * logits), whose
    gradient for the logits is softmax(logits) - p; correct counts argmax agreement with p."""
    logits = (h @ head_weight.t()).float()
    teacher = (teacher_h @ head_weight.t()).float()
    p = torch.softmax(teacher, dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    ce_sum = ((lse - (p * logits).sum(-1)) * weights).sum()
    correct = (logits.argmax(-1) == teacher.argmax(-1)).sum()
    grad_logits = (torch.exp(logits - lse[:, None]) - p) * (weights / total)[:, None]
    return ce_sum, correct, grad_logits.to(h.dtype) @ head_weight.to(h.dtype)


_compiled_chunks: dict = {}


def _chunk_fn(compiled: bool, soft: bool = False):
    fn = _head_soft_ce_chunk if soft else _head_ce_chunk
    if not compiled:
        return fn
    if fn not in _compiled_chunks:
        _compiled_chunks[fn] = torch.compile(fn, dynamic=True)
    return _compiled_chunks[fn]


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, chunk: int, compiled: bool):
        total = weights.float().sum() + 1e-6
        grad = torch.empty_like(hidden)
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        step = _chunk_fn(compiled, soft=labels.is_floating_point())   # soft: `labels` are the teacher's states
        for start in range(0, hidden.shape[0], chunk):
            piece = slice(start, start + chunk)
            part_sum, part_correct, grad[piece] = step(hidden[piece], head_weight, labels[piece],
                                                       weights[piece].float(), total)
            ce_sum += part_sum
            correct += part_correct
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return ce_sum / total, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def fused_head_loss(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, weights: torch.Tensor,
                    chunk: int = 8192, compiled: bool = False,
                    teacher_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """`weighted_loss` (same value, same gradient for `hidden`) for a frozen, bias-free head, with the
    gradient computed during the forward pass chunk by chunk: memory holds one chunk's logits at a time.
    `compiled` runs each chunk through torch.compile (fuses the softmax / cross-entropy elementwise work).
    `teacher_hidden`: soft labels, as in `weighted_loss`."""
    if getattr(head, "bias", None) is not None or head.weight.requires_grad:
        raise ValueError("fused_head_loss needs a frozen, bias-free output head (the target's LM head); "
                         "set drafter.fused_loss: false for this target")
    keep = weights > 0
    h, w = hidden[keep], weights[keep]
    y = labels[keep] if teacher_hidden is None else teacher_hidden[keep].to(hidden.dtype)
    if h.shape[0] == 0:
        return hidden.sum() * 0.0, {"accuracy": torch.full((), math.nan, device=hidden.device), "scored": 0}
    loss, correct = _FrozenHeadCrossEntropy.apply(h, head.weight, y, w, chunk, compiled)
    return loss, {"accuracy": correct.float() / h.shape[0], "scored": int(h.shape[0])}
