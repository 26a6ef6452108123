"""Training a DFlash drafter against a frozen target (docs/recipe.md §3.2-3.4), top to bottom:
setup (target, drafter, data, optimiser) -> resume plan -> loop of micro-batch steps -> checkpoints -> final drafter.

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

A run folder holds checkpoints/step-<N>/{state/, drafter/, meta.json} (the layout of eqc_utils.training, shared
with QAD; drafter/ is a loadable drafter, so tau can be measured at every checkpoint), drafter/ (the final one)
and history.jsonl (the logged steps). Resume: each checkpoint records the settings its trajectory depends on
(`trajectory_settings`); a run with the same ones continues from the newest checkpoint it can use (logging,
saving, evaluation and serving keys, NEUTRAL_KEYS, never invalidate checkpoints; `epochs`/`max_steps` only set
the schedule's length). A run that cannot continue moves checkpoints/, drafter/ and the history aside
(`<name>.stale-<YYYYmmdd-HHMMSS>`), never deleting them, and logs why.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from eqc_utils import io
from eqc_utils.devices import resolve_device, wants_compile
from eqc_utils.params import params_digest
from eqc_utils.training import (CheckpointDir, JsonlLog, ResumePlan, apply_schedule, estimated_bytes, plan_resume,
                                warmup_cosine)
from eqc_utils.drafter.data import build_examples, collate, epoch_batches, padded_width
from eqc_utils.drafter.features import (context_features, context_features_and_greedy, context_features_and_last,
                                        decoder_layers, final_norm,
                                        freeze, input_embedding, output_head)
from eqc_utils.drafter.mask import build_block_mask
from eqc_utils.drafter.model import (DFlashDrafter, drafter_config_for, load_drafter, pick_mask_token_id,
                                     save_drafter, unwrap)
from eqc_utils.drafter.objective import block_targets, fused_head_loss, sample_anchors, weighted_loss

CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "drafter"
HISTORY = "history.jsonl"
# Earlier versions kept checkpoints/step_<6 digits>/ (one torch file of weights, optimiser and counters) and
# history.json. They are not resumed: a run that finds them moves them aside and starts afresh.
LEGACY_CHECKPOINTS = "step_*"
LEGACY_HISTORY = "history.json"

# `drafter` keys that never make a checkpoint invalid: logging, saving, evaluation and serving, and how the
# same math is executed (precision, attention kernel). Every other key (one added to the schema later too)
# is part of the trajectory, except the schedule's length (HORIZON_KEYS).
NEUTRAL_KEYS = frozenset({"save_every", "log_every", "keep_last_ckpts", "resume", "run_direct",
                          "eval_max_new_tokens", "eval_temperature", "vllm_check", "vllm_prompts", "vllm_args",
                          "near_tie_margin", "precision", "attention", "fused_loss", "compile",
                          "curve_conversations", "comparison_seeds", "pad_multiple",
                          "speedup_prompts", "speedup_tokens",
                          "finetune_steps"})   # 07 turns it into its runs' max_steps (runs.stage2_params)
HORIZON_KEYS = ("epochs", "max_steps")


@dataclass
class TrainRun:
    """One training run: what to train against, on what, from where, into which folder."""
    name: str                       # pretrain / finetune / direct
    target_dir: Path
    rows: list[dict]                # training conversations (held-out rows already removed)
    out_dir: Path                   # checkpoints/, drafter/, history.jsonl go here
    init_from: Path | None = None   # warm start: a drafter folder


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
    drafter = DFlashDrafter(cfg)
    if P["init_layers"] == "target_last":
        copy_target_layers(drafter, target)
    return drafter


# a drafter layer without these would start from the target's attention and MLP in name only
_LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@torch.no_grad()
def copy_target_layers(drafter: DFlashDrafter, target) -> None:
    """Start the draft layers as copies of the target's last decoder layers and its final norm (drafter.init_layers:
    target_last): they already map hidden states towards what the shared LM head reads, so training starts from a
    working readout instead of random projections. `fc` starts by passing on the deepest captured layer alone, so the
    copied attention first reads context close to what those layers see in the target; weights the target layer lacks
    (Qwen3's q/k norms next to a Llama target) keep their fresh values."""
    layers = decoder_layers(target)
    first = len(layers) - len(drafter.layers)
    for index, mine in enumerate(drafter.layers):
        theirs = layers[first + index]
        theirs_state, mine_state = theirs.state_dict(), mine.state_dict()
        missing = [k for k in _LAYER_WEIGHTS if k not in theirs_state or theirs_state[k].shape != mine_state[k].shape]
        if missing:
            raise ValueError(f"drafter.init_layers: target_last needs the target's last {len(drafter.layers)} layers "
                             f"to be attention layers shaped like the drafter's; layer {first + index} "
                             f"({type(theirs).__name__}) lacks {missing[0]} (set drafter.init_layers: random)")
        for name, value in mine_state.items():
            if name in theirs_state and theirs_state[name].shape == value.shape:
                value.copy_(theirs_state[name].to(value.dtype))
    hidden = drafter.config.hidden_size
    ids = drafter.config.target_layer_ids
    deepest = ids.index(max(ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden:(deepest + 1) * hidden] = torch.eye(hidden)
    norm = final_norm(target)
    if norm is not None and norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(norm.weight.to(drafter.norm.weight.dtype))


def drafter_step(drafter, target, batch: dict, P: dict, generator: torch.Generator, *,
                 compiled: bool = False) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch (call under autocast). `compiled`: the drafter is compiled for one shape, so every
    batch gets `num_anchors` blocks (disabled ones where it has fewer candidates) and should come padded to
    `max_length` (`_micro_step` does that). Anchors are drawn over `max_length` keys either way, so padding and
    compilation do not change which anchors a batch gets."""
    cfg = unwrap(drafter).config
    lengths = batch["attention_mask"].sum(1)
    label_ids = target_last = None
    if P["labels"] == "target_greedy":      # the tokens greedy verification accepts, not the sampled answer's
        features, label_ids = context_features_and_greedy(target, batch["input_ids"], batch["attention_mask"],
                                                          cfg.target_layer_ids)
    elif P["labels"] == "target_soft":      # the target's whole next-token distribution at each slot
        features, target_last = context_features_and_last(target, batch["input_ids"], batch["attention_mask"],
                                                          cfg.target_layer_ids)
    else:
        features = context_features(target, batch["input_ids"], batch["attention_mask"], cfg.target_layer_ids)
    anchors, valid = sample_anchors(batch["loss_mask"], lengths, cfg.block_size, P["num_anchors"], generator,
                                    fixed_count=compiled, key_width=P["max_length"])
    blocks = block_targets(batch["input_ids"], batch["loss_mask"], lengths, anchors, valid, cfg.block_size,
                           cfg.mask_token_id, P["loss_decay_gamma"], label_ids, target_last, P.get("loss_slots"))
    context_len = batch["input_ids"].shape[1]
    mask = build_block_mask(anchors, valid, context_len, cfg.block_size, P["attention"])
    with torch.no_grad():
        block_embeds = input_embedding(target)(blocks["block_ids"])
    context_pos = torch.arange(context_len, device=anchors.device).expand(anchors.shape[0], -1)
    positions = torch.cat([context_pos, blocks["positions"]], dim=1)
    hidden = drafter(block_embeds, features, positions, mask=mask)
    if P.get("fused_loss"):
        return fused_head_loss(hidden, output_head(target), blocks["labels"], blocks["weights"],
                               compiled=compiled, teacher_hidden=blocks.get("teacher_hidden"))
    return weighted_loss(hidden, output_head(target), blocks["labels"], blocks["weights"],
                         teacher_hidden=blocks.get("teacher_hidden"))


def trajectory_settings(run: TrainRun, P: dict, rows: list[dict], seed: int, num_examples: int,
                        processes: int = 1) -> dict:
    """What a checkpoint's weights and optimiser state depend on, as flat named settings. The process count is
    one: each rank takes its own share of the batches and draws its own anchors."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True).encode())
    return {"target": str(run.target_dir), "init_from": str(run.init_from), "seed": seed,
            "training_rows": digest.hexdigest()[:16], "examples": num_examples, "processes": processes,
            **{f"drafter.{k}": v for k, v in P.items() if k not in NEUTRAL_KEYS and k not in HORIZON_KEYS}}


@dataclass
class _Session:
    """What one process holds while it trains a run."""
    run: TrainRun
    P: dict
    seed: int
    log: Callable[[str], Any]
    accelerator: Any
    target: Any
    drafter: Any
    optimizer: Any
    scheduler: Any
    examples: list
    steps_per_epoch: int
    total_steps: int
    trajectory: dict                # {"settings", "digest"}
    ckpts: CheckpointDir
    history: JsonlLog
    generator: torch.Generator
    compiled: bool                  # the drafter is compiled: the fused loss compiles its chunks too
    horizons: list[dict] = field(default_factory=list)
    counters: dict = field(default_factory=lambda: {"step": 0, "epoch": 0, "batch": 0})

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def train_drafter(run: TrainRun, P: dict, tokenizer, *, device: str = "auto", seed: int = 0, log=print) -> Path:
    """Train one run; returns the final drafter folder (`out_dir/drafter`). Resumable."""
    s = _setup(run, P, tokenizer, resolve_device(device), seed, log)
    _restore(s, _plan(s))
    bar = tqdm(total=s.total_steps, initial=s.counters["step"], desc=f"drafter {run.name}", disable=not s.main)
    window, started = {"loss": 0.0, "accuracy": 0.0, "n": 0}, time.time()
    while s.counters["step"] < s.total_steps:
        batches = _epoch_batches(s.examples, s.P, seed, s.counters["epoch"], s.accelerator.process_index,
                                 s.accelerator.num_processes)
        for index in range(s.counters["batch"], s.steps_per_epoch * s.P["grad_accum"]):
            loss, accuracy = _micro_step(s, batches[index], index)
            window = {"loss": window["loss"] + loss, "accuracy": window["accuracy"] + accuracy, "n": window["n"] + 1}
            s.counters["batch"] = index + 1
            if not s.accelerator.sync_gradients:
                continue
            s.scheduler.step()
            s.counters["step"] += 1
            bar.update(1)
            step, last = s.counters["step"], s.counters["step"] == s.total_steps
            if step % s.P["log_every"] == 0 or last:
                _log_step(s, window, started, bar)
                window = {"loss": 0.0, "accuracy": 0.0, "n": 0}
            if step % s.P["save_every"] == 0 or last:
                _save(s)
            if last:
                break
        else:
            s.counters["epoch"] += 1
            s.counters["batch"] = 0
    bar.close()
    s.accelerator.wait_for_everyone()
    final = run.out_dir / FINAL_DIR
    if s.main:
        save_drafter(unwrap(s.drafter), final)
    return final


def _check_loss_slots(P: dict, block_size: int) -> None:
    if P.get("loss_slots") is not None and not 1 <= P["loss_slots"] < block_size:
        raise ValueError(f"drafter.loss_slots={P['loss_slots']}: give null (every slot) or 1 ... block_size - 1 "
                         f"({block_size - 1} for this drafter's blocks of {block_size})")


def _setup(run: TrainRun, P: dict, tokenizer, device: str, seed: int, log) -> _Session:
    """Target, drafter, examples, optimiser and schedule, prepared by accelerate (nothing restored yet)."""
    from accelerate import Accelerator

    if P["length_grouping"] < 0 or (P["pad_multiple"] is not None and P["pad_multiple"] < 1):
        raise ValueError(f"drafter.length_grouping={P['length_grouping']} must be >= 0 and drafter.pad_multiple="
                         f"{P['pad_multiple']} null or >= 1")
    _check_loss_slots(P, P["block_size"])   # before loading anything; again below for a warm start's own block size
    accelerator = Accelerator(cpu=device == "cpu", gradient_accumulation_steps=P["grad_accum"],
                              mixed_precision="bf16" if P["precision"] == "bf16" else "no")
    torch.manual_seed(seed)
    target = load_target(run.target_dir, str(accelerator.device), P["precision"])
    drafter = new_drafter(P, target, tokenizer, run.init_from)
    _check_loss_slots(P, drafter.block_size)
    used_rows = run.rows[:P["max_conversations"]] if P["max_conversations"] else run.rows
    examples = build_examples(used_rows, tokenizer, P["max_length"], 2 * drafter.block_size, where=run.name)
    rank, world = accelerator.process_index, accelerator.num_processes
    steps_per_epoch, total_steps = _schedule_length(run.name, P, len(examples), seed, rank, world)
    settings = trajectory_settings(run, P, used_rows, seed, len(examples), world)

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=P["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(total_steps, max(1, int(P["warmup_ratio"] * total_steps))))
    compiled = wants_compile(P["compile"], str(accelerator.device))
    if compiled:
        # in place (nn.Module.compile): state_dict keys and checkpoints stay those of the plain module. Fixed
        # shapes (num_anchors blocks per sequence; batches padded to max_length, or to a multiple of pad_multiple):
        # one graph per width, compiled once per process; with dynamic shapes inductor failed on this model
        # (docs/gpu.md)
        widths = -(-P["max_length"] // P["pad_multiple"]) if P["pad_multiple"] else 1
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, widths + 2)
        drafter.compile(dynamic=False)
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    accelerator.register_for_checkpointing(scheduler)   # stepped per optimiser step, whatever the process count
    drafter.train()
    log(f"[{run.name}] {len(examples)} conversations, {steps_per_epoch} optimiser steps/epoch, "
        f"{total_steps} steps, {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M trainable parameters, "
        f"device {accelerator.device}, world {world}")
    session = _Session(run=run, P=P, seed=seed, log=log, accelerator=accelerator, target=target, drafter=drafter,
                       optimizer=optimizer, scheduler=scheduler, examples=examples, steps_per_epoch=steps_per_epoch,
                       total_steps=total_steps, trajectory={"settings": settings, "digest": params_digest(settings)},
                       ckpts=_checkpoints(run.out_dir), history=JsonlLog(run.out_dir / HISTORY),
                       generator=torch.Generator().manual_seed(seed + rank), compiled=compiled)
    if compiled:
        _compile_or_fall_back(session)
    return session


def _compile_or_fall_back(s: _Session) -> None:
    """Compilation happens at the first call: make it now, on one forward and backward of the first examples
    (gradients dropped, no optimiser step, the anchor generator untouched), and train eagerly, with a warning, if
    this torch cannot compile the drafter. Other errors (out of memory, bad data) are raised as they are."""
    started = time.time()
    batch = collate(s.examples[:s.P["batch_size"]], s.accelerator.device, pad_to=s.P["max_length"])
    try:
        with s.accelerator.autocast():
            loss, _ = drafter_step(s.drafter, s.target, batch, s.P, torch.Generator().manual_seed(s.seed),
                                   compiled=True)
        loss.backward()
        s.log(f"[{s.run.name}] drafter compiled in {time.time() - started:.0f} s (one shape: "
              f"{s.P['batch_size']} x {s.P['max_length']} tokens, {s.P['num_anchors']} blocks per sequence)")
    except Exception as error:
        if not is_compile_error(error):
            raise
        unwrap(s.drafter)._compiled_call_impl = None      # what nn.Module.compile set: back to the eager call
        s.compiled = False
        s.log(f"[{s.run.name}] WARNING drafter.compile: this torch could not compile the drafter "
              f"({type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}); "
              "training eagerly")
    finally:
        s.optimizer.zero_grad(set_to_none=True)


def is_compile_error(error: BaseException) -> bool:
    """An error of torch's compiler stack (dynamo, inductor), as opposed to one of the model or the data."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))


def _schedule_length(name: str, P: dict, num_examples: int, seed: int, rank: int, world: int) -> tuple[int, int]:
    """(optimiser steps per epoch, total steps: the schedule's horizon)."""
    batches_per_epoch = len(epoch_batches(num_examples, P["batch_size"], seed, 0, rank, world))   # grouping keeps the count
    if batches_per_epoch < P["grad_accum"]:
        raise ValueError(f"[{name}] {num_examples} usable conversations give {batches_per_epoch} batches per "
                         f"epoch per device, fewer than drafter.grad_accum={P['grad_accum']}: add data or lower "
                         "drafter.batch_size / grad_accum")
    steps_per_epoch = batches_per_epoch // P["grad_accum"]
    total_steps = P["epochs"] * steps_per_epoch
    return steps_per_epoch, min(total_steps, P["max_steps"]) if P["max_steps"] else total_steps


def _plan(s: _Session) -> ResumePlan:
    """What to continue from; the main process moves aside what the run gives up (every process plans first)."""
    out = s.run.out_dir
    if any((out / CHECKPOINTS_DIR).glob(LEGACY_CHECKPOINTS)) or (out / LEGACY_HISTORY).exists():
        plan = ResumePlan(horizons=[{"from_step": 0, "total_steps": s.total_steps}],
                          afresh="its checkpoints are in the format of an earlier version, which is not resumed")
    else:
        plan = plan_resume(s.ckpts, s.trajectory, s.total_steps, s.P["resume"], "drafter.resume")
    s.accelerator.wait_for_everyone()
    if s.main:
        _set_aside(s, plan)
    s.accelerator.wait_for_everyone()
    return plan


def _set_aside(s: _Session, plan: ResumePlan) -> None:
    """Move what the plan gives up (never delete it): the whole run's training state, or later checkpoints."""
    out, stamp = s.run.out_dir, time.strftime("%Y%m%d-%H%M%S")
    if plan.afresh:
        moved = [m.name for name in (CHECKPOINTS_DIR, FINAL_DIR, HISTORY, LEGACY_HISTORY)
                 if (m := io.move_aside(out / name, stamp)) is not None]
        if moved:
            s.log(f"[{s.run.name}] {out}: {plan.afresh}; moved aside {', '.join(moved)} "
                  "(delete them once no longer needed); starting afresh")
    elif plan.later:
        dest, later = s.ckpts.move_after(plan.step, stamp)
        s.log(f"[{s.run.name}] continuing from step-{plan.step}: the later checkpoints "
              f"{', '.join(f'step-{n}' for n in later)} moved aside to {dest.name}")


def _restore(s: _Session, plan: ResumePlan) -> None:
    """Continue from the planned checkpoint (weights, optimiser, schedule, RNG, counters), or start an empty history."""
    s.horizons = plan.horizons
    if plan.step is None:
        if s.main:
            s.history.reset()
        return
    s.ckpts.load(s.accelerator, plan.step)
    s.counters = dict(plan.meta["counters"])
    if s.main:
        s.history.truncate(plan.step)
    s.log(f"[{s.run.name}] resuming from step-{plan.step}")
    if plan.old_horizon is not None:
        apply_schedule(s.scheduler)
        s.log(f"[{s.run.name}] the schedule length changed from {plan.old_horizon} to {s.total_steps} steps "
              f"(drafter.epochs / max_steps): from step {plan.step} on, the learning rate follows the new "
              f"schedule ({s.scheduler.get_last_lr()[0]:.3g} now); the steps before followed the old one "
              "(drafter.resume=false gives a run with one schedule)")


def _epoch_batches(examples: list, P: dict, seed: int, epoch: int, rank: int, world: int) -> list[list[int]]:
    return epoch_batches(len(examples), P["batch_size"], seed, epoch, rank, world,
                         lengths=[len(e.input_ids) for e in examples], length_grouping=P["length_grouping"])


def _micro_step(s: _Session, rows: list[int], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one micro-batch; the optimiser steps once the accumulation is complete.
    Returns (loss, accuracy) as device scalars (accuracy 0.0 where the batch scored nothing)."""
    examples = [s.examples[i] for i in rows]
    # a compiled drafter takes a few fixed widths (one graph each); eager takes the batch as it is
    pad_to = (padded_width(max(len(e.input_ids) for e in examples), s.P["pad_multiple"], s.P["max_length"])
              if s.compiled else None)
    batch = collate(examples, s.accelerator.device, pad_to=pad_to)
    # anchors depend only on (seed, rank, epoch, batch): a resumed or re-launched run draws the same ones
    s.generator.manual_seed(s.seed + 1_000_003 * s.accelerator.process_index + 7_919 * s.counters["epoch"] + index)
    with s.accelerator.accumulate(s.drafter), s.accelerator.autocast():
        loss, stats = drafter_step(s.drafter, s.target, batch, s.P, s.generator, compiled=s.compiled)
        s.accelerator.backward(loss)
        if s.accelerator.sync_gradients:
            s.accelerator.clip_grad_norm_(s.drafter.parameters(), s.P["max_grad_norm"])
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
    # device scalars, read only when a history row is written: a read every step would keep the CPU from
    # preparing the next batch while the GPU still runs this one's backward
    return loss.detach(), stats["accuracy"].detach().nan_to_num(0.0)


def _log_step(s: _Session, window: dict, started: float, bar) -> None:
    """One history row: this process's mean loss and accuracy since the last row (rank 0 writes it)."""
    entry = {"step": s.counters["step"], "epoch": s.counters["epoch"], "lr": s.scheduler.get_last_lr()[0],
             "loss": float(window["loss"]) / window["n"], "accuracy": float(window["accuracy"]) / window["n"],
             "seconds": round(time.time() - started, 1)}
    if s.main:
        s.history.append(entry)
    bar.set_postfix(loss=f"{entry['loss']:.3f}", acc=f"{entry['accuracy']:.3f}")


def _save(s: _Session) -> None:
    """A checkpoint with a loadable drafter; older ones keep only that drafter (tau is measured on each)."""
    s.ckpts.save(s.accelerator, s.counters["step"],
                 {"trajectory": s.trajectory, "horizons": s.horizons, "counters": dict(s.counters)},
                 lambda path: save_drafter(unwrap(s.drafter), path),
                 keep_last=s.P["keep_last_ckpts"], keep_exports=True, expected_bytes=estimated_bytes(unwrap(s.drafter)))


def _checkpoints(out_dir: Path) -> CheckpointDir:
    return CheckpointDir(Path(out_dir) / CHECKPOINTS_DIR, export=FINAL_DIR)


def checkpoint_steps(out_dir: Path) -> list[tuple[int, Path]]:
    """(optimiser step, loadable drafter folder) of every saved checkpoint of a run, oldest first."""
    ckpts = _checkpoints(out_dir)
    return [(step, ckpts.export_folder(step)) for step in ckpts.steps()]


def checkpoint_meta(out_dir: Path, step: int) -> dict:
    """meta.json of a run's checkpoint: step, counters, and the trajectory settings (processes among them)."""
    return _checkpoints(out_dir).meta(step)


def read_history(out_dir: Path) -> list[dict]:
    return JsonlLog(Path(out_dir) / HISTORY).read()
