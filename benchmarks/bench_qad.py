#!/usr/bin/env python
"""QAD step time and peak memory vs sequence length, chunked vs full-logits KL.

One step = teacher forward (no grad) + student forward/backward through the INT4 fake-quant grid
(gradient checkpointing) + AdamW, on the tiny teacher (SmolLM2-135M) or a micro model.

    python benchmarks/bench_qad.py                       # SmolLM2, seq 128 256 512, CPU
    python benchmarks/bench_qad.py --seq 256 1024 --device cuda --repeats 5
"""
import argparse
import platform
import resource
import statistics
import sys
import time

import torch

from eqc_utils import assets
from eqc_utils.params import load_params
from eqc_utils.quant import grid, ptq
from eqc_utils.quant.kl import chunked_forward_kl, forward_kl
from eqc_utils.quant.qad import Distillee, teacher_hidden


def peak_mb(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(model_dir, seq, mode, chunk, repeats, device):
    quant = load_params("tiny")["quant"]
    teacher = ptq.load_causal_lm(model_dir).to(device).eval().requires_grad_(False)
    lm = ptq.load_causal_lm(model_dir)
    grid.attach_int4_quantizers(lm, {**quant, "min_quantized_modules": 1})
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student = Distillee(lm).to(device).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-6)
    ids = torch.randint(0, teacher.config.vocab_size, (1, seq), device=device)
    weights = torch.ones(1, seq, device=device)
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(repeats + 1):
        start = time.perf_counter()
        hidden_t = teacher_hidden(teacher, ids)
        if mode == "chunked":
            loss = chunked_forward_kl(student(ids), hidden_t, weights, student.head, teacher.get_output_embeddings(),
                                      1.0, chunk)
        else:
            loss = forward_kl(student.head(student(ids)), teacher.get_output_embeddings()(hidden_t), weights)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times), peak_mb(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a local HF folder")
    ap.add_argument("--seq", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", choices=["chunked", "full"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = assets.teacher_dir(args.model) if args.model == "smollm2" else args.model
    if args.mode:  # child: one measurement per process, so ru_maxrss is this configuration's peak
        for seq in args.seq:
            t, mb = run(model_dir, seq, args.mode, args.chunk, args.repeats, args.device)
            print(f"RESULT {seq} {args.mode} {t:.3f} {mb:.0f}")
        return
    import subprocess
    rows = []
    for seq in args.seq:
        for mode in ("full", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--seq", str(seq), "--chunk",
                                  str(args.chunk), "--repeats", str(args.repeats), "--device", args.device,
                                  "--mode", mode], capture_output=True, text=True, check=True).stdout
            line = [l for l in out.splitlines() if l.startswith("RESULT")][0].split()
            rows.append((seq, mode, float(line[3]), float(line[4])))
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"device {args.device}, torch {torch.__version__}")
    print(f"{'seq':>6} {'KL':>8} {'median step s':>14} {'peak MB':>9} {'time ratio':>11} {'mem ratio':>10}")
    by = {(s, m): (t, mb) for s, m, t, mb in rows}
    for seq, mode, t, mb in rows:
        full_t, full_mb = by[(seq, "full")]
        print(f"{seq:>6} {mode:>8} {t:>14.3f} {mb:>9.0f} {t / full_t:>11.2f} {mb / full_mb:>10.2f}")


if __name__ == "__main__":
    main()
