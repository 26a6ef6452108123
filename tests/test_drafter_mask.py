import pytest
import torch

from eqc_utils.drafter.mask import dense_block_mask, flex_available, flex_block_mask
from tests._fixtures_drafter import brute_force_mask


@pytest.fixture
def example():
    anchors = torch.tensor([[0, 3, 9, 10], [5, 6, 0, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    return anchors, valid, 14, 4


def test_dense_mask_equals_brute_force(example):
    anchors, valid, context_len, block = example
    assert torch.equal(dense_block_mask(anchors, valid, context_len, block),
                       brute_force_mask(anchors, valid, context_len, block))


def test_anchor_is_strict_and_blocks_are_isolated(example):
    anchors, valid, context_len, block = example
    mask = dense_block_mask(anchors, valid, context_len, block)[0, 0]
    # block 1 (anchor 3): sees context 0..2, not 3 (the anchor's own hidden state), not block 0
    assert mask[block, :3].all() and not mask[block, 3:context_len].any()
    assert not mask[block, context_len:context_len + block].any()
    assert mask[block, context_len + block:context_len + 2 * block].all()
    # block 0 (anchor 0) sees no context at all, only itself: no row is empty
    assert mask.any(-1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not flex_available(), reason="flex_attention BlockMask needs CUDA")
def test_flex_mask_gives_the_same_attention_as_the_dense_mask():
    from eqc_utils.drafter.model import attend
    torch.manual_seed(0)
    anchors = torch.tensor([[0, 40, 77, 130], [5, 6, 90, 0]], device="cuda")
    valid = torch.tensor([[True] * 4, [True, True, True, False]], device="cuda")
    context_len, block = 200, 16
    dense = dense_block_mask(anchors, valid, context_len, block)
    flex = flex_block_mask(anchors, valid, context_len, block)
    q = torch.randn(2, 4, 4 * block, 64, device="cuda")
    k = torch.randn(2, 2, context_len + 4 * block, 64, device="cuda")
    v = torch.randn_like(k)
    out_dense = attend(q, k, v, dense)
    out_flex = attend(q, k, v, flex)
    torch.testing.assert_close(out_flex, out_dense, atol=2e-3, rtol=2e-3)
