import pytest
import torch

from eqc_utils.training import apply_schedule, warmup_cosine


@pytest.mark.parametrize("total,warmup", [(100, 10), (50, 0), (8, 3)])
def test_qad_schedule_is_transformers_cosine_with_warmup(total, warmup):
    from transformers import get_cosine_schedule_with_warmup
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_cosine_schedule_with_warmup(optimizer, warmup, total).lr_lambdas[0]
    ours = warmup_cosine(total, warmup, from_zero=True)
    assert [ours(s) for s in range(total + 1)] == pytest.approx([reference(s) for s in range(total + 1)], abs=1e-12)


def test_drafter_schedule_ramps_from_the_first_step_and_ends_at_zero():
    f = warmup_cosine(10, 4)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(1.0) and f(10) == pytest.approx(0.0) and f(11) == pytest.approx(0.0)
    assert f(7) == pytest.approx(0.5)


def test_apply_schedule_moves_the_learning_rate_to_the_new_schedule():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(100, 0))
    for _ in range(50):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    longer = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(200, 0))
    longer.load_state_dict(state)
    apply_schedule(longer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 * warmup_cosine(200, 0)(50))
    assert longer.get_last_lr() == [optimizer.param_groups[0]["lr"]]
