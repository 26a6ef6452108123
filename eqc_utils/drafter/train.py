"""Training a DFlash drafter against a frozen target (METHOD.md §3.2-3.4), top to bottom:
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
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eqc_utils import io
from eqc_utils.devices import resolve_device
from eqc_utils.params import params_digest
from eqc_utils.drafter.data import build_examples, collate, epoch_batches
from eqc_utils.drafter.features import context_features, freeze, input_embedding, output_head
from eqc_utils.drafter.mask import build_block_mask
from eqc_utils.drafter.model import (DFlashDrafter, drafter_config_for, load_drafter, pick_mask_token_id,
                                     save_drafter, unwrap)
from eqc_utils.drafter.objective import block_targets, sample_anchors, weighted_loss

STATE_FILE = "training_state.pt"
HISTORY_FILE = "history.json"
FINAL_DIR = "drafter"
CHECKPOINTS_DIR = "checkpoints"


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


def warmup_cosine(total_steps: int, warmup_ratio: float):
    """Linear warmup from lr/W to lr over W = int(ratio * total) steps, then cosine to 0 (reference)."""
    warmup = max(1, int(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


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
    return weighted_loss(hidden, output_head(target), blocks["labels"], blocks["weights"])


def _checkpoints(out_dir: Path) -> list[Path]:
    return sorted((out_dir / CHECKPOINTS_DIR).glob("step_*"))


def _run_digest(run: TrainRun, P: dict, num_examples: int) -> str:
    return params_digest({"P": P, "target": str(run.target_dir), "init": str(run.init_from),
                          "examples": num_examples})


def _save_checkpoint(run: TrainRun, drafter, optimizer, scheduler, counters: dict, generator, digest: str) -> Path:
    path = run.out_dir / CHECKPOINTS_DIR / f"step_{counters['step']:06d}"
    save_drafter(unwrap(drafter), path)
    torch.save({"counters": counters, "digest": digest, "history": run.history,
                "weights": {k: v.detach().cpu() for k, v in unwrap(drafter).state_dict().items()},
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "generator": generator.get_state()}, path / STATE_FILE)
    io.write_json(run.out_dir / HISTORY_FILE, run.history)
    return path


def _try_resume(run: TrainRun, drafter, optimizer, scheduler, generator, digest: str, log) -> dict | None:
    for path in reversed(_checkpoints(run.out_dir)):
        if not (path / STATE_FILE).exists():
            continue
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        if state["digest"] != digest:
            log(f"[{run.name}] checkpoints in {run.out_dir} come from other settings: starting afresh")
            return None
        unwrap(drafter).load_state_dict(state["weights"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(state["generator"])
        run.history[:] = state["history"]
        log(f"[{run.name}] resuming from {path.name}")
        return state["counters"]
    return None


def train_drafter(run: TrainRun, P: dict, tokenizer, *, device: str = "auto", seed: int = 0, log=print) -> Path:
    """Train one run; returns the final drafter folder (`out_dir/drafter`). Resumable."""
    from accelerate import Accelerator

    device = resolve_device(device)
    accelerator = Accelerator(cpu=device == "cpu", gradient_accumulation_steps=P["grad_accum"],
                              mixed_precision="bf16" if P["precision"] == "bf16" else "no")
    torch.manual_seed(seed)
    target = load_target(run.target_dir, str(accelerator.device), P["precision"])
    drafter = new_drafter(P, target, tokenizer, run.init_from)
    examples = build_examples(run.rows[:P["max_conversations"]] if P["max_conversations"] else run.rows,
                              tokenizer, P["max_length"], 2 * drafter.block_size, where=run.name)

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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total_steps, P["warmup_ratio"]))
    generator = torch.Generator().manual_seed(seed + rank)
    digest = _run_digest(run, P, len(examples))
    counters = {"step": 0, "epoch": 0, "batch": 0}
    resumed = _try_resume(run, drafter, optimizer, scheduler, generator, digest, log) if P["resume"] else None
    if resumed:
        counters = resumed
    elif (run.out_dir / CHECKPOINTS_DIR).exists():
        shutil.rmtree(run.out_dir / CHECKPOINTS_DIR)
        run.history.clear()
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
                _save_checkpoint(run, drafter, optimizer, scheduler, counters, generator, digest)
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
