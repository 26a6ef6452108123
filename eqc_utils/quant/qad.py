"""Quantisation-aware distillation of the INT4 target (docs/recipe.md §2.3-2.7), top to bottom:

    prepare_qad   teacher JSONL -> packed chunks; the INT4 init pack (AWQ PTQ, or a published pack)
    train_qad     student on the pinned grid + start gate + AdamW/cosine loop with held-out KL and
                  top-1 agreement, checkpoints and resume; the same function in one CPU process or
                  under `accelerate launch` (DeepSpeed ZeRO-2) on N GPUs
    run_qad       what the notebook calls: train_qad in-process, or as an `accelerate launch`
                  subprocess whose log is streamed

Files under the stage folder: inputs.json (the settings each artifact was made with), data/{train,val}.pt,
ptq_ct/ (the PTQ baseline), gate.json, train_log.jsonl and eval_log.jsonl (one row per logged or evaluated
step), ckpts/step-N/ (the checkpoint layout of eqc_utils.training, shared with the drafter: state/ from
accelerate's save_state, student/ = the exported latent weights + grid, meta.json written last),
qad_student/ (final latent weights + grid_amax.safetensors), summary.json. Artifacts that no longer match
the settings are never deleted: they are renamed `<name>.stale-<YYYYmmdd-HHMMSS>` (see LAYERS); checkpoints a
run does not continue go into `ckpts.stale-<YYYYmmdd-HHMMSS>/`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eqc_utils.devices import resolve_device, wants_compile
from eqc_utils.io import atomic_path, describe_changes, move_aside, read_json, write_json
from eqc_utils.quant import grid
from eqc_utils.quant.fake_quant import use_pinned_int4_forward
from eqc_utils.quant.kl import chunked_forward_kl, check_same_vocab
from eqc_utils.quant.packing import build_packs
from eqc_utils.quant.ptq import awq_pack, dense_ptq_model, load_causal_lm, resolve_pack, student_from_pack
from eqc_utils.training import (CheckpointDir, JsonlLog, ResumePlan, apply_schedule, estimated_bytes, plan_resume,
                                warmup_cosine)

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
                          "compile", "compile_unit", "fake_quant"})
HORIZON_KEY = "max_steps"


def prepare_qad(params: dict, stage_dir: Path, teacher_rows: list[dict], teacher_path: Path, tokenizer,
                log=print) -> dict:
    """Pack the teacher data and make (or locate) the INT4 init pack. Idempotent for the same inputs. When an
    input changed, the artifacts that depend on it are moved aside (`<name>.stale-<time>`, see LAYERS) and the
    changed settings are logged, so a re-run never resumes from artifacts made with other inputs."""
    qad = params["qad"]
    started = time.time()
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
    init_pack = str(init_pack_dir(params, stage_dir, teacher_path))     # AWQ's clip search when not made yet
    return {"data": meta, "init_pack": init_pack, "seconds": round(time.time() - started, 2)}


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
    """Weighted held-out KL and top-1 agreement of a model against the teacher.

    Rows go through `qad.micro_batch_size` at a time (a training micro-batch fits, and without gradients
    the forward needs less), and the sums stay on the device until the end (one row at a time, with three
    host reads per row, the held-out evaluations took 67 s of 03's 334 s on one H100)."""
    rows = max(1, int(qad["micro_batch_size"]))
    kl_sum = agree_sum = total = torch.zeros((), dtype=torch.float64, device=ids.device)
    for start in range(0, ids.shape[0], rows):
        x, w = ids[start: start + rows], weights[start: start + rows]
        kl, agree, n = chunked_forward_kl(model_hidden(x), teacher_hidden(teacher, x), w, head,
                                          teacher.get_output_embeddings(), qad["kl_temperature"],
                                          qad["kl_chunk_tokens"], with_agreement=True)
        n = n.double()
        kl_sum, agree_sum, total = kl_sum + kl.double() * n, agree_sum + agree.double() * n, total + n
    total = max(float(total), 1.0)
    return {"kl": float(kl_sum) / total, "top1": float(agree_sum) / total, "tokens": total}


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


# ---------------------------------------------------------------- checkpoints (layout: eqc_utils.training)

CKPTS_DIR = "ckpts"
EXPORT_DIR = "student"
LOGS = ("train_log.jsonl", "eval_log.jsonl")


def _checkpoints(ckpt_root: Path) -> CheckpointDir:
    return CheckpointDir(ckpt_root, export=EXPORT_DIR)


def checkpoint_steps(ckpt_root: Path) -> list[int]:
    """Steps of complete checkpoints (meta.json is written last)."""
    return _checkpoints(Path(ckpt_root)).steps()


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


# ---------------------------------------------------------------- the training function

@dataclass
class _Session:
    """What one QAD process holds while it trains (the optimiser side is set by `_prepare`)."""
    params: dict
    stage_dir: Path
    teacher_path: Path
    accelerator: Any
    deepspeed: bool
    train: dict
    val: dict
    eval_n: int                  # held-out chunks evaluated
    pack_dir: Path
    teacher: nn.Module
    lm: nn.Module                # the student's causal LM (inside `student` once prepared)
    trajectory: dict
    ckpts: CheckpointDir
    train_log: JsonlLog
    eval_log: JsonlLog
    horizons: list[dict] = field(default_factory=list)
    student: Any = None          # Distillee(lm), prepared by accelerate
    inner: Any = None            # the same, unwrapped
    optimizer: Any = None
    scheduler: Any = None
    init_amax: dict | None = None

    @property
    def qad(self) -> dict:
        return self.params["qad"]

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def train_qad(params: dict, stage_dir: Path, teacher_path: Path, stop_after: int | None = None) -> dict:
    """The QAD run. Every process of an `accelerate launch` runs this same function."""
    from tqdm.auto import tqdm

    s = _setup(params, Path(stage_dir), Path(teacher_path))
    plan = _plan(s)
    if plan.step is None:
        _start_gate(s)
    _prepare(s)
    start = 0 if plan.step is None else _restore(s, plan)
    if start == 0:
        _evaluate(s, 0)   # step 0 = the PTQ baseline on the held-out chunks
    qad = s.qad
    last = qad["max_steps"] if stop_after is None else min(stop_after, qad["max_steps"])
    bar = tqdm(range(start, last), desc="QAD", disable=not s.main, initial=start, total=qad["max_steps"])
    started = time.time()
    for step in bar:
        loss, grad_norm = _optimiser_step(s, step)
        done = step + 1
        if s.main and (done % qad["log_every"] == 0 or done == last):
            loss = float(loss)
            s.train_log.append({"step": done, "loss": loss, "lr": s.scheduler.get_last_lr()[0],
                                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                                "seconds": round(time.time() - started, 2)})
            bar.set_postfix(loss=f"{loss:.4f}")
        if done % qad["eval_every"] == 0 or done == qad["max_steps"]:
            _evaluate(s, done)
        if done % qad["save_every"] == 0 or done == qad["max_steps"]:
            _save(s, done)
    s.accelerator.wait_for_everyone()
    return _finish(s, last)


def _setup(params: dict, stage_dir: Path, teacher_path: Path) -> _Session:
    """The accelerator, the packed data, the frozen teacher and the student pinned to the init grid."""
    from accelerate import Accelerator, DistributedType

    qad, quant = params["qad"], params["quant"]
    # effective batch = micro x grad_accum_steps sequences, whatever the process count
    accelerator = Accelerator(mixed_precision=mixed_precision(params), cpu=params["device"] == "cpu",
                              gradient_accumulation_steps=_per_process_accum(qad, int(os.environ.get("WORLD_SIZE", 1))))
    if accelerator.is_main_process:
        print(f"QAD: {accelerator.num_processes} process(es) on {accelerator.device}, "
              f"{accelerator.gradient_accumulation_steps} accumulation step(s) per process", flush=True)
    torch.manual_seed(params["seed"])
    train = torch.load(stage_dir / "data" / "train.pt")
    val = torch.load(stage_dir / "data" / "val.pt")
    eval_n = val["input_ids"].shape[0] if qad["eval_chunks"] is None else min(qad["eval_chunks"], val["input_ids"].shape[0])
    pack_dir = init_pack_dir(params, stage_dir, teacher_path)
    teacher = load_causal_lm(teacher_path).to(accelerator.device).eval().requires_grad_(False)
    lm, _ = student_from_pack(teacher_path, pack_dir, quant)
    check_same_vocab(lm.get_output_embeddings(), teacher.get_output_embeddings())
    return _Session(params=params, stage_dir=stage_dir, teacher_path=teacher_path, accelerator=accelerator,
                    deepspeed=accelerator.distributed_type == DistributedType.DEEPSPEED, train=train, val=val,
                    eval_n=eval_n, pack_dir=pack_dir, teacher=teacher, lm=lm.to(accelerator.device),
                    trajectory=_current_trajectory(params, stage_dir), ckpts=_checkpoints(stage_dir / CKPTS_DIR),
                    train_log=JsonlLog(stage_dir / LOGS[0]), eval_log=JsonlLog(stage_dir / LOGS[1]))


def _plan(s: _Session) -> ResumePlan:
    """Resume from the newest checkpoint at or before qad.max_steps (the schedule's horizon). Checkpoints of
    other settings were moved aside by prepare_qad: meeting one here (train_qad run without it) is an error,
    as is one in another checkpoint format. Checkpoints this run does not continue are moved aside."""
    qad, world = s.qad, s.accelerator.num_processes
    plan = plan_resume(s.ckpts, s.trajectory, qad["max_steps"], qad["resume"], "qad.resume")
    if plan.changes is not None:
        raise QADError(f"{s.ckpts.root}: {plan.afresh}; run prepare_qad first (it moves such checkpoints aside) "
                       "or set qad.resume=false")
    if plan.step is not None:
        meta, folder = plan.meta, s.ckpts.folder(plan.step)
        saved_ds = meta.get("deepspeed", s.deepspeed)
        if saved_ds != s.deepspeed or (s.deepspeed and meta.get("processes", world) != world):
            raise QADError(f"{folder} was saved {'with' if saved_ds else 'without'} DeepSpeed on "
                           f"{meta.get('processes')} process(es); this run is {'with' if s.deepspeed else 'without'} "
                           f"DeepSpeed on {world}: launch it as before (qad.launcher, qad.deepspeed, "
                           "qad.num_processes), or set qad.resume=false to start afresh (the checkpoints are then "
                           "moved aside)")
    s.horizons = plan.horizons
    s.accelerator.wait_for_everyone()   # every process has planned before anything is moved
    if s.main and plan.later:
        why = plan.afresh or f"resuming from step {plan.step} (qad.max_steps = {qad['max_steps']})"
        dest, later = s.ckpts.move_after(-1 if plan.step is None else plan.step)
        for name in (*LOGS, "summary.json", "gate.json"):   # the record of the run they belonged to
            if (s.stage_dir / name).exists():
                shutil.copy2(s.stage_dir / name, dest / name)
        print(f"QAD: {why}: checkpoints {later} moved aside to {dest} (delete it once no longer needed)", flush=True)
    s.accelerator.wait_for_everyone()
    return plan


def _start_gate(s: _Session) -> None:
    """A fresh run: the pinned student must be the PTQ model (start_gate); the logs start empty."""
    started = time.time()
    ptq_model = dense_ptq_model(s.teacher_path, s.pack_dir, s.params["quant"]).to(s.accelerator.device)
    gate = start_gate(s.lm, s.teacher, ptq_model, s.train, s.qad)
    del ptq_model
    gate["seconds"] = round(time.time() - started, 2)
    if s.main:
        write_json(s.stage_dir / "gate.json", gate)
        s.train_log.reset()
        s.eval_log.reset()


def compile_student(lm, unit: str) -> None:
    """torch.compile in place (parameter names, checkpoints and exports are unchanged): the whole decoder as one
    graph, or each decoder layer alone. Identical layers share one compiled graph, so `layers` compiles once
    instead of tracing all of them (2-core CPU, SmolLM2: first step 22.8 s vs 144 s, docs/qad.md)."""
    decoder = lm.get_decoder()
    if unit == "decoder":
        decoder.compile()
    elif unit == "layers":
        for layer in decoder.layers:
            layer.compile()
    else:
        raise ValueError(f"qad.compile_unit {unit!r}: use decoder or layers")


def _prepare(s: _Session) -> None:
    """Optimiser and schedule over every student parameter (as the reference: no freezing; the grid is
    buffers), prepared by accelerate, with the grid checked to be still pinned."""
    qad, accelerator = s.qad, s.accelerator
    if qad["fake_quant"] == "pinned":
        # the same values and gradients as modelopt's quantiser, without its host reads; compilable
        use_pinned_int4_forward(s.lm)
    if qad["grad_checkpointing"]:
        s.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if wants_compile(qad["compile"], str(accelerator.device)):
        compile_student(s.lm, qad["compile_unit"])
    s.init_amax = grid.grid_amax(s.lm)
    student = Distillee(s.lm)
    optimizer = make_optimizer(student.parameters(), qad)
    warmup = math.ceil(qad["warmup_ratio"] * qad["max_steps"])
    s.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(qad["max_steps"], warmup, from_zero=True))
    # the scheduler stays unprepared: it counts optimiser steps, whatever the process count
    s.student, s.optimizer = accelerator.prepare(student, optimizer)
    accelerator.register_for_checkpointing(s.scheduler)
    s.inner = accelerator.unwrap_model(s.student)
    # DeepSpeed's bf16 mode (and any other cast of the whole module) also casts buffers: the grid must
    # still be the fp32 7 x scale it was pinned to before a single step is taken
    check_grid_pinned(s.inner.lm, s.init_amax, "by accelerator.prepare")
    s.student.train()


