import math

import torch

import pytest

from eqc_utils.drafter.objective import block_targets, decay_weights, fused_head_loss, sample_anchors, weighted_loss


def test_decay_weights_follow_the_reference():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(w[15].item(), math.exp(-14 / 7), rel_tol=1e-6)
    assert torch.all(w[2:] < w[1:-1])


def test_loss_slots_zero_the_later_slots_and_keep_the_others():
    full, cut = decay_weights(16, 4.0), decay_weights(16, 4.0, slots=7)
    assert torch.equal(cut[:8], full[:8]) and torch.all(cut[8:] == 0) and torch.all(full[8:] > 0)
    ids = torch.arange(100, 120)[None]
    loss_mask = torch.ones(1, 20, dtype=torch.long)
    anchors, valid = torch.tensor([[4, 11]]), torch.tensor([[True, True]])
    every = block_targets(ids, loss_mask, torch.tensor([20]), anchors, valid, block_size=4, mask_token_id=7, gamma=7.0)
    two = block_targets(ids, loss_mask, torch.tensor([20]), anchors, valid, block_size=4, mask_token_id=7, gamma=7.0,
                        loss_slots=2)
    assert two["weights"][0].tolist() == [w if slot < 3 else 0.0 for slot, w in zip([0, 1, 2, 3] * 2,
                                                                                     every["weights"][0].tolist())]
    assert all(torch.equal(two[k], every[k]) for k in ("block_ids", "labels", "positions"))


def _batch():
    # row 0: prompt 0..5, answer 6..19 (length 20); row 1: prompt 0..3, answer 4..11 (length 12), padding after
    loss_mask = torch.zeros(2, 20, dtype=torch.long)
    loss_mask[0, 6:20] = 1
    loss_mask[1, 4:12] = 1
    lengths = torch.tensor([20, 12])
    return loss_mask, lengths


def test_anchors_lie_on_the_answer_and_leave_room_for_a_block():
    loss_mask, lengths = _batch()
    block = 4
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        anchors, valid = sample_anchors(loss_mask, lengths, block, num_anchors=64, generator=g)
        for b in range(2):
            chosen = anchors[b][valid[b]]
            assert torch.all(loss_mask[b, chosen] == 1)
            assert torch.all(chosen + block <= lengths[b])
            assert torch.all(chosen[1:] > chosen[:-1])          # distinct, ascending
        # row 0 has 20-4-6+1 = 11 candidates, row 1 has 12-4-4+1 = 5: all taken, the rest disabled
        assert valid[0].sum() == 11 and valid[1].sum() == 5


def test_anchor_count_is_capped_by_num_anchors():
    loss_mask, lengths = _batch()
    anchors, valid = sample_anchors(loss_mask, lengths, 4, num_anchors=3, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3) and valid.all()


def test_block_targets_use_same_position_labels_and_skip_slot_zero():
    ids = torch.arange(100, 120)[None]
    loss_mask = torch.zeros(1, 20, dtype=torch.long)
    loss_mask[0, 8:18] = 1      # last two tokens not scored
    lengths = torch.tensor([20])
    anchors, valid = torch.tensor([[8, 15]]), torch.tensor([[True, True]])
    out = block_targets(ids, loss_mask, lengths, anchors, valid, block_size=4, mask_token_id=7, gamma=7.0)
    assert out["block_ids"].tolist() == [[108, 7, 7, 7, 115, 7, 7, 7]]
    assert out["labels"].tolist() == [[108, 109, 110, 111, 115, 116, 117, 118]]
    assert out["positions"].tolist() == [[8, 9, 10, 11, 15, 16, 17, 18]]
    w = out["weights"][0]
    assert w[0] == 0 and w[4] == 0                           # slot 0
    assert w[1] == 1 and w[5] == 1
    assert w[7] == 0                                         # position 18 is not an assistant token
    assert math.isclose(w[2].item(), math.exp(-1 / 7), rel_tol=1e-6)


def test_disabled_blocks_and_positions_past_the_end_weigh_nothing():
    ids = torch.arange(10)[None]
    loss_mask = torch.ones(1, 10, dtype=torch.long)
    out = block_targets(ids, loss_mask, torch.tensor([8]), torch.tensor([[6, 0]]), torch.tensor([[True, False]]),
                        block_size=4, mask_token_id=7, gamma=7.0)
    w = out["weights"][0]
    assert w[1] > 0 and w[2] == 0 and w[3] == 0              # positions 8, 9 are past length 8
    assert torch.all(w[4:] == 0)
    assert out["block_ids"][0, 4:].tolist() == [7, 7, 7, 7]


def test_weighted_loss_only_scores_weighted_positions():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(1, 6, 8)
    labels = torch.randint(0, 11, (1, 6))
    weights = torch.tensor([[0.0, 1.0, 0.5, 0.0, 0.0, 2.0]])
    loss, stats = weighted_loss(hidden, head, labels, weights)
    ce = torch.nn.functional.cross_entropy(head(hidden[0]), labels[0], reduction="none")
    expected = (ce * weights[0]).sum() / weights.sum()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert stats["scored"] == 3
    # garbage at unweighted positions changes nothing
    hidden2 = hidden.clone()
    hidden2[0, [0, 3, 4]] = 1e4
    torch.testing.assert_close(weighted_loss(hidden2, head, labels, weights)[0], loss)


