"""One checkpoint layout for both training loops, and one rule for what a run continues from.

    <root>/step-<N>/state/       accelerate's save_state: model, optimiser, the registered scheduler, RNG states
    <root>/step-<N>/<export>/    the weights in the form the next stage loads (QAD: student/, drafter: drafter/)
    <root>/step-<N>/meta.json    written last, so a folder without it is an unfinished save and is ignored

meta.json holds the step, the time, the trajectory ({"settings", "digest"}: what the weights depend on), the
schedule horizons and whatever the loop adds. Checkpoints a run does not continue are moved aside into
`<root>.stale-<stamp>/`, never deleted: the only deletion is pruning, which the settings ask for.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eqc_utils.io import describe_changes, ensure_free_space, read_json, stale_name, tree_bytes, write_json

META_FILE = "meta.json"
STATE_DIR = "state"
_STEP_FOLDER = re.compile(r"step-(\d+)")


class CheckpointDir:
    """The checkpoints of one run under `root`; `export` names the folder of loadable weights in each."""

    def __init__(self, root: str | Path, export: str):
        self.root = Path(root)
        self.export = export

    def folder(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def export_folder(self, step: int) -> Path:
        return self.folder(step) / self.export

    def all_steps(self) -> list[int]:
        """Every step folder, finished or not."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_FOLDER.fullmatch(p.name)))

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first (some may have been pruned to their export)."""
        return [s for s in self.all_steps() if (self.folder(s) / META_FILE).exists()]

    def resumable(self) -> list[int]:
        """Complete checkpoints that still hold their training state."""
        return [s for s in self.steps() if (self.folder(s) / STATE_DIR).is_dir()]

    def meta(self, step: int) -> dict:
        return read_json(self.folder(step) / META_FILE)

    def load(self, accelerator, step: int) -> None:
        """Restore what `save` stored through accelerate (every process calls this, after `prepare`)."""
        accelerator.load_state(str(self.folder(step) / STATE_DIR))

    def save(self, accelerator, step: int, meta: dict, export: Callable[[Path], None], *, keep_last: int = 0,
             keep_exports: bool = False, expected_bytes: int = 0) -> Path:
        """Checkpoint `step`; every process calls this (each saves its own RNG state, DeepSpeed its shard).
        `export(path)` writes the loadable weights into `path` (main process only). Before writing, the disk
        must have room for one more checkpoint: the size of the newest whole one, or `expected_bytes` for the
        first (estimated_bytes); otherwise DiskSpaceError says where and how much."""
        folder = self.folder(step)
        ensure_free_space(self.root, int(1.1 * (self._last_whole_bytes() or expected_bytes)),
                          f"checkpoint {folder.name}")
        if accelerator.is_main_process and folder.exists():
            shutil.rmtree(folder)          # an attempt at this step that was killed before its meta.json
        accelerator.wait_for_everyone()    # cleared before anyone writes into it
        accelerator.save_state(str(folder / STATE_DIR))
        accelerator.wait_for_everyone()    # every process's part is on disk before meta.json declares it complete
        if accelerator.is_main_process:
            export(folder / self.export)
            write_json(folder / META_FILE, {"step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **meta})
            self.prune(keep_last, keep_exports)
        accelerator.wait_for_everyone()
        return folder

    def _last_whole_bytes(self) -> int:
        whole = self.resumable()
        return tree_bytes(self.folder(whole[-1])) if whole else 0

    def prune(self, keep_last: int, keep_exports: bool = False) -> None:
        """Keep the newest `keep_last` checkpoints whole (0: keep everything). Of the older ones delete only the
        training state when `keep_exports` (their weights stay measurable), else the whole folder."""
        if keep_last <= 0:
            return
        for step in self.steps()[:-keep_last]:
            folder = self.folder(step)
            if keep_exports:
                # renamed first: a removal cut short never leaves a state/ that looks resumable
                doomed = folder / ".state-pruned"
                shutil.rmtree(doomed, ignore_errors=True)
                if (folder / STATE_DIR).exists():
                    os.replace(folder / STATE_DIR, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
            else:
                (folder / META_FILE).unlink()     # unfinished from here on, should the removal be cut short
                shutil.rmtree(folder)

    def move_after(self, step: int, stamp: str | None = None) -> tuple[Path | None, list[int]]:
        """Move every step folder after `step` into `<root>.stale-<stamp>/`; (that folder, the steps moved)."""
        later = [s for s in self.all_steps() if s > step]
        if not later:
            return None, []
        dest = stale_name(self.root, stamp)
        dest.mkdir(parents=True)
        for s in later:
            os.replace(self.folder(s), dest / self.folder(s).name)
        return dest, later


@dataclass
class ResumePlan:
    """What a run continues from. Every process computes the same plan (it only reads); the main process
    then moves `later` aside."""
    step: int | None = None        # the checkpoint to continue from; None: start afresh
    meta: dict | None = None       # its meta.json
    horizons: list[dict] = field(default_factory=list)   # [{from_step, total_steps}, ...] including this run's
    old_horizon: int | None = None   # the schedule length the checkpoint trained towards, when this run's differs
    later: list[int] = field(default_factory=list)       # step folders after `step` (every one when afresh)
    afresh: str | None = None      # why the existing checkpoints are not continued
    changes: str | None = None     # with `afresh`, when the trajectory settings changed: which ones


def plan_resume(ckpts: CheckpointDir, trajectory: dict, total_steps: int, resume: bool,
                resume_key: str = "resume") -> ResumePlan:
    """The newest checkpoint at or before `total_steps` (the schedule's horizon) with the trajectory digest of
    this run, or why there is none.

    The horizon is not part of the trajectory: a longer (or shorter) run continues from the newest checkpoint
    it can use, and from there the learning rate follows the new schedule. `horizons` records where each
    schedule took over, so a run that changed it can be told from one that did not (`resume` false gives one)."""
    fresh = [{"from_step": 0, "total_steps": total_steps}]
    everything = ckpts.all_steps()

    def afresh(reason: str, changes: str | None = None) -> ResumePlan:
        return ResumePlan(horizons=fresh, later=everything, afresh=reason, changes=changes)

    if not everything:
        return ResumePlan(horizons=fresh)
    if not resume:
        return afresh(f"{resume_key} is false")
    metas = {s: ckpts.meta(s) for s in ckpts.resumable()}
    if not metas:
        return afresh("no complete checkpoint to continue from")
    matching = [s for s, meta in metas.items() if (meta.get("trajectory") or {}).get("digest") == trajectory["digest"]]
    if not matching:
        newest = metas[max(metas)].get("trajectory")    # absent: a checkpoint of an earlier version
        changes = describe_changes(newest["settings"] if newest else None, trajectory["settings"])
        return afresh(f"its checkpoints were made with other settings ({changes})", changes)
    usable = [s for s in matching if s <= total_steps]
    if not usable:
        return afresh(f"every checkpoint is past this run's {total_steps} steps")
    step = usable[-1]
    before = [_horizon(h) for h in metas[step].get("horizons") or []] or fresh
    old = before[-1]["total_steps"]
    horizons = before if old == total_steps else before + [{"from_step": step, "total_steps": total_steps}]
    return ResumePlan(step=step, meta=metas[step], horizons=horizons, old_horizon=None if old == total_steps else old,
                      later=[s for s in everything if s > step])


def _horizon(entry: dict) -> dict:
    # QAD checkpoints of the previous version named the horizon after its setting, qad.max_steps
    return {"from_step": entry["from_step"], "total_steps": entry.get("total_steps", entry.get("max_steps"))}


def estimated_bytes(model) -> int:
    """A checkpoint's size from the model it holds: every weight twice (training state and export) and AdamW's
    two fp32 moments per trainable weight."""
    return sum(p.numel() * (2 * p.element_size() + (8 if p.requires_grad else 0)) for p in model.parameters())
