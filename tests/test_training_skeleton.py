"""The skeleton both training loops stand on (eqc_utils.training): step logs, the checkpoint layout, pruning,
moving checkpoints aside, and the resume rule, on an nn.Linear trained by accelerate on the CPU."""
import json

import pytest
import torch
from torch import nn

from eqc_utils.training import CheckpointDir, JsonlLog, plan_resume


def _trajectory(**changes) -> dict:
    settings = {"lr": 1e-3, "seed": 0, **changes}
    return {"settings": settings, "digest": json.dumps(settings, sort_keys=True)}


class Trainer:
    """A tiny model, optimiser and LambdaLR prepared and registered the way both loops do it."""

    def __init__(self):
        from accelerate import Accelerator
        self.accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.accelerator.backward(self.model(torch.ones(3, 4)).pow(2).sum())
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, ckpts: CheckpointDir, step: int, trajectory=None, total_steps: int = 10, **keep) -> None:
        meta = {"trajectory": trajectory or _trajectory(), "horizons": [{"from_step": 0, "total_steps": total_steps}]}
        ckpts.save(self.accelerator, step, meta, lambda path: (path.mkdir(), torch.save(self.weights(), path / "w.pt")),
                   **keep)


@pytest.fixture
def trainer():
    return Trainer()


def test_jsonl_log_appends_truncates_and_resets(tmp_path):
    log = JsonlLog(tmp_path / "logs" / "train.jsonl")
    assert log.read() == []
    log.truncate(3)                                    # nothing logged yet: nothing to do
    assert not log.path.exists()
    for step in range(1, 5):
        log.append({"step": step, "loss": 1.0 / step})
    assert [r["step"] for r in log.read()] == [1, 2, 3, 4]
    log.truncate(2)
    assert [r["step"] for r in log.read()] == [1, 2]
    with open(log.path, "a") as f:                     # a row cut short by a kill: left out
        f.write('{"step": 3, "lo')
    assert [r["step"] for r in log.read()] == [1, 2]
    log.truncate(2)                                    # and dropped by the next rewrite
    log.append({"step": 3})
    assert [r["step"] for r in log.read()] == [1, 2, 3]
    log.path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="train.jsonl:2"):
        log.read()
    log.reset()
    assert log.read() == [] and not log.path.exists()


def test_a_checkpoint_holds_state_export_and_meta_and_restores_the_run(tmp_path, trainer):
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    trainer.step(2)
    saved, lr = trainer.weights(), trainer.scheduler.get_last_lr()
    trainer.save(ckpts, 2)
    folder = ckpts.folder(2)
    assert {p.name for p in folder.iterdir()} == {"state", "weights", "meta.json"}
    assert {"model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl"} <= {p.name for p in (folder / "state").iterdir()}
    meta = ckpts.meta(2)
    assert meta["step"] == 2 and meta["trajectory"] == _trajectory() and "time" in meta
    assert ckpts.steps() == ckpts.resumable() == [2]
    trainer.step(3)
    ckpts.load(trainer.accelerator, 2)
    for name, value in saved.items():
        torch.testing.assert_close(trainer.weights()[name], value, rtol=0, atol=0)
    assert trainer.scheduler.last_epoch == 2 and trainer.scheduler.get_last_lr() == lr
    # a folder without meta.json is an unfinished save: not listed, and replaced when that step is saved again
    (ckpts.folder(3) / "state").mkdir(parents=True)
    (ckpts.folder(3) / "state" / "half-written").write_text("")
    assert ckpts.steps() == [2] and ckpts.all_steps() == [2, 3]
    trainer.save(ckpts, 3)
    assert ckpts.steps() == [2, 3] and not (ckpts.folder(3) / "state" / "half-written").exists()


def test_a_checkpoint_that_would_not_fit_on_the_disk_is_refused_before_writing(tmp_path, trainer, monkeypatch):
    """The free space must hold one more checkpoint: the newest whole one's size (or the estimate, for the first).
    A refusal names the checkpoint, the folder and both sizes, and leaves the earlier checkpoints as they were."""
    import shutil
    from collections import namedtuple

    from eqc_utils.io import DiskSpaceError, tree_bytes
    from eqc_utils.training import estimated_bytes
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    # nn.Linear(4, 2): 10 fp32 weights, each twice (state and export) plus AdamW's two moments
    assert estimated_bytes(trainer.model) == 10 * (2 * 4 + 8)
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    free = {"bytes": None}
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: usage(1, 0, free["bytes"]) if free["bytes"] is not None else real(path))
    free["bytes"] = 10 ** 6
    with pytest.raises(DiskSpaceError, match=r"checkpoint step-1 needs about .* GiB at .*ckpts.*free"):
        trainer.save(ckpts, 1, expected_bytes=2 * 10 ** 6)
    assert ckpts.all_steps() == []
    trainer.save(ckpts, 1, expected_bytes=10 ** 5)        # fits
    size = tree_bytes(ckpts.folder(1))
    assert size > 0
    free["bytes"] = size                                # less than 1.1 x the newest checkpoint
    with pytest.raises(DiskSpaceError, match="checkpoint step-2"):
        trainer.save(ckpts, 2)
    assert ckpts.steps() == ckpts.resumable() == [1] and ckpts.all_steps() == [1]
    free["bytes"] = 2 * size
    trainer.save(ckpts, 2)
    assert ckpts.steps() == [1, 2]