def _restore(s: _Session, plan: ResumePlan) -> int:
    """Load the planned checkpoint's state; the logs are cut back to its step. Returns that step."""
    qad, step = s.qad, plan.step
    s.ckpts.load(s.accelerator, step)
    if plan.old_horizon is not None:
        apply_schedule(s.scheduler)
        if s.main:
            print(f"QAD: qad.max_steps changed from {plan.old_horizon} to {qad['max_steps']}: from step {step} on, "
                  f"the learning rate follows the cosine schedule over {qad['max_steps']} steps "
                  f"({s.scheduler.get_last_lr()[0]:.3g} now); the steps before followed the old one "
                  "(qad.resume=false gives a run with one schedule)", flush=True)
    if s.main:
        print(f"QAD: resuming from step {step}", flush=True)
        s.train_log.truncate(step)
        s.eval_log.truncate(step)
        if plan.meta.get("eval_chunks", qad["eval_chunks"]) != qad["eval_chunks"]:
            print(f"QAD: qad.eval_chunks changed from {plan.meta['eval_chunks']} to {qad['eval_chunks']}: held-out "
                  f"evaluations up to step {step} used other chunks", flush=True)
    return step


def _evaluate(s: _Session, step: int) -> None:
    """Held-out KL and top-1 agreement, each process on its share of the chunks, summed across processes."""
    s.student.eval()
    started = time.time()
    rank, world, device = s.accelerator.process_index, s.accelerator.num_processes, s.accelerator.device
    mine = slice(rank, s.eval_n, world)
    # the unwrapped model: ranks may hold different numbers of held-out chunks, and every forward of the
    # DDP wrapper is a collective (buffer broadcast) that would then wait forever
    stats = mean_kl(s.inner, s.teacher, s.inner.head, s.val["input_ids"][mine].to(device),
                    s.val["weights"][mine].to(device), s.qad)
    sums = torch.tensor([stats["kl"] * stats["tokens"], stats["top1"] * stats["tokens"], stats["tokens"]],
                        device=device)
    sums = s.accelerator.reduce(sums, reduction="sum")
    if s.main:
        tokens = max(float(sums[2]), 1.0)
        s.eval_log.append({"step": step, "kl": float(sums[0]) / tokens, "top1": float(sums[1]) / tokens,
                           "tokens": tokens, "seconds": round(time.time() - started, 2)})
    s.student.train()