@pytest.mark.parametrize("chunk", [5, 64])
def test_fused_head_loss_equals_autograd_loss_and_gradient(chunk):
    """Same value, accuracy and d loss / d hidden as the plain autograd computation, for any chunking."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    labels = torch.randint(0, 50, (3, 12))
    weights = torch.rand(3, 12) * (torch.rand(3, 12) > 0.3)
    hidden = torch.randn(3, 12, 16, requires_grad=True)
    plain, plain_stats = weighted_loss(hidden, head, labels, weights)
    (plain_grad,) = torch.autograd.grad(plain * 3.0, hidden)
    fused, fused_stats = fused_head_loss(hidden, head, labels, weights, chunk=chunk)
    (fused_grad,) = torch.autograd.grad(fused * 3.0, hidden)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-5, atol=1e-7)
    assert fused_stats["scored"] == plain_stats["scored"]
    assert float(fused_stats["accuracy"]) == float(plain_stats["accuracy"])
    assert fused_grad[weights == 0].abs().max() == 0          # unscored positions get no gradient


@pytest.mark.parametrize("chunk", [5, 64])
def test_soft_labels_fused_equals_autograd_and_is_smallest_at_the_teachers_distribution(chunk):
    """Soft labels (drafter.labels target_soft): the label is softmax(head(teacher state)). Fused and plain agree
    in value, gradient and argmax agreement; the loss is the teacher's entropy, and the gradient zero, exactly where
    the drafter's state gives the teacher's logits."""
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    labels = torch.randint(0, 50, (3, 12))           # ignored with soft labels
    weights = torch.rand(3, 12) * (torch.rand(3, 12) > 0.3)
    teacher = torch.randn(3, 12, 16) * 2
    hidden = torch.randn(3, 12, 16, requires_grad=True)
    plain, plain_stats = weighted_loss(hidden, head, labels, weights, teacher_hidden=teacher)
    (plain_grad,) = torch.autograd.grad(plain, hidden)
    fused, fused_stats = fused_head_loss(hidden, head, labels, weights, chunk=chunk, teacher_hidden=teacher)
    (fused_grad,) = torch.autograd.grad(fused, hidden)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-5, atol=1e-7)
    keep = weights > 0
    agree = (head(hidden[keep]).argmax(-1) == head(teacher[keep]).argmax(-1)).float().mean()
    assert float(fused_stats["accuracy"]) == float(plain_stats["accuracy"]) == float(agree)
    assert float(plain) != float(weighted_loss(hidden.detach(), head, labels, weights)[0])   # not the hard-label loss

    at_teacher = teacher.clone().requires_grad_(True)
    loss, stats = fused_head_loss(at_teacher, head, labels, weights, chunk=chunk, teacher_hidden=teacher)
    (grad,) = torch.autograd.grad(loss, at_teacher)
    p = torch.softmax(head(teacher[keep]), -1)
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(loss, (entropy * weights[keep]).sum() / weights[keep].sum(), rtol=1e-5, atol=1e-5)
    assert grad.abs().max() < 1e-5 and float(stats["accuracy"]) == 1.0
    assert float(loss) < float(fused)


def test_fused_head_loss_refuses_a_trainable_head():
    head = torch.nn.Linear(4, 10, bias=False)
    with pytest.raises(ValueError, match="fused_loss"):
        fused_head_loss(torch.randn(2, 3, 4), head, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))


def test_padding_and_a_fixed_count_draw_the_same_anchors():
    """Compiled training pads batches and asks for a fixed number of anchors: the valid anchors stay the ones the
    unpadded batch draws (keys drawn over key_width positions), the extra slots are disabled."""
    loss_mask, lengths = _batch()
    padded = torch.nn.functional.pad(loss_mask, (0, 12))
    for seed in range(10):
        short = sample_anchors(loss_mask, lengths, 4, num_anchors=8, key_width=32,
                               generator=torch.Generator().manual_seed(seed))
        fixed = sample_anchors(padded, lengths, 4, num_anchors=8, key_width=32, fixed_count=True,
                               generator=torch.Generator().manual_seed(seed))
        n = short[0].shape[1]
        assert fixed[0].shape == (2, 8) and n == 8           # row 0 has 11 candidates: 8 taken either way
        assert torch.equal(fixed[0], short[0]) and torch.equal(fixed[1], short[1])
        few = sample_anchors(loss_mask[1:], lengths[1:], 4, num_anchors=8, key_width=32,
                             generator=torch.Generator().manual_seed(seed))
        few_fixed = sample_anchors(padded[1:], lengths[1:], 4, num_anchors=8, key_width=32, fixed_count=True,
                                   generator=torch.Generator().manual_seed(seed))
        assert few[0].shape == (1, 5) and few_fixed[0].shape == (1, 8)   # row 1 alone: 5 candidates
        assert torch.equal(few_fixed[0][:, :5], few[0]) and few_fixed[1][:, :5].all() and not few_fixed[1][:, 5:].any()