@pytest.mark.parametrize("keep_exports", [False, True])
def test_prune_keeps_the_newest_whole(tmp_path, trainer, keep_exports):
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    for step in range(1, 5):
        trainer.step()
        trainer.save(ckpts, step, keep_last=2, keep_exports=keep_exports)
    assert ckpts.resumable() == [3, 4]
    if keep_exports:      # older checkpoints keep their exported weights and meta, not their training state
        assert ckpts.steps() == [1, 2, 3, 4]
        assert sorted(p.name for p in ckpts.folder(1).iterdir()) == ["meta.json", "weights"]
    else:
        assert ckpts.steps() == ckpts.all_steps() == [3, 4]
    ckpts.prune(0)        # 0 = keep all
    assert ckpts.resumable() == [3, 4]


def test_checkpoints_after_a_step_are_moved_aside_not_deleted(tmp_path, trainer):
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    for step in (1, 2, 3):
        trainer.save(ckpts, step)
    assert ckpts.move_after(3) == (None, [])
    dest, moved = ckpts.move_after(1, stamp="20260101-000000")
    assert moved == [2, 3] and dest.name == "ckpts.stale-20260101-000000"
    assert ckpts.steps() == [1] and CheckpointDir(dest, export="weights").steps() == [2, 3]


def test_resume_continues_from_the_newest_matching_checkpoint(tmp_path, trainer):
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    fresh = plan_resume(ckpts, _trajectory(), 10, resume=True)
    assert (fresh.step, fresh.afresh, fresh.later) == (None, None, [])
    assert fresh.horizons == [{"from_step": 0, "total_steps": 10}]
    for step in (2, 4):
        trainer.save(ckpts, step)
    plan = plan_resume(ckpts, _trajectory(), 10, resume=True)
    assert (plan.step, plan.meta["step"], plan.old_horizon, plan.later, plan.afresh) == (4, 4, None, [], None)
    assert plan.horizons == [{"from_step": 0, "total_steps": 10}]


def test_a_changed_horizon_keeps_the_checkpoints_and_records_the_new_schedule(tmp_path, trainer):
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    for step in (2, 4):
        trainer.save(ckpts, step)
    longer = plan_resume(ckpts, _trajectory(), 20, resume=True)
    assert (longer.step, longer.old_horizon, longer.later) == (4, 10, [])
    assert longer.horizons == [{"from_step": 0, "total_steps": 10}, {"from_step": 4, "total_steps": 20}]
    shorter = plan_resume(ckpts, _trajectory(), 3, resume=True)
    assert (shorter.step, shorter.old_horizon, shorter.later) == (2, 10, [4])
    assert shorter.horizons[-1] == {"from_step": 2, "total_steps": 3}
    past = plan_resume(ckpts, _trajectory(), 1, resume=True)
    assert past.step is None and past.later == [2, 4] and "past this run's 1 steps" in past.afresh
    assert past.changes is None and past.horizons == [{"from_step": 0, "total_steps": 1}]


def test_changed_settings_or_resume_false_start_afresh(tmp_path, trainer):
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    for step in (2, 4):
        trainer.save(ckpts, step)
    changed = plan_resume(ckpts, _trajectory(lr=1e-4), 10, resume=True)
    assert changed.step is None and changed.later == [2, 4]
    assert changed.changes == "lr: 0.001 -> 0.0001" and "other settings (lr: 0.001 -> 0.0001)" in changed.afresh
    off = plan_resume(ckpts, _trajectory(), 10, resume=False, resume_key="drafter.resume")
    assert off.step is None and off.later == [2, 4] and off.afresh == "drafter.resume is false" and off.changes is None


def test_only_checkpoints_that_kept_their_state_are_resumed(tmp_path, trainer):
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    for step in (1, 2, 3):
        trainer.save(ckpts, step, keep_last=1, keep_exports=True)
    assert plan_resume(ckpts, _trajectory(), 10, resume=True).step == 3
    plan = plan_resume(ckpts, _trajectory(), 2, resume=True)      # step 2 kept only its export
    assert plan.step is None and "past this run's 2 steps" in plan.afresh


def test_checkpoints_of_earlier_versions(tmp_path, trainer):
    """No trajectory recorded: never resumed; horizons named after qad.max_steps are read as total_steps."""
    ckpts = CheckpointDir(tmp_path / "ckpts", export="weights")
    trainer.save(ckpts, 2)
    meta = ckpts.meta(2)
    meta["horizons"] = [{"from_step": 0, "max_steps": 10}]
    (ckpts.folder(2) / "meta.json").write_text(json.dumps(meta))
    plan = plan_resume(ckpts, _trajectory(), 12, resume=True)
    assert plan.step == 2 and plan.old_horizon == 10
    assert plan.horizons == [{"from_step": 0, "total_steps": 10}, {"from_step": 2, "total_steps": 12}]
    del meta["trajectory"]
    (ckpts.folder(2) / "meta.json").write_text(json.dumps(meta))
    plan = plan_resume(ckpts, _trajectory(), 10, resume=True)
    assert plan.step is None and "settings not recorded" in plan.changes
