"""The learning-rate schedule of both loops, and its re-application when a resumed run changes the
schedule's length (the horizon; see checkpoints.plan_resume)."""
from __future__ import annotations

import math


def warmup_cosine(total_steps: int, warmup_steps: int, *, from_zero: bool = False):
    """LambdaLR factor: linear warmup over `warmup_steps`, then cosine to 0 at `total_steps`.

    The warmup ramps (step + 1) / W, as SpecForge's drafter trainer does; `from_zero` ramps step / W (the first
    step at lr 0), as transformers' `get_cosine_schedule_with_warmup` does for the reference's QAD."""
    warmup = max(1, warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step if from_zero else step + 1) / warmup
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def apply_schedule(scheduler) -> None:
    """Set the optimiser's learning rate to the (new) schedule's value at the loaded step: a resumed run
    whose schedule length changed continues on the new schedule from there."""
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
