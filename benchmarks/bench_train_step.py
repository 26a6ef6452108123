#!/usr/bin/env python
"""Training-step speed of the two trained parts, each configuration side by side in one process.

    # one H200, the small profile's shapes, SmolLM2-135M's architecture with random weights (no download):
    python benchmarks/bench_train_step.py
    # CPU smoke (about a minute; not a speed claim; --seq must leave room for a block after the 64-token prompt
    # in the shorter batch, i.e. exceed 192 + --block):
    python benchmarks/bench_train_step.py --device cpu --seq 256 --batch 2 --anchors 8 --block 8 --layers 1 --qad-batch 1 \\
        --warmup 1 --repeats 1 --no-compile

Drafter step (`eqc_utils.drafter.train.drafter_step` + backward + AdamW; small: 5 layers, block 16, 256 anchors,
16 x 1,024 tokens per micro-batch; --batch 16), in these configurations:
  plain           autograd cross-entropy through the frozen head, chunk by chunk (drafter.fused_loss false)
  fused           the head's gradient computed in the forward pass (objective.fused_head_loss): no stored logits
  plain+compile   the drafter compiled in place for one shape (drafter.compile): batches padded to --seq tokens,
                  --anchors blocks each, as drafter.train does when compiling
  fused+compile   both, the loss chunks compiled too
  ...+bucket      a compiled configuration whose batches are padded to the next multiple of --pad-multiple
                  (drafter.pad_multiple: one graph per width) instead of --seq
  ...+greedy      any of these with drafter.labels target_greedy: the target runs all its layers and its head's
                  argmax gives the labels (e.g. fused+compile+bucket+greedy)
  ...+slotsK      any of these with drafter.loss_slots K: only slots 1 ... K of a block scored (e.g. fused+slots7)
Batches alternate between two lengths (--seq and --seq minus 128, or --lengths) as real batches do; the compiled
configurations get both padded to --seq (or, +bucket, to their own multiple of --pad-multiple). Length-grouped
batches of real conversations, e.g. small's ~300-token answers, side by side with one padded shape:
    python benchmarks/bench_train_step.py --only drafter --batch 48 --anchors 128 --lengths 384,512 \
        --configs fused+compile,fused+compile+bucket
The first step of each configuration's losses is compared with `plain`'s. `--configs NAME@BxA` gives a configuration
its own shape (B sequences x A anchors) so that shapes can be compared side by side per sequence, e.g.
    python benchmarks/bench_train_step.py --only drafter --configs plain@16x256,fused+compile@32x256,fused+compile@48x128
QAD step (teacher forward + student forward/backward through the pinned INT4 fake-quant grid + AdamW; small:
8 x 1,024 tokens): gradient checkpointing on/off (ckpt / no-ckpt) x the student's INT4 forward (modelopt's
quantiser, or `+pinned`: qad.fake_quant pinned) x compile of the student's decoder off/on (`+compile`,
qad.compile), or of each decoder layer alone (`+compile-layers`: one graph for every layer, a shorter cold start;
`first_step_s` is the first step with its compilation). The first losses are compared with `ckpt`'s. Needs
nvidia-modelopt (the INT4 quantisers).

MFU = model FLOPs / step time / the GPU's dense bf16 peak (--peak-tflops, 989 for an H100/H200 SXM); model FLOPs:
drafter 2 x (target layers used) x context tokens + 6 x drafter x block positions + 4 x hidden x vocab x scored
positions (head forward + input gradient); QAD 8 x parameters x tokens (teacher forward + student forward/backward).
Writes benchmarks/results/train_step_<device>.json (machine, versions, date, arguments, results).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eqc_utils.devices import resolve_device  # noqa: E402
from eqc_utils.drafter.data import padded_width  # noqa: E402
from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for  # noqa: E402
from eqc_utils.drafter.train import drafter_step  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def random_target(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    return model.to(dtype=dtype).eval().requires_grad_(False)


def batches(args, device: str, batch: int | None = None) -> list[dict]:
    """Two synthetic chat-shaped batches of `batch` (default --batch) sequences: a 64-token prompt, then assistant
    tokens (scored) to the end."""
    out = []
    gen = torch.Generator().manual_seed(1)
    for length in ([int(v) for v in args.lengths.split(",")] if args.lengths else (args.seq, args.seq - 128)):
        ids = torch.randint(100, SMOLLM2["vocab_size"], (batch or args.batch, length), generator=gen)
        loss_mask = torch.ones_like(ids)
        loss_mask[:, :64] = 0
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
                    "loss_mask": loss_mask.to(device)})
    return out


def pad_to(batch: dict, width: int) -> dict:
    """The batch right-padded with zeros (pad id, attention and loss masks) to `width` tokens."""
    extra = width - batch["input_ids"].shape[1]
    return {key: torch.nn.functional.pad(value, (0, extra)) for key, value in batch.items()}


def drafter_flops(target, drafter, batch: dict, args, scored: int, anchors: int) -> float:
    used_layers = max(drafter.config.target_layer_ids) + 1
    per_layer = sum(p.numel() for p in target.model.layers[0].parameters())
    context = batch["input_ids"].numel()
    positions = batch["input_ids"].shape[0] * anchors * args.block
    cfg = target.config
    return (2 * used_layers * per_layer * context + 6 * sum(p.numel() for p in drafter.parameters()) * positions
            + 4 * cfg.hidden_size * cfg.vocab_size * scored)


def timed_steps(step_loss, optimizer, args, device: str) -> tuple[list[float], list[float], list[dict], float]:
    """--warmup untimed then --repeats timed optimiser steps; `step_loss(i)` returns (loss, stats) for step i.
    Returns the timed steps' seconds, every step's loss, the timed steps' stats and the first step's seconds
    (where a compiled configuration compiles)."""
    times, losses, stats_seen, first_step_s = [], [], [], None
    for i in range(args.warmup + args.repeats):
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            loss, stats = step_loss(i)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i == 0:
            first_step_s = time.perf_counter() - start
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            stats_seen.append(stats)
        losses.append(float(loss.detach()))
    return times, losses, stats_seen, first_step_s


def profile_steps(step_loss, optimizer, args, device: str, label: str) -> None:
    """--profile: two more steps under torch.profiler; prints the ops that take the most device (or CPU) time and
    how much of the wall time the device was busy (a low share means the step waits on Python and launches)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(2):
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                loss, _ = step_loss(args.warmup + args.repeats + i)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    busy = sum(getattr(e, key, 0) for e in events) / 1e6
    table = events.table(sort_by=key, row_limit=30, max_name_column_width=60)
    text = f"== profile {label}: wall {wall:.3f} s for 2 steps, device-busy {busy:.3f} s ({busy / wall:.0%})\n{table}\n"
    print(text)
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        (args.profile_dir / f"profile_{label}.txt").write_text(text)


