#!/usr/bin/env python
"""Seconds of one tau pass (greedy speculative decoding of held-out prompts, as stages 06 and 07 measure every
checkpoint): the batch-1 static-cache decoder (fast_decode.measure_acceptance_fast) against the batched one
(batched_decode.measure_acceptance_batched), side by side in one process, on the same prompts and drafter.

    # one H200, SmolLM2-135M's shape with random weights, a random 5-layer drafter (tau ~ 1: every step verifies):
    python benchmarks/bench_tau.py --random smollm2 --prompts 64 --new-tokens 256 --slots 64
    # a trained drafter against its target:
    python benchmarks/bench_tau.py --target runs/small/04_pack_target/dense --drafter PATH/drafter --slots 32
    # CPU smoke (eager, seconds; not a speed claim):
    python benchmarks/bench_tau.py --random smollm2 --device cpu --prompts 4 --prompt-tokens 16 --new-tokens 8 \\
        --slots 4 --draft-layers 1 --block 4 --compile off

Random-token prompts of --prompt-tokens tokens (prompt k is shortened by k mod 8 tokens so rows end at different
times). Per decoder: seconds (including compilation, as a stage pays it; --repeats > 1 adds warm passes), tau,
verification steps, and whether the per-prompt tau lists agree. Writes benchmarks/results/tau_<device>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_decode import SHAPES, build_drafter, build_target, device_slug, sync  # noqa: E402
from benchmarks.bench_generation import machine  # noqa: E402
from eqc_utils.devices import resolve_device  # noqa: E402
from eqc_utils.drafter.batched_decode import measure_acceptance_batched  # noqa: E402
from eqc_utils.drafter.decode import DFlashProposer  # noqa: E402
from eqc_utils.drafter.fast_decode import measure_acceptance_fast  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def timed(measure, device: str, repeats: int) -> tuple[list[float], object]:
    seconds, report = [], None
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        report = measure()
        sync(device)
        seconds.append(round(time.perf_counter() - started, 2))
    return seconds, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--target", help="a local HF model folder (attention-only: llama / qwen2 / qwen3)")
    which.add_argument("--random", choices=sorted(SHAPES), help="random weights of this shape (default: smollm2)")
    ap.add_argument("--drafter", help="a trained DFlash drafter folder; default: a random one")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="auto: on for CUDA only")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.random = args.random or (None if args.target else "smollm2")
    device = resolve_device(args.device)
    compile = args.compile == "on" or (args.compile == "auto" and device == "cuda")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    info = machine()
    target = build_target(args, device, dtype)
    drafter = build_drafter(args, target, device, dtype)
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_tokens - k % 8,), generator=generator).tolist()
               for k in range(args.prompts)]
    proposer = lambda: DFlashProposer(drafter, target, args.block)  # noqa: E731
    rows = {}
    with torch.no_grad():
        rows["batch-1 (fast_decode)"] = timed(lambda: measure_acceptance_fast(
            target, proposer(), prompts, args.new_tokens, compile=compile, progress=False), device, args.repeats)
        rows[f"batched, {args.slots} slots"] = timed(lambda: measure_acceptance_batched(
            target, proposer(), prompts, args.new_tokens, slots=args.slots, compile=compile, progress=False),
            device, args.repeats)
    (one_s, one), (many_s, many) = rows.values()
    results = [{"decoder": name, "seconds": s, "tau": round(r.tau, 4), "steps": r.steps, "tokens": r.tokens}
               for name, (s, r) in rows.items()]
    same = [a == b for a, b in zip(one.per_prompt_tau, many.per_prompt_tau)]
    print(f"| decoder | seconds | tau | steps | tokens |\n|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['decoder']} | {', '.join(map(str, r['seconds']))} | {r['tau']} | {r['steps']} | {r['tokens']} |")
    print(f"speed-up of the pass: {min(one_s) / min(many_s):.1f}x; per-prompt tau equal on {sum(same)}/{len(same)} "
          f"prompts (bf16 may flip near-ties)")
    out = args.out or RESULTS_DIR / f"tau_{device_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                               "command": " ".join([Path(sys.executable).name] + sys.argv), "machine": info,
                               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "compile": compile, "results": results,
                               "speedup": round(min(one_s) / min(many_s), 2),
                               "same_per_prompt_tau": f"{sum(same)}/{len(same)}"}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
