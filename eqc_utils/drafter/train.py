"""Training a DFlash drafter against a frozen target (docs/recipe.md §3.2-3.4), top to bottom:
config -> data -> target -> drafter -> optimiser -> loop (with checkpoints and resume).

One function serves the three runs of the paper's stage 3; only its inputs differ:
  pretrain  teacher data,  the (BF16) teacher as target,   random init
  finetune  QAD data,      the dense twin of the QAD target, warm start from pretrain's drafter
  direct    QAD data,      the dense twin of the QAD target, random init (ablation)

Per micro-batch: the target runs once without gradients up to its deepest chosen layer (its hidden
states are the drafter's context, recomputed every step from the current target: nothing cached can go
stale); anchors are drawn; the drafter fills every block in one pass under the anchor-strict mask;
the loss is read out through the target's frozen LM head at scored positions only. `accelerate`
provides devices, bf16 autocast and gradient accumulation; launched with `accelerate launch` the
same loop runs data-parallel (each rank takes its own share of every epoch's batches).

Resume: every checkpoint records the settings its trajectory depends on (`trajectory_settings`). A run
with the same ones continues from the newest checkpoint it can use; logging, saving, evaluation and
serving keys (NEUTRAL_KEYS) never invalidate checkpoints; `epochs`/`max_steps` only set the schedule's
length (see `_plan_resume`). Checkpoints that cannot be continued are moved aside
(`checkpoints.stale-<YYYYmmdd-HHMMSS>`), never deleted, and the changed settings are logged.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eqc_utils import io
from eqc_utils.devices import resolve_device, wants_compile
from eqc_utils.params import params_digest
from eqc_utils.training import apply_schedule, warmup_cosine
from eqc_utils.drafter.data import build_examples, collate, epoch_batches
from eqc_utils.drafter.features import context_features, freeze, input_embedding, output_head
from eqc_utils.drafter.mask import build_block_mask
from eqc_utils.drafter.model import (DFlashDrafter, drafter_config_for, load_drafter, pick_mask_token_id,
                                     save_drafter, unwrap)
from eqc_utils.drafter.objective import block_targets, fused_head_loss, sample_anchors, weighted_loss

STATE_FILE = "training_state.pt"
HISTORY_FILE = "history.json"
FINAL_DIR = "drafter"
CHECKPOINTS_DIR = "checkpoints"

# `drafter` keys that never make a checkpoint invalid: logging, saving, evaluation and serving, and how the
# same math is executed (precision, attention kernel). Every other key (one added to the schema later too)
# is part of the trajectory, except the schedule's length (HORIZON_KEYS).
NEUTRAL_KEYS = frozenset({"save_every", "log_every", "resume", "run_direct", "eval_max_new_tokens",
                          "eval_temperature", "vllm_check", "vllm_prompts", "vllm_args", "near_tie_margin",
                          "precision", "attention", "fused_loss", "compile"})
HORIZON_KEYS = ("epochs", "max_steps")


@dataclass
class TrainRun:
    """One training run: what to train against, on what, from where, into which folder."""
    name: str                       # pretrain / finetune / direct
    target_dir: Path
    rows: list[dict]                # training conversations (held-out rows already removed)
    out_dir: Path                   # checkpoints/, drafter/, history.json go here
    init_from: Path | None = None   # warm start: a drafter folder
    history: list[dict] = field(default_factory=list)


def load_target(target_dir: Path, device: str, precision: str):
    """The frozen target. bf16 weights on CUDA; on CPU fp32 weights (autocast does the bf16 math)."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if (device.startswith("cuda") and precision == "bf16") else torch.float32
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
    return freeze(target.to(device))


def new_drafter(P: dict, target, tokenizer, init_from: Path | None) -> DFlashDrafter:
    if init_from is not None:
        return load_drafter(init_from)            # its config (layers, target layers, mask) governs
    mask_id = P["mask_token_id"] if P["mask_token_id"] is not None else pick_mask_token_id(tokenizer)
    cfg = drafter_config_for(target.config, num_layers=P["num_layers"], block_size=P["block_size"],
                             target_layer_ids=P["target_layer_ids"], mask_token_id=mask_id,
                             intermediate_size=P["intermediate_size"])
    return DFlashDrafter(cfg)