def _optimiser_step(s: _Session, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimiser step over this process's micro-batches of `step`; (mean loss, gradient norm)."""
    qad, accelerator = s.qad, s.accelerator
    accum, world, rank = accelerator.gradient_accumulation_steps, accelerator.num_processes, accelerator.process_index
    size = qad["micro_batch_size"]
    step_loss, grad_norm = 0.0, None
    for micro in range(accum):
        ids, weights = _micro_batch(s.train, s.train["input_ids"].shape[0],
                                    (step * accum * world + micro * world + rank) * size, size, s.params["seed"])
        ids, weights = ids.to(accelerator.device), weights.to(accelerator.device)
        with accelerator.accumulate(s.student):
            with accelerator.autocast():
                loss = chunked_forward_kl(s.student(ids), teacher_hidden(s.teacher, ids), weights, s.inner.head,
                                          s.teacher.get_output_embeddings(), qad["kl_temperature"],
                                          qad["kl_chunk_tokens"])
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(s.student.parameters(), qad["grad_clip"])
            s.optimizer.step()
            if accelerator.sync_gradients:
                s.scheduler.step()
            s.optimizer.zero_grad()
        step_loss = step_loss + loss.detach() / accum   # a device scalar, read only when logged (no per-step sync)
    return step_loss, grad_norm


def _save(s: _Session, step: int) -> None:
    """A checkpoint with the exported student; qad.keep_last_ckpts bounds how many stay (whole)."""
    qad = s.qad
    meta = {"trajectory": s.trajectory, "horizons": s.horizons, "deepspeed": s.deepspeed,
            "processes": s.accelerator.num_processes, "eval_chunks": qad["eval_chunks"]}
    s.ckpts.save(s.accelerator, step, meta, lambda path: export_student(s.inner.lm, path, s.teacher_path),
                 keep_last=qad["keep_last_ckpts"], expected_bytes=estimated_bytes(s.inner.lm))


def _finish(s: _Session, last: int) -> dict:
    """The grid never moved (same amax buffers as at the start); a complete run exports qad_student/ and
    summary.json."""
    check_grid_pinned(s.inner.lm, s.init_amax, "during training")
    if last == s.qad["max_steps"] and s.main:
        export_student(s.inner.lm, s.stage_dir / "qad_student", s.teacher_path)
        summary = summarize(s.stage_dir)
        summary["schedule"] = s.horizons
        write_json(s.stage_dir / "summary.json", summary)
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


# ---------------------------------------------------------------- logs and results

def read_logs(stage_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train_log rows, eval_log rows) of a stage folder."""
    return tuple(JsonlLog(Path(stage_dir) / name).read() for name in LOGS)


def summarize(stage_dir: Path) -> dict:
    """PTQ (step 0) vs QAD (last evaluation) on the held-out chunks, and where the time went: loop_seconds (the
    training loop, evaluations and checkpoints included; of the last uninterrupted stretch when resumed) and
    eval_seconds (the held-out evaluations; rows of older logs have no time)."""
    train, evals = read_logs(stage_dir)
    if not evals:
        raise QADError(f"{stage_dir}: no evaluations in eval_log.jsonl")
    ptq, final = evals[0], evals[-1]
    return {"ptq_kl": ptq["kl"], "qad_kl": final["kl"], "ptq_top1": ptq["top1"], "qad_top1": final["top1"],
            "kl_reduction": 1.0 - final["kl"] / ptq["kl"] if ptq["kl"] > 0 else 0.0, "steps": final["step"],
            "loop_seconds": train[-1].get("seconds") if train else None,
            "eval_seconds": round(sum(e.get("seconds", 0.0) for e in evals), 2),
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
