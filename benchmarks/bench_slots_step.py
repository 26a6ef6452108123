#!/usr/bin/env python
"""Cost of one decoding step of the `slots` generation engine (eqc_utils/generation/slots.py) per number of
slots and cache length: every slot decodes one token, sampled (the small profile's T 0.7, top-k 20, top-p 0.8).

    # one H200, SmolLM2-135M's shape with random weights (step costs do not depend on the weights):
    python benchmarks/bench_slots_step.py --tokenizer runs/_assets/smollm2-135m-instruct-v2 \\
        --shapes 1024x640 1024x1152 2048x640
    # CPU smoke (no compile; not a speed claim):
    python benchmarks/bench_slots_step.py --tokenizer runs/_assets/smollm2-135m-instruct-v2 --device cpu \\
        --shapes 8x128 --repeats 2 --no-compile

Per shape: compile + CUDA-graph capture seconds, median ms per step over --repeats replays of `sync_every`
steps (each bracketed by a synchronisation), slot tokens/s (slots / step time: the engine's ceiling while every
slot is busy), and the bandwidth the step's key/value reads alone imply (every slot attends over the whole
cache: layers x 2 x slots x kv_heads x cache_len x head_dim x 2 bytes). Writes
benchmarks/results/slots_step_<device>.json (machine, versions, date, arguments, results).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_generation import device_slug, machine, random_model  # noqa: E402
from eqc_utils.devices import resolve_device  # noqa: E402
from eqc_utils.generation.slots import SlotDecoder  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_shape(text: str) -> tuple[int, int]:
    try:
        slots, cache_len = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes SLOTSxCACHE_LEN, e.g. 1024x640, not {text!r}") from None
    return slots, cache_len


def sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def measure(lm, slots: int, cache_len: int, args, device: str) -> dict:
    import torch
    decoder = SlotDecoder(lm, slots, cache_len, (0.7, 20, 0.8), sync_every=args.sync_every)
    decoder.positions.fill_(cache_len // 2)   # the cost does not depend on where the slots are: the mask is full-width
    started = time.perf_counter()
    if args.compile:
        decoder.compile()
    sync(device)
    compile_s = time.perf_counter() - started
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        decoder.decode()
        sync(device)
        times.append((time.perf_counter() - started) / args.sync_every)
    ms = statistics.median(times) * 1e3
    cfg = lm.config
    kv_bytes = cfg.num_hidden_layers * 2 * slots * cfg.num_key_value_heads * cache_len * decoder.cache.head_dim * lm.dtype.itemsize
    del decoder
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"slots": slots, "cache_len": cache_len, "compile_s": round(compile_s, 1), "ms_per_step": round(ms, 2),
            "slot_tok_s": round(slots / ms * 1e3), "kv_gb_s": round(kv_bytes / ms / 1e6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with SmolLM2's tokenizer files")
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[(1024, 640), (1024, 1152), (2048, 640)])
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    device = resolve_device(args.device)
    info = machine()
    folder = random_model("smollm2", args.tokenizer, Path(tempfile.mkdtemp(prefix="bench-slots-")) / "model")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    results = []
    print(f"| slots | cache | compile s | ms/step | slot tok/s | K/V GB/s |\n|---:|---:|---:|---:|---:|---:|")
    for slots, cache_len in args.shapes:
        r = measure(lm, slots, cache_len, args, device)
        results.append(r)
        print(f"| {r['slots']} | {r['cache_len']} | {r['compile_s']} | {r['ms_per_step']} | {r['slot_tok_s']} | "
              f"{r['kv_gb_s']} |", flush=True)
    command = " ".join([Path(sys.executable).name] + sys.argv)
    out = args.out or RESULTS_DIR / f"slots_step_{device_slug(device, info)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
                               "machine": info, "args": {k: str(v) if isinstance(v, Path) else v
                                                         for k, v in vars(args).items()},
                               "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
