"""Quantisation-aware distillation of the INT4 target (METHOD.md §2.3-2.7), top to bottom:

    prepare_qad   teacher JSONL -> packed chunks; the INT4 init pack (AWQ PTQ, or a published pack)
    train_qad     student on the pinned grid + start gate + AdamW/cosine loop with held-out KL and
                  top-1 agreement, checkpoints and resume; the same function in one CPU process or
                  under `accelerate launch` (DeepSpeed ZeRO-2) on N GPUs
    run_qad       what the notebook calls: train_qad in-process, or as an `accelerate launch`
                  subprocess whose log is streamed

Files under the stage folder: data/{train,val}.pt, ptq_ct/ (the PTQ baseline), gate.json,
train_log.jsonl, eval_log.jsonl, ckpts/step-N/{state/,student/,meta.json}, qad_student/ (final
latent weights + grid_amax.safetensors), summary.json.
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
from pathlib import Path

import torch
from torch import nn

from eqc_utils.devices import resolve_device
from eqc_utils.io import atomic_path, read_json, write_json
from eqc_utils.quant import grid
from eqc_utils.quant.kl import chunked_forward_kl, check_same_vocab
from eqc_utils.quant.packing import build_packs
from eqc_utils.quant.ptq import awq_pack, dense_ptq_model, load_causal_lm, resolve_pack, student_from_pack

STAGE = "03_qad_target"
GRID_FILE = "grid_amax.safetensors"


class QADError(RuntimeError):
    """QAD cannot start or continue as configured."""


# ---------------------------------------------------------------- preparation (one process)

def prepare_qad(params: dict, stage_dir: Path, teacher_rows: list[dict], teacher_path: Path, tokenizer) -> dict:
    """Pack the teacher data and make (or locate) the INT4 init pack. Idempotent for the same inputs; when the
    teacher data or the quant/qad settings changed, earlier packs, init and checkpoints are discarded so that a
    re-run never resumes from artifacts made with other inputs."""
    qad, quant = params["qad"], params["quant"]
    _discard_stale(stage_dir, {"rows": hashlib.sha256(json.dumps(teacher_rows, sort_keys=True).encode()).hexdigest(),
                               "teacher": str(teacher_path), "quant": quant,
                               "qad": {k: v for k, v in qad.items() if k != "resume"}})
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


def _discard_stale(stage_dir: Path, inputs: dict) -> None:
    marker = stage_dir / "inputs.digest"
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    if marker.exists() and marker.read_text().strip() != digest:
        for stale in ("data", "ptq_ct", "ckpts", "qad_student"):
            shutil.rmtree(stage_dir / stale, ignore_errors=True)
    stage_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(digest + "\n")


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
    return sorted(int(p.name.split("-")[1]) for p in ckpt_root.glob("step-*") if (p / "meta.json").exists())


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


# ---------------------------------------------------------------- the training function

def train_qad(params: dict, stage_dir: Path, teacher_path: Path, stop_after: int | None = None) -> dict:
    """The QAD run. Every process of an `accelerate launch` runs this same function."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

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
    resume_from = checkpoint_steps(ckpt_root)[-1] if qad["resume"] and checkpoint_steps(ckpt_root) else None

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
    init_amax = grid.grid_amax(lm)

    # -- optimiser: every student parameter (as the reference: no freezing); the grid is buffers
    student = Distillee(lm)
    optimizer = make_optimizer(student.parameters(), qad)
    warmup = math.ceil(qad["warmup_ratio"] * qad["max_steps"])
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, qad["max_steps"])
    # the scheduler stays unprepared: it counts optimiser steps, whatever the process count
    student, optimizer = accelerator.prepare(student, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    inner = accelerator.unwrap_model(student)

    start = 0
    if resume_from is not None:
        accelerator.load_state(str(ckpt_root / f"step-{resume_from}" / "state"))
        start = resume_from
        if main:
            _truncate_logs(stage_dir, start)

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
            _save_checkpoint(accelerator, inner.lm, ckpt_root, done, teacher_path, qad["keep_last_ckpts"])
    accelerator.wait_for_everyone()

    # -- the grid never moved: same amax buffers as at the start
    moved = [n for n, a in grid.grid_amax(inner.lm).items() if not torch.equal(a, init_amax[n])]
    if moved:
        raise QADError(f"the INT4 grid moved during training in {len(moved)} modules (e.g. {moved[0]})")
    if last == qad["max_steps"] and main:
        export_student(inner.lm, stage_dir / "qad_student", teacher_path)
        summary = summarize(stage_dir)
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


def _save_checkpoint(accelerator, lm: nn.Module, ckpt_root: Path, step: int, sidecars_from: Path, keep_last: int):
    folder = ckpt_root / f"step-{step}"
    if accelerator.is_main_process and folder.exists():
        shutil.rmtree(folder)  # an unfinished earlier attempt at this step (no meta.json)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(folder / "state"))
    if accelerator.is_main_process:
        export_student(lm, folder / "student", sidecars_from)
        write_json(folder / "meta.json", {"step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S")})
        steps = checkpoint_steps(ckpt_root)
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
