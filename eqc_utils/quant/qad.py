"""Quantisation-aware distillation of the INT4 target (docs/recipe.md §2.3-2.7), top to bottom:

    prepare_qad   teacher JSONL -> packed chunks; the INT4 init pack (AWQ PTQ, or a published pack)
    train_qad     student on the pinned grid + start gate + AdamW/cosine loop with held-out KL and
                  top-1 agreement, checkpoints and resume; the same function in one CPU process or
                  under `accelerate launch` (DeepSpeed ZeRO-2) on N GPUs
    run_qad       what the notebook calls: train_qad in-process, or as an `accelerate launch`
                  subprocess whose log is streamed

Files under the stage folder: inputs.json (the settings each artifact was made with), data/{train,val}.pt,
ptq_ct/ (the PTQ baseline), gate.json, train_log.jsonl, eval_log.jsonl, ckpts/step-N/{state/,student/,
meta.json}, qad_student/ (final latent weights + grid_amax.safetensors), summary.json. Artifacts that no
longer match the settings are never deleted: they are renamed `<name>.stale-<YYYYmmdd-HHMMSS>` (see LAYERS).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from eqc_utils.devices import resolve_device, wants_compile
from eqc_utils.io import atomic_path, describe_changes, move_aside, read_json, stale_name, write_json
from eqc_utils.quant import grid
from eqc_utils.quant.kl import chunked_forward_kl, check_same_vocab
from eqc_utils.quant.packing import build_packs
from eqc_utils.training import apply_schedule, warmup_cosine
from eqc_utils.quant.ptq import awq_pack, dense_ptq_model, load_causal_lm, resolve_pack, student_from_pack

STAGE = "03_qad_target"
GRID_FILE = "grid_amax.safetensors"


class QADError(RuntimeError):
    """QAD cannot start or continue as configured."""


# ---------------------------------------------------------------- preparation (one process)

# Each expensive artifact depends on some settings only; a change moves aside (never deletes) that artifact
# and everything built on it, and names the settings that changed:
#   data        data/ (packed chunks): the teacher rows and path, assets.tokenizer and DATA_KEYS
#   init        ptq_ct/ (the AWQ INT4 init): the data (AWQ calibrates on it) and the quant settings of the grid
#   trajectory  ckpts/, qad_student/, logs, gate.json, summary.json: data, init, seed and every qad key that
#               is neither a data key nor in NEUTRAL_KEYS (so a key added to the schema later counts here)
# qad.max_steps is the cosine schedule's horizon: changing it keeps the checkpoints (see `train_qad`).
LAYERS = ("data", "init", "trajectory")
LAYER_ARTIFACTS = {"data": ("data",), "init": ("ptq_ct",),
                   "trajectory": ("ckpts", "qad_student", "gate.json", "train_log.jsonl", "eval_log.jsonl",
                                  "summary.json")}
INPUTS_FILE = "inputs.json"
LEGACY_MARKER = "inputs.digest"        # one digest over everything, written by earlier versions
DATA_KEYS = ("max_rows", "max_seq_len", "val_ratio", "shuffle_seed", "mask_prompt")
# Logging, evaluation, saving and launching; and settings that change how the same math is computed
# (precision, activation checkpointing, KL chunking), whose checkpoints remain valid starting points.
# DeepSpeed/non-DeepSpeed and the process count under DeepSpeed change the checkpoint *format*: a resume
# across them fails with a clear error instead of discarding anything.
NEUTRAL_KEYS = frozenset({"launcher", "num_processes", "deepspeed", "log_every", "save_every", "eval_every",
                          "eval_chunks", "keep_last_ckpts", "resume", "gate_chunks", "gate_seq_len",
                          "inject_kl_tolerance", "mixed_precision", "grad_checkpointing", "kl_chunk_tokens",
                          "compile"})
HORIZON_KEY = "max_steps"


def prepare_qad(params: dict, stage_dir: Path, teacher_rows: list[dict], teacher_path: Path, tokenizer,
                log=print) -> dict:
    """Pack the teacher data and make (or locate) the INT4 init pack. Idempotent for the same inputs. When an
    input changed, the artifacts that depend on it are moved aside (`<name>.stale-<time>`, see LAYERS) and the
    changed settings are logged, so a re-run never resumes from artifacts made with other inputs."""
    qad = params["qad"]
    rows_digest = _rows_digest(teacher_rows)
    layers = input_layers(params, rows_digest, teacher_path)
    stage_dir.mkdir(parents=True, exist_ok=True)
    _move_stale(stage_dir, layers, _legacy_digest(params, rows_digest, teacher_path), log)
    data_dir = stage_dir / "data"
    if not (data_dir / "meta.json").exists():
        rows = teacher_rows[: qad["max_rows"]] if qad["max_rows"] else teacher_rows
        packs = build_packs(rows, tokenizer, qad["max_seq_len"], qad["val_ratio"], qad["shuffle_seed"],
                            qad["mask_prompt"])
        with atomic_path(data_dir) as tmp:
            tmp.mkdir()
            for split in ("train", "val"):
                torch.save(packs[split], tmp / f"{split}.pt")
            write_json(tmp / "meta.json", packs["meta"])
    meta = read_json(data_dir / "meta.json")
    return {"data": meta, "init_pack": str(init_pack_dir(params, stage_dir, teacher_path))}


def _digest(settings) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _rows_digest(rows: list[dict]) -> str:
    return _digest(rows)


def input_layers(params: dict, rows_digest: str, teacher_path: Path) -> dict:
    """{layer: {"digest", "settings"}} for LAYERS; `settings` are flat dotted keys (so changes can be named)."""
    qad, quant = params["qad"], params["quant"]
    # packing_format: bumped when packing.py changes how rows become chunks or weights, so that data packed by
    # an older version is moved aside rather than reused (2: prompt and answer tokenised apart, next-token weights)
    data = {"packing_format": 2, "teacher_rows": rows_digest[:16], "teacher": str(teacher_path),
            "assets.tokenizer": params["assets"]["tokenizer"], **{f"qad.{k}": qad[k] for k in DATA_KEYS}}
    data_digest = _digest(data)
    if quant["init"] == "ct_pack":   # a published pack: neither the data nor AWQ settings matter
        init = {f"quant.{k}": quant[k] for k in ("init", "init_pack", "group_size", "skip_patterns")}
    else:
        init = {"data": data_digest[:16], **{f"quant.{k}": v for k, v in quant.items() if k != "min_quantized_modules"},
                "pack.scale_dtype": params["pack"]["scale_dtype"]}
    init_digest = _digest(init)
    return {"data": {"digest": data_digest, "settings": data},
            "init": {"digest": init_digest, "settings": init},
            "trajectory": trajectory_layer(params, data_digest, init_digest)}


def trajectory_layer(params: dict, data_digest: str | None, init_digest: str | None) -> dict:
    qad = params["qad"]
    settings = {"data": (data_digest or "")[:16], "init": (init_digest or "")[:16], "seed": params["seed"],
                **{f"qad.{k}": v for k, v in qad.items()
                   if k not in DATA_KEYS and k not in NEUTRAL_KEYS and k != HORIZON_KEY}}
    return {"digest": _digest(settings), "settings": settings}


def _legacy_digest(params: dict, rows_digest: str, teacher_path: Path) -> str:
    """The single digest earlier versions stored in `inputs.digest`."""
    return _digest({"rows": rows_digest, "teacher": str(teacher_path), "quant": params["quant"],
                    "qad": {k: v for k, v in params["qad"].items() if k != "resume"}})


def _move_stale(stage_dir: Path, layers: dict, legacy_digest: str, log) -> None:
    """Compare with the settings saved by the previous run; move aside the artifacts of the first changed
    layer and of all layers after it; save the current settings."""
    saved_path, legacy = stage_dir / INPUTS_FILE, stage_dir / LEGACY_MARKER
    saved = read_json(saved_path) if saved_path.exists() else None
    if saved is None and legacy.exists():
        # an older version's marker: same digest = same inputs (adopt); else changed, but not which keys
        saved = layers if legacy.read_text().strip() == legacy_digest else {}
    if saved is not None:
        for i, layer in enumerate(LAYERS):
            before = saved.get(layer)
            if before is not None and before.get("digest") == layers[layer]["digest"]:
                continue
            changes = describe_changes(before.get("settings") if before else None, layers[layer]["settings"])
            stamp = time.strftime("%Y%m%d-%H%M%S")
            moved = [str(m.name) for name in LAYERS[i:] for artifact in LAYER_ARTIFACTS[name]
                     if (m := move_aside(stage_dir / artifact, stamp)) is not None]
            if moved:
                log(f"QAD {layer} settings changed ({changes}): moved aside {', '.join(moved)} in {stage_dir} "
                    f"(delete them once they are no longer needed)")
            break
    write_json(saved_path, layers)
    legacy.unlink(missing_ok=True)


def init_pack_dir(params: dict, stage_dir: Path, teacher_path: Path) -> Path:
    """The compressed-tensors pack holding the INT4 init grid (made by AWQ when quant.init = awq)."""
    quant = params["quant"]
    if quant["init"] == "ct_pack":
        if not quant["init_pack"]:
            raise QADError("quant.init = ct_pack needs quant.init_pack (a folder or HF id of an INT4 pack)")
        return resolve_pack(quant["init_pack"], params["assets"]["hub_allowed"])
    out = stage_dir / "ptq_ct"
    if not (out / "config.json").exists():
        train = torch.load(stage_dir / "data" / "train.pt")
        calib = _calibration_ids(train["input_ids"], quant["calib_samples"], quant["calib_seq_len"])
        awq_pack(teacher_path, calib, quant, params["pack"], out, device=resolve_device(params["device"]))
    return out


def _calibration_ids(chunks: torch.Tensor, samples: int, seq_len: int) -> torch.Tensor:
    flat = chunks.reshape(-1)
    usable = min(samples, flat.numel() // seq_len)
    if usable < 1:
        raise QADError(f"not enough teacher tokens for one AWQ calibration sequence of quant.calib_seq_len={seq_len}")
    return flat[: usable * seq_len].reshape(usable, seq_len)


# ---------------------------------------------------------------- model pieces

class Distillee(nn.Module):
    """The student as one module for accelerate: forward returns final hidden states; the output
    layer is applied chunk by chunk by the loss (so full logits never exist)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state

    @property
    def head(self) -> nn.Module:
        return self.lm.get_output_embeddings()


