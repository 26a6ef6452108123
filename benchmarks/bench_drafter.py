"""Drafter benchmarks: training-step time/memory and reference-decoder speed (plain vs speculative).

    python benchmarks/bench_drafter.py --target smollm2 --mode train --seq 512 --anchors 32 --block 8
    python benchmarks/bench_drafter.py --target smollm2 --mode decode --drafter runs/tiny/07_drafter_finetune/finetune/drafter

Train: median seconds per micro-batch of the real step (target features -> anchors -> drafter -> head
on scored positions -> backward -> AdamW), and the split target-forward / rest; peak memory (CUDA
max allocated, or process max RSS on CPU). Decode: tokens/s of plain greedy decoding vs speculative
decoding with the drafter (random weights unless --drafter), tau, and whether the outputs are the same:
identical token ids, or a divergence where plain decoding was nearly tied (its top-1 minus top-2
log-prob at the first differing token below --near-tie-margin nats, from one teacher-forced forward
pass of the target over prompt + plain output; `eqc_utils.compare`). In bf16 the block verification
and single-token steps round differently, so near-tied argmaxes may flip without any bug.
"""
from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eqc_utils import assets  # noqa: E402
from eqc_utils.compare import GreedyRun, compare_runs, teacher_forced_margins  # noqa: E402
from eqc_utils.devices import resolve_device  # noqa: E402
from eqc_utils.drafter.data import collate, split_heldout, tokenize_conversation  # noqa: E402
from eqc_utils.drafter.decode import DFlashProposer, greedy_generate, speculative_generate  # noqa: E402
from eqc_utils.drafter.features import context_features  # noqa: E402
from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for, load_drafter  # noqa: E402
from eqc_utils.drafter.runs import prompt_ids, stop_ids  # noqa: E402
from eqc_utils.drafter.train import drafter_step, load_target  # noqa: E402
from eqc_utils.io import read_jsonl  # noqa: E402