def drafter_step(drafter, target, batch: dict, P: dict, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch (call under autocast)."""
    cfg = unwrap(drafter).config
    lengths = batch["attention_mask"].sum(1)
    features = context_features(target, batch["input_ids"], batch["attention_mask"], cfg.target_layer_ids)
    anchors, valid = sample_anchors(batch["loss_mask"], lengths, cfg.block_size, P["num_anchors"], generator)
    blocks = block_targets(batch["input_ids"], batch["loss_mask"], lengths, anchors, valid, cfg.block_size,
                           cfg.mask_token_id, P["loss_decay_gamma"])
    context_len = batch["input_ids"].shape[1]
    mask = build_block_mask(anchors, valid, context_len, cfg.block_size, P["attention"])
    with torch.no_grad():
        block_embeds = input_embedding(target)(blocks["block_ids"])
    context_pos = torch.arange(context_len, device=anchors.device).expand(anchors.shape[0], -1)
    positions = torch.cat([context_pos, blocks["positions"]], dim=1)
    hidden = drafter(block_embeds, features, positions, mask=mask)
    if P.get("fused_loss"):
        return fused_head_loss(hidden, output_head(target), blocks["labels"], blocks["weights"],
                               compiled=bool(P.get("compiled")))
    return weighted_loss(hidden, output_head(target), blocks["labels"], blocks["weights"])


def _checkpoints(out_dir: Path) -> list[Path]:
    return sorted((out_dir / CHECKPOINTS_DIR).glob("step_*"))


def trajectory_settings(run: TrainRun, P: dict, rows: list[dict], seed: int, num_examples: int) -> dict:
    """What a checkpoint's weights and optimiser state depend on, as flat named settings."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True).encode())
    return {"target": str(run.target_dir), "init_from": str(run.init_from), "seed": seed,
            "training_rows": digest.hexdigest()[:16], "examples": num_examples,
            **{f"drafter.{k}": v for k, v in P.items() if k not in NEUTRAL_KEYS and k not in HORIZON_KEYS}}


def _settings_digest(settings: dict) -> str:
    return params_digest(settings)


def _legacy_digest(run: TrainRun, P: dict, num_examples: int) -> str:
    """The digest earlier versions stored in each checkpoint (over every drafter key)."""
    return params_digest({"P": P, "target": str(run.target_dir), "init": str(run.init_from),
                          "examples": num_examples})


def _save_checkpoint(run: TrainRun, drafter, optimizer, scheduler, counters: dict, generator, trajectory: dict,
                     horizons: list[dict]) -> Path:
    path = run.out_dir / CHECKPOINTS_DIR / f"step_{counters['step']:06d}"
    save_drafter(unwrap(drafter), path)
    torch.save({"counters": counters, "digest": _settings_digest(trajectory), "settings": trajectory,
                "horizons": horizons, "history": run.history,
                "weights": {k: v.detach().cpu() for k, v in unwrap(drafter).state_dict().items()},
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "generator": generator.get_state()}, path / STATE_FILE)
    io.write_json(run.out_dir / HISTORY_FILE, run.history)
    return path


@dataclass
class ResumePlan:
    state: dict | None = None            # the checkpoint to continue from (None: start afresh)
    path: Path | None = None
    set_aside: str | None = None         # why the whole run folder's training state goes aside
    later: list[Path] = field(default_factory=list)   # checkpoints after `path`: moved aside
    old_horizon: int | None = None       # the schedule length the checkpoint was trained towards, if other


def _plan_resume(run: TrainRun, P: dict, trajectory: dict, legacy_digest: str, total_steps: int) -> ResumePlan:
    """Which checkpoint to continue from, and what to move aside (reads only: every process plans).

    The warmup-cosine schedule spans `total_steps` (drafter.epochs / max_steps). Changing it keeps the
    checkpoints: the run continues from the newest one at or before `total_steps`, and from there the
    learning rate follows the new schedule (the steps before followed the old one; each checkpoint records
    the horizons in `horizons`). drafter.resume=false gives a run with one schedule."""
    folder = run.out_dir / CHECKPOINTS_DIR
    complete = [(step, path) for step, path in checkpoint_steps(run.out_dir) if (path / STATE_FILE).exists()]
    if not complete:
        return ResumePlan(set_aside="no complete checkpoint to continue from" if folder.exists() else None)
    if not P["resume"]:
        return ResumePlan(set_aside="drafter.resume is false")
    newest = torch.load(complete[-1][1] / STATE_FILE, map_location="cpu", weights_only=False)
    if "settings" in newest:
        if newest["digest"] != _settings_digest(trajectory):
            changes = io.describe_changes(newest["settings"], trajectory)
            return ResumePlan(set_aside=f"its checkpoints were made with other settings ({changes})")
    elif newest["digest"] != legacy_digest:
        return ResumePlan(set_aside="its checkpoints were made with other settings (not recorded by the "
                                    "version that made them)")
    usable = [(step, path) for step, path in complete if step <= total_steps]
    if not usable:
        return ResumePlan(set_aside=f"every checkpoint is past this run's {total_steps} steps")
    step, path = usable[-1]
    state = newest if path == complete[-1][1] else torch.load(path / STATE_FILE, map_location="cpu",
                                                              weights_only=False)
    horizons = state.get("horizons") or [{"from_step": 0, "total_steps": total_steps}]
    old = horizons[-1]["total_steps"]
    return ResumePlan(state=state, path=path, later=[p for s, p in checkpoint_steps(run.out_dir) if s > step],
                      old_horizon=old if old != total_steps else None)


def _set_aside(run: TrainRun, plan: ResumePlan, log) -> None:
    """Move what the plan gives up (never delete it)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if plan.set_aside:
        moved = [m.name for name in (CHECKPOINTS_DIR, FINAL_DIR, HISTORY_FILE)
                 if (m := io.move_aside(run.out_dir / name, stamp)) is not None]
        if moved:
            log(f"[{run.name}] {run.out_dir}: {plan.set_aside}; moved aside {', '.join(moved)} "
                "(delete them once no longer needed); starting afresh")
    elif plan.later:
        dest = io.stale_name(run.out_dir / CHECKPOINTS_DIR, stamp)
        dest.mkdir()
        for path in plan.later:
            os.replace(path, dest / path.name)
        log(f"[{run.name}] continuing from {plan.path.name}: the later checkpoints "
            f"{', '.join(p.name for p in plan.later)} moved aside to {dest.name}")


def train_drafter(run: TrainRun, P: dict, tokenizer, *, device: str = "auto", seed: int = 0, log=print) -> Path:
    """Train one run; returns the final drafter folder (`out_dir/drafter`). Resumable."""
    from accelerate import Accelerator

    device = resolve_device(device)
    accelerator = Accelerator(cpu=device == "cpu", gradient_accumulation_steps=P["grad_accum"],
                              mixed_precision="bf16" if P["precision"] == "bf16" else "no")
    torch.manual_seed(seed)
    target = load_target(run.target_dir, str(accelerator.device), P["precision"])
    drafter = new_drafter(P, target, tokenizer, run.init_from)
    used_rows = run.rows[:P["max_conversations"]] if P["max_conversations"] else run.rows
    examples = build_examples(used_rows, tokenizer, P["max_length"], 2 * drafter.block_size, where=run.name)

    rank, world = accelerator.process_index, accelerator.num_processes
    batches_per_epoch = len(epoch_batches(len(examples), P["batch_size"], seed, 0, rank, world))
    if batches_per_epoch < P["grad_accum"]:
        raise ValueError(f"[{run.name}] {len(examples)} usable conversations give {batches_per_epoch} batches per "
                         f"epoch per device, fewer than drafter.grad_accum={P['grad_accum']}: add data or lower "
                         "drafter.batch_size / grad_accum")
    steps_per_epoch = batches_per_epoch // P["grad_accum"]
    total_steps = P["epochs"] * steps_per_epoch
    if P["max_steps"]:
        total_steps = min(total_steps, P["max_steps"])

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=P["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(total_steps, max(1, int(P["warmup_ratio"] * total_steps))))
    generator = torch.Generator().manual_seed(seed + rank)
    trajectory = trajectory_settings(run, P, used_rows, seed, len(examples))
    plan = _plan_resume(run, P, trajectory, _legacy_digest(run, P, len(examples)), total_steps)
    accelerator.wait_for_everyone()              # every process has planned before anything is moved
    if rank == 0:
        _set_aside(run, plan, log)
    accelerator.wait_for_everyone()
    counters = {"step": 0, "epoch": 0, "batch": 0}
    horizons = [{"from_step": 0, "total_steps": total_steps}]
    if plan.state is not None:
        state = plan.state
        unwrap(drafter).load_state_dict(state["weights"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(state["generator"])
        run.history[:] = state["history"]
        counters = state["counters"]
        horizons = state.get("horizons") or horizons
        log(f"[{run.name}] resuming from {plan.path.name}")
        if plan.old_horizon is not None:
            apply_schedule(scheduler)
            horizons = horizons + [{"from_step": counters["step"], "total_steps": total_steps}]
            log(f"[{run.name}] the schedule length changed from {plan.old_horizon} to {total_steps} steps "
                f"(drafter.epochs / max_steps): from step {counters['step']} on, the learning rate follows the "
                f"new schedule ({scheduler.get_last_lr()[0]:.3g} now); the steps before followed the old one "
                "(drafter.resume=false gives a run with one schedule)")
    else:
        run.history.clear()
    if wants_compile(P["compile"], str(accelerator.device)):
        # in place (nn.Module.compile): state_dict keys and checkpoints stay those of the plain module;
        # dynamic shapes, since batches differ in length and in anchor count
        drafter.compile(dynamic=True)
        P = {**P, "compiled": True}
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    drafter.train()

    log(f"[{run.name}] {len(examples)} conversations, {steps_per_epoch} optimiser steps/epoch, "
        f"{total_steps} steps, {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M trainable parameters, "
        f"device {accelerator.device}, world {world}")
    bar = tqdm(total=total_steps, initial=counters["step"], desc=f"drafter {run.name}", disable=rank != 0)
    window = {"loss": 0.0, "accuracy": 0.0, "n": 0}
    started = time.time()
    while counters["step"] < total_steps:
        batches = epoch_batches(len(examples), P["batch_size"], seed, counters["epoch"], rank, world)
        usable = steps_per_epoch * P["grad_accum"]
        for index in range(counters["batch"], usable):
            batch = collate([examples[i] for i in batches[index]], accelerator.device)
            # anchors depend only on (seed, rank, epoch, batch): a resumed or re-launched run draws the same ones
            generator.manual_seed(seed + 1_000_003 * rank + 7_919 * counters["epoch"] + index)
            with accelerator.accumulate(drafter), accelerator.autocast():
                loss, stats = drafter_step(drafter, target, batch, P, generator)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(drafter.parameters(), P["max_grad_norm"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            window["loss"] += loss.item()
            window["accuracy"] += 0.0 if math.isnan(stats["accuracy"]) else stats["accuracy"]
            window["n"] += 1
            counters["batch"] = index + 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            counters["step"] += 1
            bar.update(1)
            if counters["step"] % P["log_every"] == 0 or counters["step"] == total_steps:
                entry = {"step": counters["step"], "epoch": counters["epoch"], "lr": scheduler.get_last_lr()[0],
                         "loss": window["loss"] / window["n"], "accuracy": window["accuracy"] / window["n"],
                         "seconds": round(time.time() - started, 1)}
                run.history.append(entry)
                bar.set_postfix(loss=f"{entry['loss']:.3f}", acc=f"{entry['accuracy']:.3f}")
                window = {"loss": 0.0, "accuracy": 0.0, "n": 0}
            if (counters["step"] % P["save_every"] == 0 or counters["step"] == total_steps) and rank == 0:
                _save_checkpoint(run, drafter, optimizer, scheduler, counters, generator, trajectory, horizons)
            if counters["step"] >= total_steps:
                break
        else:
            counters["epoch"] += 1
            counters["batch"] = 0
    bar.close()
    accelerator.wait_for_everyone()
    final = run.out_dir / FINAL_DIR
    if rank == 0:
        save_drafter(unwrap(drafter), final)
        io.write_json(run.out_dir / HISTORY_FILE, run.history)
    return final


def checkpoint_steps(out_dir: Path) -> list[tuple[int, Path]]:
    """(optimiser step, folder) of every saved checkpoint of a run, oldest first."""
    return [(int(p.name.split("_")[1]), p) for p in _checkpoints(out_dir)]


def read_history(out_dir: Path) -> list[dict]:
    path = out_dir / HISTORY_FILE
    return json.loads(path.read_text()) if path.exists() else []