def teacher_hidden(teacher: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return teacher.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state


@torch.no_grad()
def mean_kl(model_hidden, teacher: nn.Module, head: nn.Module, ids: torch.Tensor, weights: torch.Tensor,
            qad: dict) -> dict:
    """Weighted held-out KL and top-1 agreement of a model against the teacher, chunk by chunk."""
    kl_sum = agree_sum = total = 0.0
    for row in range(ids.shape[0]):
        x, w = ids[row: row + 1], weights[row: row + 1]
        kl, agree, n = chunked_forward_kl(model_hidden(x), teacher_hidden(teacher, x), w, head,
                                          teacher.get_output_embeddings(), qad["kl_temperature"],
                                          qad["kl_chunk_tokens"], with_agreement=True)
        kl_sum += float(kl) * float(n)
        agree_sum += float(agree) * float(n)
        total += float(n)
    return {"kl": kl_sum / max(total, 1.0), "top1": agree_sum / max(total, 1.0), "tokens": total}


def _hidden_fn(lm: nn.Module):
    return lambda x: lm.get_decoder()(input_ids=x, use_cache=False).last_hidden_state


def start_gate(student: nn.Module, teacher: nn.Module, ptq_model: nn.Module, train: dict, qad: dict) -> dict:
    """Step-0 KL of the pinned student must equal the deployed PTQ model's (within the tolerance)."""
    n, length = qad["gate_chunks"], qad["gate_seq_len"]
    ids, weights = train["input_ids"][:n, :length], train["weights"][:n, :length]
    device = next(student.parameters()).device
    ids, weights = ids.to(device), weights.to(device)
    ptq = mean_kl(_hidden_fn(ptq_model), teacher, ptq_model.get_output_embeddings(), ids, weights, qad)
    pinned = mean_kl(_hidden_fn(student), teacher, student.get_output_embeddings(), ids, weights, qad)
    gap = abs(pinned["kl"] - ptq["kl"])
    result = {"ptq_kl": ptq["kl"], "pinned_kl": pinned["kl"], "gap": gap, "tolerance": qad["inject_kl_tolerance"],
              "chunks": int(ids.shape[0]), "tokens": pinned["tokens"]}
    if gap > qad["inject_kl_tolerance"]:
        raise QADError(f"start gate failed: step-0 KL of the pinned student {pinned['kl']:.5f} differs from the "
                       f"PTQ model's {ptq['kl']:.5f} by {gap:.5f} > qad.inject_kl_tolerance; the grid is not pinned")
    return result


def make_optimizer(params_iter, qad: dict):
    kwargs = dict(lr=qad["lr"], betas=tuple(qad["betas"]), eps=qad["eps"], weight_decay=qad["weight_decay"])
    if qad["optimizer"] == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise QADError("qad.optimizer = adamw_8bit needs bitsandbytes (GPU only); use adamw on CPU") from err
        return bnb.optim.AdamW8bit(params_iter, **kwargs)
    return torch.optim.AdamW(params_iter, **kwargs)


def mixed_precision(params: dict) -> str:
    choice = params["qad"]["mixed_precision"]
    if choice != "auto":
        return choice
    return "bf16" if params["device"] != "cpu" and torch.cuda.is_available() else "no"


# ---------------------------------------------------------------- checkpoints

def checkpoint_steps(ckpt_root: Path) -> list[int]:
    """Steps of complete checkpoints (meta.json is written last)."""
    if not ckpt_root.exists():
        return []
    return sorted(int(m.group(1)) for p in ckpt_root.glob("step-*")
                  if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / "meta.json").exists())