TEXT = ("Speculative decoding lets a small drafter propose several tokens that the large target then verifies in "
        "one forward pass; every accepted token saves one sequential target step. ") * 40


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_train(target, tokenizer, args, device: str) -> list[tuple]:
    P = {"num_anchors": args.anchors, "loss_decay_gamma": 7.0, "attention": "auto", "labels": "data",
         "max_length": args.seq}
    cfg = drafter_config_for(target.config, num_layers=args.layers, block_size=args.block, target_layer_ids=None,
                             mask_token_id=16)
    drafter = DFlashDrafter(cfg).to(device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    messages = [{"role": "user", "content": "Explain speculative decoding."}, {"role": "assistant", "content": TEXT}]
    example = tokenize_conversation(tokenizer, messages, args.seq)
    batch = collate([example] * args.batch, device)
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=args.precision == "bf16")
    generator = torch.Generator().manual_seed(0)
    step_times, feature_times = [], []
    for i in range(args.warmup + args.repeats):
        sync(device)
        t0 = time.perf_counter()
        with autocast:
            context_features(target, batch["input_ids"], batch["attention_mask"], cfg.target_layer_ids)
        sync(device)
        t1 = time.perf_counter()
        with autocast:
            loss, _ = drafter_step(drafter, target, batch, P, generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t2 = time.perf_counter()
        if i >= args.warmup:
            feature_times.append(t1 - t0)
            step_times.append(t2 - t1)
    step, feat = statistics.median(step_times), statistics.median(feature_times)
    positions = args.batch * min(args.anchors, args.seq) * args.block
    return [("train step (s / micro-batch)", f"{step:.3f}"),
            ("  of which target features (s)", f"{feat:.3f} ({feat / step:.0%})"),
            ("  sequences/s", f"{args.batch / step:.2f}"),
            ("  block positions / micro-batch (max)", positions),
            ("  peak memory (MB)", f"{peak_memory_mb(device):.0f}")]


def bench_decode(target, tokenizer, args, device: str) -> list[tuple]:
    if args.drafter:
        drafter = load_drafter(args.drafter, device=device, dtype=next(target.parameters()).dtype)
    else:
        cfg = drafter_config_for(target.config, num_layers=args.layers, block_size=args.block,
                                 target_layer_ids=None, mask_token_id=16)
        drafter = DFlashDrafter(cfg).to(device=device, dtype=next(target.parameters()).dtype)
    if args.data:   # the held-out prompts of a drafter run (split_heldout's rule, as the run itself uses)
        rows = split_heldout(read_jsonl(args.data), args.prompts)[1]
    else:
        rows = [{"conversations": [{"role": "user", "content": text}]} for text in (
            "Explain speculative decoding in two sentences.", "Write a Python function that reverses a list.",
            "What is the capital of France? Answer briefly.")][:args.prompts]
    stops = stop_ids(tokenizer, target.config)
    plain_tps, spec_tps, taus, plain_runs, spec_runs = [], [], [], [], []
    prompts = prompt_ids(tokenizer, rows)
    for ids in prompts:
        plain = greedy_generate(target, ids, args.new_tokens, stops)
        spec = speculative_generate(target, DFlashProposer(drafter, target), ids, args.new_tokens, stops)
        plain_tps.append(len(plain.output_ids) / plain.seconds)
        spec_tps.append(len(spec.output_ids) / spec.seconds)
        taus.append(spec.tau)
        plain_runs.append(GreedyRun(plain.output_ids, margins=teacher_forced_margins(target, ids, plain.output_ids)))
        spec_runs.append(GreedyRun(spec.output_ids))
    same = compare_runs(prompts, plain_runs, spec_runs, args.near_tie_margin, names=("plain", "speculative"))
    p, s = statistics.median(plain_tps), statistics.median(spec_tps)
    return [("plain greedy (tok/s, median)", f"{p:.1f}"), ("speculative (tok/s, median)", f"{s:.1f}"),
            ("speedup", f"{s / p:.2f}x"), ("tau (median)", f"{statistics.median(taus):.2f}"),
            ("lossless (same output, near-ties allowed)", same["tally"]),
            ("  verdict", same["summary"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="teacher spec or a local model folder")
    ap.add_argument("--mode", choices=["train", "decode", "both"], default="both")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--decode-precision", choices=["bf16", "fp32"], default=None,
                    help="target dtype when decoding (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drafter", default=None, help="a trained drafter folder (default: random weights)")
    ap.add_argument("--prompts", type=int, default=3, help="how many prompts (the held-out count with --data)")
    ap.add_argument("--data", default=None, help="a drafter run's JSONL: decode its --prompts held-out prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--near-tie-margin", type=float, default=0.05,
                    help="nats: a divergence from plain decoding passes where plain's top-2 margin is below this")
    args = ap.parse_args()
    device = resolve_device(args.device)
    target_dir = Path(args.target) if Path(args.target).exists() else assets.teacher_dir(args.target)
    tokenizer = assets.load_tokenizer(str(target_dir))
    rows = [("command", " ".join(sys.argv)),
            ("machine", f"{platform.node()} {platform.processor() or platform.machine()}, "
                        f"{torch.get_num_threads()} torch threads, "
                        f"{torch.cuda.get_device_name() if device.startswith('cuda') else 'CPU'}"),
            ("torch", torch.__version__)]
    if args.mode in ("train", "both"):
        target = load_target(target_dir, device, args.precision)
        rows += bench_train(target, tokenizer, args, device)
    if args.mode in ("decode", "both"):
        # decode in the serving dtype: bf16 on CUDA, fp32 on CPU (bf16 matmuls are slow there at batch 1)
        target = load_target(target_dir, device, args.decode_precision or ("bf16" if device.startswith("cuda") else "fp32"))
        with torch.no_grad():
            rows += bench_decode(target, tokenizer, args, device)
    width = max(len(str(k)) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