def _loss_slots_of(part: str) -> int | None:
    """K for a configuration part `slotsK`, else None."""
    return int(part[5:]) if part.startswith("slots") and part[5:].isdigit() else None


def bench_drafter(args, device: str) -> list[dict]:
    target = random_target(device, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    cfg = drafter_config_for(target.config, num_layers=args.layers, block_size=args.block, target_layer_ids=None,
                             mask_token_id=16)
    torch.manual_seed(0)
    init = DFlashDrafter(cfg).to(device)
    kinds = {"plain": (False, False, False), "fused": (True, False, False), "plain+compile": (False, True, False),
             "fused+compile": (True, True, False), "plain+compile+bucket": (False, True, True),
             "fused+compile+bucket": (True, True, True)}
    specs = args.configs.split(",") if args.configs else list(kinds)
    configs = []
    for spec in specs:       # NAME or NAME@BxA: B sequences x A anchors instead of --batch x --anchors
        name, _, shape = spec.partition("@")
        parts = name.split("+")
        greedy = "greedy" in parts                # +greedy: drafter.labels target_greedy (full target forward)
        slots = next((k for k in map(_loss_slots_of, parts) if k is not None), None)   # +slotsK: loss_slots K
        kind = "+".join(p for p in parts if p != "greedy" and _loss_slots_of(p) is None)
        if kind not in kinds:
            continue         # a QAD configuration name
        batch, anchors = (int(v) for v in shape.split("x")) if shape else (args.batch, args.anchors)
        labels = "target_greedy" if greedy else "data"
        if not (args.no_compile and kinds[kind][1]):
            configs.append((spec, *kinds[kind], batch, anchors, labels, slots))
    data_of = {}
    rows, first_losses = [], {}
    for name, fused, compiled, bucket, batch, anchors, labels, slots in configs:
        data = data_of.setdefault(batch, batches(args, device, batch))
        P = {"num_anchors": anchors, "loss_decay_gamma": args.gamma, "loss_slots": slots, "attention": "auto",
             "fused_loss": fused, "labels": labels, "max_length": args.seq}
        drafter = copy.deepcopy(init)
        if compiled:   # as drafter.train does: batches padded to max_length (--seq) or, +bucket, a multiple
            drafter.compile(dynamic=False)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
        reset_peak(device)
        try:
            steps_data = [pad_to(b, padded_width(b["input_ids"].shape[1], args.pad_multiple if bucket else None,
                                                 args.seq)) for b in data] if compiled else data

            def step_loss(i, drafter=drafter, compiled=compiled, steps_data=steps_data):   # lengths alternate
                batch = steps_data[i % len(steps_data)]
                return drafter_step(drafter, target, batch, P, torch.Generator().manual_seed(i), compiled=compiled)
            times, losses, stats, first_step_s = timed_steps(step_loss, optimizer, args, device)
            scored = [s["scored"] for s in stats]
            if args.profile:
                profile_steps(step_loss, optimizer, args, device, f"drafter_{name}")
        except Exception as error:   # report and go on: the other configurations still measure
            traceback.print_exc()
            rows.append({"part": "drafter", "config": name, "error": f"{type(error).__name__}: {error}"[:500]})
            continue
        step = statistics.median(times)
        first_losses[name] = losses[0]
        flops = drafter_flops(target, drafter, data[0], args, int(statistics.median(scored)), anchors)
        rows.append({"part": "drafter", "config": name, "labels": labels, "loss_slots": slots, "sequences": batch,
                     "anchors": anchors, "scored_positions": int(statistics.median(scored)),
                     "lengths": [b["input_ids"].shape[1] for b in data],
                     "padded_widths": [b["input_ids"].shape[1] for b in steps_data],
                     "step_s": round(step, 4), "sequence_ms": round(1000 * step / batch, 3),
                     "first_step_s": round(first_step_s, 2),
                     "context_tokens_per_s": round(batch * statistics.mean(b["input_ids"].shape[1] - 64
                                                                            for b in data) / step),
                     "block_positions_per_s": round(batch * anchors * args.block / step),
                     "peak_gib": peak_gib(device), "mfu": flops / step / (args.peak_tflops * 1e12),
                     "first_loss": losses[0], "loss_rel_diff_vs_plain":
                         abs(losses[0] - first_losses["plain"]) / first_losses["plain"] if "plain" in first_losses else None})
        del drafter, optimizer
    base = next((r for r in rows if r["config"] == "plain" and "step_s" in r), None)
    first = next((r for r in rows if "step_s" in r), None)
    for r in rows:
        if base and "step_s" in r:
            r["speedup_vs_plain"] = round(base["step_s"] / r["step_s"], 2)
        if first and "step_s" in r:    # per sequence: configurations may differ in shape
            r["per_sequence_speedup_vs_first"] = round(first["sequence_ms"] / r["sequence_ms"], 2)
    return rows


def bench_qad(args, device: str) -> list[dict]:
    from eqc_utils.params import load_params
    from eqc_utils.quant import grid
    from eqc_utils.quant.fake_quant import use_pinned_int4_forward
    from eqc_utils.quant.kl import chunked_forward_kl
    from eqc_utils.quant.qad import Distillee, compile_student, teacher_hidden

    quant = {**load_params("small")["quant"], "min_quantized_modules": 1}
    teacher = random_target(device, torch.float32)
    n_params = sum(p.numel() for p in teacher.parameters())
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(100, SMOLLM2["vocab_size"], (args.qad_batch, args.seq), generator=gen).to(device)
    weights = torch.ones(args.qad_batch, args.seq, device=device)
    rows = []
    # compiled: False, "decoder" (qad.compile: the whole decoder as one graph) or "layers" (each decoder layer
    # compiled alone: one graph reused by all layers, so a fraction of the cold-start compile time)
    configs = [(ckpt, pinned, compiled) for pinned in (False, True) for compiled in (False, "decoder", "layers")
               for ckpt in (True, False)]
    suffix = {False: "", "decoder": "+compile", "layers": "+compile-layers"}
    names = {c: f"{'ckpt' if c[0] else 'no-ckpt'}{'+pinned' if c[1] else ''}{suffix[c[2]]}" for c in configs}
    configs = [c for c in configs if not (args.no_compile and c[2])]
    if args.configs:
        configs = [c for c in configs if names[c] in args.configs.split(",")]
    for checkpointing, pinned, compiled in configs:
        name = names[(checkpointing, pinned, compiled)]
        lm = copy.deepcopy(teacher).train().requires_grad_(True)
        grid.attach_int4_quantizers(lm, quant)
        if pinned:
            use_pinned_int4_forward(lm)
        if checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compiled:
            compile_student(lm, compiled)   # qad.compile_unit: decoder or layers
        student = Distillee(lm)
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-6)
        reset_peak(device)
        try:
            def step_loss(i, student=student):
                return chunked_forward_kl(student(ids), teacher_hidden(teacher, ids), weights, student.head,
                                          teacher.get_output_embeddings(), 1.0, args.kl_chunk), {}
            times, losses, _, first_step_s = timed_steps(step_loss, optimizer, args, device)
            if args.profile:
                profile_steps(step_loss, optimizer, args, device, f"qad_{name}")
        except Exception as error:
            traceback.print_exc()
            rows.append({"part": "qad", "config": name, "error": f"{type(error).__name__}: {error}"[:500]})
            continue
        step = statistics.median(times)
        rows.append({"part": "qad", "config": name, "step_s": round(step, 4), "first_step_s": round(first_step_s, 2),
                     "tokens_per_s": round(ids.numel() / step), "peak_gib": peak_gib(device),
                     "mfu": 8 * n_params * ids.numel() / step / (args.peak_tflops * 1e12), "first_loss": losses[0]})
        del lm, student, optimizer
    base = next((r for r in rows if r["config"] == "ckpt" and "step_s" in r), None)
    for r in rows:
        if base and "step_s" in r:
            r["speedup_vs_ckpt"] = round(base["step_s"] / r["step_s"], 2)
            r["loss_rel_diff_vs_ckpt"] = abs(r["first_loss"] - base["first_loss"]) / abs(base["first_loss"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--only", choices=["drafter", "qad"])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lengths", help="drafter: the two batches' lengths, e.g. 384,512 (default: --seq, --seq minus 128)")
    ap.add_argument("--pad-multiple", type=int, default=256, help="drafter, +bucket configurations: pad width multiple")
    ap.add_argument("--batch", type=int, default=8, help="drafter sequences per micro-batch (small: 8)")
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=7.0, help="drafter.loss_decay_gamma (small: 4)")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--qad-batch", type=int, default=8, help="QAD sequences per micro-batch (small: 8)")
    ap.add_argument("--kl-chunk", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled configurations (CPU smoke)")
    ap.add_argument("--configs", help="configurations to time, comma-separated (default: all), e.g. "
                                      "plain,plain+compile (drafter) or ckpt,no-ckpt+pinned+compile (QAD); a drafter "
                                      "one may name its shape, NAME@BxA: B sequences x A anchors (plain@16x256)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of two more steps per config")
    ap.add_argument("--profile-dir", type=Path, help="also write each table to PROFILE_DIR/profile_<part>_<config>.txt")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = resolve_device(args.device)
    rows = []
    if args.only in (None, "drafter"):
        rows += bench_drafter(args, device)
    if args.only in (None, "qad"):
        rows += bench_qad(args, device)
    keys = ["part", "config", "step_s", "sequence_ms", "speedup_vs_plain", "per_sequence_speedup_vs_first",
            "speedup_vs_ckpt", "mfu", "peak_gib", "first_loss", "error"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join("" if r.get(k) is None else f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k])
                         for k in keys))
    import transformers
    out = args.out or RESULTS_DIR / f"train_step_{'cuda' if device.startswith('cuda') else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "machine": {"node": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "arguments": {k: v for k, v in vars(args).items() if k != "out"}, "results": rows}, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
