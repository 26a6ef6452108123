#!/usr/bin/env python
"""Milliseconds per decoding step of one static-cache batch (the `static` engine's `generate_round`), with
transformers' Temperature/TopK/TopP warpers against the fused `TopKTopP` processor, and greedy for reference.

    # one H200, the real teacher: batch 1024, prompts cut to 100 tokens, static cache 512
    python benchmarks/bench_sampling_step.py --model smollm2 --batch 1024 --cache 512 --steps 128 384
    # CPU smoke (not a speed claim)
    python benchmarks/bench_sampling_step.py --random smollm2 --device cpu --batch 4 --prompt-tokens 24 --cache 64 --steps 8 --repeats 1

Every setting decodes the same prompts once untimed (compile, CUDA graphs), then --repeats timed rounds; the
median is reported, side by side in one process. "useful" counts tokens up to each answer's end, "slots"
counts every place in the batch for every step (finished answers keep theirs until the longest ends).
Writes benchmarks/results/sampling_step_<device>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generation as bench  # noqa: E402  (the model, prompt and machine helpers of the generation bench)

from eqc_utils.assets import teacher_dir  # noqa: E402
from eqc_utils.generation import hf  # noqa: E402


def timed_round(lm, ids: list[list[int]], gen: dict, steps: int, cache: int, fused: bool) -> dict:
    chosen = hf.batch_sampling_kwargs
    hf.batch_sampling_kwargs = chosen if fused else hf.sampling_kwargs   # generate_round's only switch
    try:
        bench.sync(lm)
        started = time.perf_counter()
        out = hf.generate_round(lm, ids, [steps] * len(ids), gen, 2, {2}, 1.0, cache)
        bench.sync(lm)
        seconds = time.perf_counter() - started
    finally:
        hf.batch_sampling_kwargs = chosen
    useful = sum(map(len, out))
    return {"ms_per_step": 1e3 * seconds / steps, "useful_tok_s": useful / seconds,
            "slot_tok_s": len(ids) * steps / seconds, "mean_new_tokens": useful / len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model", default="smollm2", help="'smollm2' (the packaged teacher) or a local HF folder")
    which.add_argument("--random", choices=sorted(bench.SHAPES), help="random weights of this shape instead")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=100, help="prompts are cut to this many tokens")
    ap.add_argument("--cache", type=int, default=512, help="static cache length (prompt + new tokens must fit)")
    ap.add_argument("--steps", type=int, nargs="+", default=[128], help="new tokens per round")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", default="small", help="params profile whose sampling settings are used")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.prompt_tokens + max(args.steps) > args.cache:
        ap.error(f"--cache {args.cache} is shorter than --prompt-tokens + the longest --steps")

    gen = dict(bench.load_params(args.profile)["generation"])
    greedy = dict(gen, temperature=0.0)
    with tempfile.TemporaryDirectory() as work:
        model = teacher_dir("smollm2") if args.model == "smollm2" else Path(args.model)
        if args.random:
            model = bench.random_model(args.random, teacher_dir("smollm2"), Path(work) / "random")
        lm, tokenizer = hf.load_model(model, args.device)
        ids = [tokenizer(bench.synthetic_prompt(i))["input_ids"][:args.prompt_tokens] for i in range(args.batch)]
        settings = [("warpers", gen, False), ("fused", gen, True), ("greedy", greedy, False)]
        results = []
        for steps in args.steps:
            for name, sampling, fused in settings:
                timed_round(lm, ids, sampling, steps, args.cache, fused)            # compile / graphs
                runs = [timed_round(lm, ids, sampling, steps, args.cache, fused) for _ in range(args.repeats)]
                row = {"setting": name, "steps": steps,
                       **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                results.append(row)
                print(f"{name:8s} steps {steps:4d}: {row['ms_per_step']:7.2f} ms/step, "
                      f"{row['useful_tok_s']:9.0f} useful tok/s, {row['slot_tok_s']:9.0f} slot tok/s", flush=True)
    for steps in args.steps:
        by = {r["setting"]: r["ms_per_step"] for r in results if r["steps"] == steps}
        print(f"steps {steps}: fused is {by['warpers'] / by['fused']:.2f}x the warpers' speed per step")
    info = bench.machine()
    out = args.out or bench.RESULTS_DIR / f"sampling_step_{bench.device_slug(str(lm.device.type), info)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                               "command": "python " + " ".join(sys.argv), "machine": info, "args": vars(args) | {
                                   "out": str(args.out) if args.out else None},
                               "sampling": {k: gen[k] for k in ("temperature", "top_k", "top_p")},
                               "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
