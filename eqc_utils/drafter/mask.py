"""The anchor-strict attention mask of DFlash training (docs/recipe.md §3.2 step 4), in one definition.

Queries are the N blocks of one sequence laid side by side ([block_0 | ... | block_{N-1}], B tokens
each); keys are the sequence's S context positions followed by the same blocks. A query of block n
* sees context key j iff j < anchor_n (strictly: at inference the anchor token's own target hidden
  state does not exist yet, it is the token being verified),
* sees every key of its own block (bidirectional inside a block),
* never sees another block.
A disabled (padding) block sees only its own block: its loss weight is zero, and a fully masked row
would make SDPA return NaN, which would leak into the gradients through 0 * NaN.

Sliding window (`window` = W, optional): a query at position p sees only keys at positions
p - W + 1 .. p + W - 1. For the drafter that means: slot k of a block anchored at a sees context
positions a + k - W + 1 .. a - 1 (the most recent W - 1 - k positions before the anchor) and, as
long as W >= block_size, its whole block. This is the symmetric window (W - 1, W - 1) that vLLM's
FlashAttention path applies to a non-causal sliding-window layer (queries aligned to the end of the
sequence), so training, the reference decoder and serving cut the context at the same place.

`visible(...)` is that rule as tensor arithmetic. The CPU path evaluates it on broadcast index grids
to get a dense boolean SDPA mask; the GPU path hands the same function to flex_attention's
`create_block_mask`, which skips the (mostly empty) key tiles. Tests check both give one answer.
"""
from __future__ import annotations

import torch


def visible(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int,
            b, q_idx, kv_idx, window: int | None = None) -> torch.Tensor:
    """Whether query `q_idx` of sequence `b` may attend to key `kv_idx` (index tensors broadcast)."""
    block = q_idx // block_size
    anchor = anchors[b, block]
    is_context = kv_idx < context_len
    sees_context = is_context & (kv_idx < anchor) & valid[b, block]
    if window is not None:
        sees_context = sees_context & (anchor + q_idx % block_size - kv_idx < window)
    same_block = ~is_context & ((kv_idx - context_len) // block_size == block)
    return sees_context | same_block


def check_window(window: int | None, block_size: int) -> None:
    if window is not None and window < block_size:
        raise ValueError(f"sliding window {window} is shorter than the draft block ({block_size} tokens): a block "
                         f"must see all of itself; use a window >= block_size, or none")


def dense_block_mask(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int,
                     window: int | None = None) -> torch.Tensor:
    """[B, 1, N*block, S + N*block] boolean mask (True = may attend) for SDPA."""
    check_window(window, block_size)
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    device = anchors.device
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(context_len + q_len, device=device)[None, None, :]
    return visible(anchors, valid, context_len, block_size, b, q, kv, window)[:, None]


def flex_block_mask(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int,
                    window: int | None = None):
    """The same mask as a flex_attention BlockMask (sparse tiles; for CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask

    check_window(window, block_size)
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(anchors, valid, context_len, block_size, b, q_idx, kv_idx, window)

    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=context_len + q_len,
                             device=anchors.device)


def build_block_mask(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int,
                     backend: str, window: int | None = None):
    """`backend`: "flex", "sdpa" or "auto" (flex on CUDA, dense SDPA elsewhere)."""
    if backend == "auto":
        backend = "flex" if anchors.is_cuda and flex_available() else "sdpa"
    if backend == "flex":
        return flex_block_mask(anchors, valid, context_len, block_size, window)
    if backend == "sdpa":
        return dense_block_mask(anchors, valid, context_len, block_size, window)
    raise ValueError(f"drafter.attention: unknown backend {backend!r}; use auto, flex or sdpa")


def window_by_positions(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, 1, Q, K] mask of the sliding window alone, from absolute positions (q_pos [B, Q], kv_pos
    [B, K]): what the drafter ANDs onto its attention mask when its config has a window."""
    return ((q_pos[:, :, None] - kv_pos[:, None, :]).abs() < window)[:, None]


def restrict_to_window(mask, q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int):
    """`mask` (None, dense boolean [B, 1, Q, K] or a flex BlockMask) limited to the window."""
    if is_block_mask(mask):
        from torch.nn.attention.flex_attention import create_block_mask
        inner = mask.mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            return inner(b, h, q_idx, kv_idx) & ((q_pos[b, q_idx] - kv_pos[b, kv_idx]).abs() < window)

        return create_block_mask(mask_mod, B=q_pos.shape[0], H=None, Q_LEN=q_pos.shape[1], KV_LEN=kv_pos.shape[1],
                                 device=q_pos.device)
    in_window = window_by_positions(q_pos, kv_pos, window)
    return in_window if mask is None else mask & in_window


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def is_block_mask(mask) -> bool:
    return mask is not None and type(mask).__name__ == "BlockMask"


_compiled_flex = None


def flex_attend(q, k, v, block_mask) -> torch.Tensor:
    """flex_attention, compiled once per process (uncompiled flex materialises the full score matrix)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