def export_student(lm: nn.Module, out: Path, sidecars_from: Path) -> None:
    """Latent weights as a plain HF folder + the pinned grid (`grid_amax.safetensors`)."""
    from safetensors.torch import save_file

    from eqc_utils.quant.pack_ct import copy_sidecars
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        copy_sidecars(sidecars_from, tmp)
        weights = {name: p.detach().cpu().contiguous() for name, p in lm.named_parameters()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        save_file({k: v.contiguous() for k, v in grid.grid_amax(lm).items()}, str(tmp / GRID_FILE))
        config = lm.config.to_dict()
        config.pop("quantization_config", None)  # e.g. a GGUF-converted teacher's: the latent weights are plain
        write_json(tmp / "config.json", config)


def load_student_export(folder: Path, quant: dict, dtype=torch.float32) -> nn.Module:
    """A QAD checkpoint's student with its quantisers restored to the saved grid (for packing)."""
    from safetensors.torch import load_file
    folder = Path(folder)
    if not (folder / GRID_FILE).exists():
        raise QADError(f"{folder}: no {GRID_FILE}; is this a QAD checkpoint's student/ folder?")
    lm = load_causal_lm(folder, dtype)
    grid.attach_int4_quantizers(lm, quant)
    grid.restore_amax(lm, load_file(str(folder / GRID_FILE)))
    return lm


def find_checkpoint(stage_dir: Path, step: int | None) -> Path:
    """`qad_student/` (step None) or ckpts/step-N/student, with a clear error when absent."""
    if step is None:
        folder = stage_dir / "qad_student"
    else:
        folder = stage_dir / "ckpts" / f"step-{step}" / "student"
    if not (folder / GRID_FILE).exists():
        have = checkpoint_steps(stage_dir / "ckpts")
        raise QADError(f"no QAD checkpoint {folder} (pack.checkpoint_step = {step}); available steps: "
                       f"{have or 'none'}; run stage 03 (or pick one of those steps)")
    return folder


def check_grid_pinned(lm: nn.Module, reference: dict[str, torch.Tensor], when: str) -> None:
    """QADError unless every quantiser's `_amax` is still the fp32 tensor of `reference` (`grid_amax` taken
    when the grid was pinned), naming the modules whose grid moved."""
    modules = grid.quantized_modules(lm)
    moved, dtypes = [], set()
    for name, module in modules.items():
        amax = module.weight_quantizer._amax
        if name not in reference or amax.dtype != torch.float32 or \
                not torch.equal(amax.detach().cpu(), reference[name]):
            moved.append(name)
            dtypes.add(str(amax.dtype).replace("torch.", ""))
    moved += sorted(set(reference) - set(modules))
    if moved:
        shown = ", ".join(moved[:6]) + (f" and {len(moved) - 6} more" if len(moved) > 6 else "")
        raise QADError(f"the pinned INT4 grid moved {when}: _amax is no longer the fp32 7 x scale of the init in "
                       f"{len(moved)} of {len(modules)} quantised modules ({shown}; _amax dtype now "
                       f"{'/'.join(sorted(dtypes)) or 'absent'}). A cast of the model's buffers (e.g. DeepSpeed's "
                       f"bf16 mode, which casts every floating-point buffer) rounds the grid; keep _amax in fp32")


def _current_trajectory(params: dict, stage_dir: Path) -> dict:
    """The trajectory layer of the current settings, with the data/init digests prepare_qad recorded."""
    inputs = read_json(stage_dir / INPUTS_FILE) if (stage_dir / INPUTS_FILE).exists() else {}
    return trajectory_layer(params, inputs.get("data", {}).get("digest"), inputs.get("init", {}).get("digest"))


def _resume_point(ckpt_root: Path, qad: dict, trajectory: dict, deepspeed: bool, world: int):
    """(step, meta.json) of the checkpoint to resume from, or (None, None) for a fresh start: the newest
    checkpoint at or before qad.max_steps. Checkpoints of other settings were moved aside by prepare_qad;
    meeting one here (train_qad run without it) or one in another checkpoint format is an error."""
    usable = [s for s in checkpoint_steps(ckpt_root) if s <= qad["max_steps"]]
    if not qad["resume"] or not usable:
        return None, None
    step = usable[-1]
    folder = ckpt_root / f"step-{step}"
    meta = read_json(folder / "meta.json")
    saved = meta.get("trajectory")   # absent in checkpoints of earlier versions
    if saved is not None and saved["digest"] != trajectory["digest"]:
        changes = describe_changes(saved["settings"], trajectory["settings"])
        raise QADError(f"{folder} was made with other settings ({changes}); run prepare_qad first (it moves "
                       "such checkpoints aside) or set qad.resume=false")
    saved_ds = meta.get("deepspeed", deepspeed)
    if saved_ds != deepspeed or (deepspeed and meta.get("processes", world) != world):
        raise QADError(f"{folder} was saved {'with' if saved_ds else 'without'} DeepSpeed on "
                       f"{meta.get('processes')} process(es); this run is {'with' if deepspeed else 'without'} "
                       f"DeepSpeed on {world}: launch it as before (qad.launcher, qad.deepspeed, qad.num_processes), "
                       "or set qad.resume=false to start afresh (the checkpoints are then moved aside)")
    return step, meta


def _horizons(meta: dict | None, resume_from: int | None, max_steps: int) -> tuple[list[dict], int | None]:
    """The schedule horizons of the run so far ([{from_step, max_steps}, ...]) and the previous max_steps
    when this run changes it (else None).

    The cosine schedule spans qad.max_steps, so extending (or shortening) a run changes the schedule. The
    checkpoints stay valid starting points, so the run resumes from the newest one at or before max_steps and
    the learning rate follows the new schedule from there; the steps before followed the old one. Each
    checkpoint's meta.json and summary.json record these horizons; qad.resume=false gives one schedule."""
    fresh = [{"from_step": 0, "max_steps": max_steps}]
    if meta is None:
        return fresh, None
    before = meta.get("horizons") or fresh        # checkpoints of earlier versions: not recorded
    if before[-1]["max_steps"] == max_steps:
        return before, None
    return before + [{"from_step": resume_from, "max_steps": max_steps}], before[-1]["max_steps"]


def _move_later_checkpoints(stage_dir: Path, after: int, why: str) -> None:
    """Checkpoints after the step this run starts from belong to a run it does not continue: move them
    (with copies of the logs) into `ckpts.stale-<time>/`."""
    ckpt_root = stage_dir / "ckpts"
    later = [s for s in checkpoint_steps(ckpt_root) if s > after]
    if not later:
        return
    dest = stale_name(ckpt_root)
    dest.mkdir()
    for step in later:
        os.replace(ckpt_root / f"step-{step}", dest / f"step-{step}")
    for name in ("train_log.jsonl", "eval_log.jsonl", "summary.json", "gate.json"):
        if (stage_dir / name).exists():
            shutil.copy2(stage_dir / name, dest / name)
    print(f"QAD: {why}: checkpoints {later} moved aside to {dest} (delete it once no longer needed)", flush=True)


# ---------------------------------------------------------------- the training function

def train_qad(params: dict, stage_dir: Path, teacher_path: Path, stop_after: int | None = None) -> dict:
    """The QAD run. Every process of an `accelerate launch` runs this same function."""
    from accelerate import Accelerator, DistributedType
    from tqdm.auto import tqdm

    qad, quant = params["qad"], params["quant"]
    # -- distribution: effective batch = micro x grad_accum_steps sequences, whatever the process count
    accelerator = Accelerator(mixed_precision=mixed_precision(params), cpu=params["device"] == "cpu",
                              gradient_accumulation_steps=_per_process_accum(qad, int(os.environ.get("WORLD_SIZE", 1))))
    world, rank = accelerator.num_processes, accelerator.process_index
    accum = accelerator.gradient_accumulation_steps
    device = accelerator.device
    main = accelerator.is_main_process
    if main:
        print(f"QAD: {world} process(es) on {device}, {accum} accumulation step(s) per process", flush=True)
    torch.manual_seed(params["seed"])

    # -- data
    train = torch.load(stage_dir / "data" / "train.pt")
    val = torch.load(stage_dir / "data" / "val.pt")
    eval_n = val["input_ids"].shape[0] if qad["eval_chunks"] is None else min(qad["eval_chunks"], val["input_ids"].shape[0])

    # -- models: the frozen teacher, and the student pinned to the init grid
    pack_dir = init_pack_dir(params, stage_dir, teacher_path)
    teacher = load_causal_lm(teacher_path).to(device).eval().requires_grad_(False)
    lm, _ = student_from_pack(teacher_path, pack_dir, quant)
    check_same_vocab(lm.get_output_embeddings(), teacher.get_output_embeddings())
    lm.to(device)
    ckpt_root = stage_dir / "ckpts"
    ds = accelerator.distributed_type == DistributedType.DEEPSPEED
    trajectory = _current_trajectory(params, stage_dir)
    resume_from, meta = _resume_point(ckpt_root, qad, trajectory, ds, world)
    horizons, old_max_steps = _horizons(meta, resume_from, qad["max_steps"])
    accelerator.wait_for_everyone()   # every process has chosen before anything is moved
    if main:
        _move_later_checkpoints(stage_dir, resume_from or 0,
                                "qad.resume is false" if not qad["resume"] else
                                f"resuming from step {resume_from} (qad.max_steps = {qad['max_steps']})"
                                if resume_from else f"no checkpoint at or before qad.max_steps = {qad['max_steps']}")
    accelerator.wait_for_everyone()

    # -- start gate (fresh runs): the pinned student is the PTQ model
    if resume_from is None:
        ptq_model = dense_ptq_model(teacher_path, pack_dir, quant).to(device)
        gate = start_gate(lm, teacher, ptq_model, train, qad)
        del ptq_model
        if main:
            write_json(stage_dir / "gate.json", gate)
            _reset_logs(stage_dir)
    if qad["grad_checkpointing"]:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if wants_compile(qad["compile"], str(device)):
        lm.get_decoder().compile()   # in place: parameter names, checkpoints and exports are unchanged
    init_amax = grid.grid_amax(lm)

    # -- optimiser: every student parameter (as the reference: no freezing); the grid is buffers
    student = Distillee(lm)
    optimizer = make_optimizer(student.parameters(), qad)
    warmup = math.ceil(qad["warmup_ratio"] * qad["max_steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(qad["max_steps"], warmup, from_zero=True))
    # the scheduler stays unprepared: it counts optimiser steps, whatever the process count
    student, optimizer = accelerator.prepare(student, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    inner = accelerator.unwrap_model(student)
    # DeepSpeed's bf16 mode (and any other cast of the whole module) also casts buffers: the grid must
    # still be the fp32 7 x scale it was pinned to before a single step is taken
    check_grid_pinned(inner.lm, init_amax, "by accelerator.prepare")

    start = 0
    if resume_from is not None:
        accelerator.load_state(str(ckpt_root / f"step-{resume_from}" / "state"))
        start = resume_from
        if old_max_steps is not None:
            apply_schedule(scheduler)
            if main:
                print(f"QAD: qad.max_steps changed from {old_max_steps} to {qad['max_steps']}: from step "
                      f"{resume_from} on, the learning rate follows the cosine schedule over {qad['max_steps']} "
                      f"steps ({scheduler.get_last_lr()[0]:.3g} now); the steps before followed the old one "
                      "(qad.resume=false gives a run with one schedule)", flush=True)
        if main:
            print(f"QAD: resuming from step {resume_from}", flush=True)
            _truncate_logs(stage_dir, start)
        if meta.get("eval_chunks", qad["eval_chunks"]) != qad["eval_chunks"] and main:
            print(f"QAD: qad.eval_chunks changed from {meta['eval_chunks']} to {qad['eval_chunks']}: held-out "
                  f"evaluations up to step {resume_from} used other chunks", flush=True)

    def evaluate(step: int) -> None:
        student.eval()
        mine = slice(rank, eval_n, world)
        # the unwrapped model: ranks may hold different numbers of held-out chunks, and every forward of the
        # DDP wrapper is a collective (buffer broadcast) that would then wait forever
        stats = mean_kl(inner, teacher, inner.head, val["input_ids"][mine].to(device),
                        val["weights"][mine].to(device), qad)
        sums = torch.tensor([stats["kl"] * stats["tokens"], stats["top1"] * stats["tokens"], stats["tokens"]],
                            device=device)
        sums = accelerator.reduce(sums, reduction="sum")
        if main:
            tokens = max(float(sums[2]), 1.0)
            _append(stage_dir / "eval_log.jsonl", {"step": step, "kl": float(sums[0]) / tokens,
                                                   "top1": float(sums[1]) / tokens, "tokens": tokens})
        student.train()

    if start == 0:
        evaluate(0)   # step 0 = the PTQ baseline on the held-out chunks

    # -- the loop
    n_train = train["input_ids"].shape[0]
    per_step = qad["micro_batch_size"] * accum * world
    last = qad["max_steps"] if stop_after is None else min(stop_after, qad["max_steps"])
    bar = tqdm(range(start, last), desc="QAD", disable=not main, initial=start, total=qad["max_steps"])
    student.train()
    started = time.time()
    grad_norm = None
    for step in bar:
        step_loss = 0.0
        for micro in range(accum):
            ids, weights = _micro_batch(train, n_train, step * per_step + (micro * world + rank) * qad["micro_batch_size"],
                                        qad["micro_batch_size"], params["seed"])
            ids, weights = ids.to(device), weights.to(device)
            with accelerator.accumulate(student):
                with accelerator.autocast():
                    loss = chunked_forward_kl(student(ids), teacher_hidden(teacher, ids), weights, inner.head,
                                              teacher.get_output_embeddings(), qad["kl_temperature"],
                                              qad["kl_chunk_tokens"])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(student.parameters(), qad["grad_clip"])
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            step_loss += float(loss.detach()) / accum
        done = step + 1
        if main and (done % qad["log_every"] == 0 or done == last):
            _append(stage_dir / "train_log.jsonl", {"step": done, "loss": step_loss, "lr": scheduler.get_last_lr()[0],
                                                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                                                    "seconds": round(time.time() - started, 2)})
            bar.set_postfix(loss=f"{step_loss:.4f}")
        if done % qad["eval_every"] == 0 or done == qad["max_steps"]:
            evaluate(done)
        if done % qad["save_every"] == 0 or done == qad["max_steps"]:
            _save_checkpoint(accelerator, inner.lm, ckpt_root, done, teacher_path, qad["keep_last_ckpts"],
                             {"trajectory": trajectory, "horizons": horizons, "deepspeed": ds, "processes": world,
                              "eval_chunks": qad["eval_chunks"]})
    accelerator.wait_for_everyone()

    # -- the grid never moved: same amax buffers as at the start
    check_grid_pinned(inner.lm, init_amax, "during training")
    if last == qad["max_steps"] and main:
        export_student(inner.lm, stage_dir / "qad_student", teacher_path)
        summary = summarize(stage_dir)
        summary["schedule"] = horizons
        write_json(stage_dir / "summary.json", summary)
        return summary
    return {"stopped_at": last}


def _per_process_accum(qad: dict, world: int) -> int:
    if qad["grad_accum_steps"] % world:
        raise QADError(f"qad.grad_accum_steps = {qad['grad_accum_steps']} is not divisible by the "
                       f"{world} processes; the effective batch would change")
    return qad["grad_accum_steps"] // world


def _micro_batch(train: dict, n_train: int, offset: int, size: int, seed: int):
    """Chunks for a global sample offset: a fresh seeded permutation per epoch, so a resumed run
    sees exactly the data an uninterrupted one would."""
    rows = []
    for k in range(offset, offset + size):
        epoch, pos = divmod(k, n_train)
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed + epoch))
        rows.append(int(order[pos]))
    return train["input_ids"][rows], train["weights"][rows]


def _save_checkpoint(accelerator, lm: nn.Module, ckpt_root: Path, step: int, sidecars_from: Path, keep_last: int,
                     info: dict):
    folder = ckpt_root / f"step-{step}"
    if accelerator.is_main_process and folder.exists():
        shutil.rmtree(folder)  # an unfinished earlier attempt at this step (no meta.json)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(folder / "state"))
    if accelerator.is_main_process:
        export_student(lm, folder / "student", sidecars_from)
        write_json(folder / "meta.json", {"step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **info})
        steps = [s for s in checkpoint_steps(ckpt_root) if s <= step]
        if keep_last > 0:
            for old in steps[:-keep_last]:
                shutil.rmtree(ckpt_root / f"step-{old}", ignore_errors=True)
    accelerator.wait_for_everyone()


# ---------------------------------------------------------------- logs and results

def _append(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reset_logs(stage_dir: Path) -> None:
    for name in ("train_log.jsonl", "eval_log.jsonl"):
        (stage_dir / name).unlink(missing_ok=True)


def _truncate_logs(stage_dir: Path, step: int) -> None:
    """A resumed run rewrites what came after its checkpoint."""
    for name in ("train_log.jsonl", "eval_log.jsonl"):
        kept = [r for r in _read_log(stage_dir / name) if r["step"] <= step]
        (stage_dir / name).write_text("".join(json.dumps(r) + "\n" for r in kept))


def read_logs(stage_dir: Path) -> tuple[list[dict], list[dict]]:
    return _read_log(Path(stage_dir) / "train_log.jsonl"), _read_log(Path(stage_dir) / "eval_log.jsonl")


def summarize(stage_dir: Path) -> dict:
    """PTQ (step 0) vs QAD (last evaluation) on the held-out chunks."""
    _, evals = read_logs(stage_dir)
    if not evals:
        raise QADError(f"{stage_dir}: no evaluations in eval_log.jsonl")
    ptq, final = evals[0], evals[-1]
    return {"ptq_kl": ptq["kl"], "qad_kl": final["kl"], "ptq_top1": ptq["top1"], "qad_top1": final["top1"],
            "kl_reduction": 1.0 - final["kl"] / ptq["kl"] if ptq["kl"] > 0 else 0.0, "steps": final["step"],
            "gate": read_json(stage_dir / "gate.json") if (stage_dir / "gate.json").exists() else None}


# ---------------------------------------------------------------- launching

def run_qad(params: dict, profile: str, overrides: dict | None, stage_dir: Path, teacher_path: Path,
            log=print) -> dict:
    """Run `train_qad` in this process, or under `accelerate launch` (qad.launcher) streaming its log."""
    qad = params["qad"]
    if qad["launcher"] == "inprocess":
        return train_qad(params, stage_dir, teacher_path)
    config = write_accelerate_config(params, stage_dir)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "-m", "eqc_utils.quant.qad", "--profile", profile, "--overrides", json.dumps(overrides or {})]
    log("$ " + " ".join(cmd))
    with open(stage_dir / "launch.log", "w") as out, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            out.write(line)
            log(line.rstrip())
    if proc.returncode:
        raise QADError(f"accelerate launch exited with {proc.returncode}; see {stage_dir / 'launch.log'}")
    return read_json(stage_dir / "summary.json")


def write_accelerate_config(params: dict, stage_dir: Path) -> Path:
    """accelerate config (+ the DeepSpeed JSON with batch sizes filled in) for `accelerate launch`."""
    import yaml
    qad = params["qad"]
    # Several processes: accelerate's torch.distributed launcher starts them; each process's Accelerator
    # then picks NCCL on GPUs or gloo on CPUs (params device: cpu), which is how CI tests this path.
    # (accelerate's own MULTI_CPU type expects an external mpirun and would start one process only.)
    config = {"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "machine_rank": 0,
              "num_processes": qad["num_processes"], "mixed_precision": mixed_precision(params),
              "distributed_type": "MULTI_GPU" if qad["num_processes"] > 1 else "NO"}
    if qad["deepspeed"]:
        ds = json.loads(json.dumps(qad["deepspeed"]))
        ds["train_micro_batch_size_per_gpu"] = qad["micro_batch_size"]
        ds["gradient_accumulation_steps"] = _per_process_accum(qad, qad["num_processes"])
        ds["gradient_clipping"] = qad["grad_clip"]
        write_json(stage_dir / "ds_config.json", ds)
        config.update(distributed_type="DEEPSPEED",
                      deepspeed_config={"deepspeed_config_file": str(stage_dir / "ds_config.json")})
    path = stage_dir / "accelerate_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def main(argv=None) -> None:
    """Entry point of each `accelerate launch` process."""
    from eqc_utils.assets import teacher_dir
    from eqc_utils.params import load_params
    from eqc_utils.paths import stage_dir

    ap = argparse.ArgumentParser(description="one QAD process (started by accelerate launch)")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--overrides", default="{}", help="JSON mapping of dotted params keys to values")
    args = ap.parse_args(argv)
    params = load_params(args.profile, json.loads(args.overrides))
    teacher = teacher_dir(params["assets"]["teacher"], params["assets"]["hub_allowed"])
    train_qad(params, stage_dir(params["profile"], STAGE), teacher)


if __name__ == "__main__":
    main()
