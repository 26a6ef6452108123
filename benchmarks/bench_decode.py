#!/usr/bin/env python
"""Batch-1 decoding cost of the reference decoder (eqc_utils/drafter/decode.py: eager transformers,
DynamicCache) against the static-cache, compiled one (eqc_utils/drafter/fast_decode.py), side by side in
one process.

    # one H200, SmolLM2-135M's shape with random weights (no download):
    python benchmarks/bench_decode.py --random smollm2 --context 1024 --block 16
    # a local target folder and a trained drafter (tau and speed-up measured on chat prompts):
    python benchmarks/bench_decode.py --target runs/_assets/smollm2-135m-instruct-v2 --drafter PATH/drafter
    # CPU smoke (seconds; not a speed claim):
    python benchmarks/bench_decode.py --random smollm2 --device cpu --context 128 --repeats 3 --new-tokens 16 --threads 1

Rows (milliseconds are medians over --repeats, each call bracketed by CUDA synchronisation):
  1-token step   eager HF + DynamicCache (decode.TargetSession), static cache eager, static cache compiled,
                 at --context tokens of context; the cache is rolled back after each call so the context
                 stays put
  verify         one forward over a --block-token block, eager and compiled; ratio to the 1-token step
  draft          one drafter block pass: eager DFlashProposer (DraftCache) and the fixed-shape, compiled
                 StaticDFlashProposer (a random drafter of --draft-layers layers unless --drafter)
  greedy         ms/token of plain decoding of --new-tokens tokens after the --context prompt:
                 decode.greedy_generate vs fast_greedy_generate ((t(N) - t(1)) / (N - 1): no prefill)
  GB/s           parameter bytes / step time: the weights' share of the memory traffic a step needs
  projected      without --drafter: speed-up of speculative decoding at tau = 2, 3, 4 from the step costs,
                 tau * plain_ms / (verify_ms + draft_ms), against fast plain and against eager plain decoding
  tau needed     the tau at which that projection reaches 1.0x (break-even), 1.5x and 2.0x fast plain
  loop step      the speculative loop's measured cost per step with the same drafter, host work included:
                 acceptance kept on the device (read every few steps) vs read after every step; and the tau
                 each needs for 1.0x, 1.5x and 2.0x fast plain
  speculative    with --drafter: measured tau, ms/token and speed-up on a few prompts (drafter/speedup.py,
                 compiled), and whether its ids equal fast greedy decoding's (bf16 may flip near-ties)
--compile auto compiles on CUDA only (inductor's C++ builds take minutes on a small CPU).
Writes benchmarks/results/decode_<device>.json (machine, versions, date, arguments, results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eqc_utils.devices import resolve_device  # noqa: E402
from eqc_utils.drafter.decode import DFlashProposer, TargetSession, greedy_generate  # noqa: E402
from eqc_utils.drafter.fast_decode import (FastSpeculativeDecoder, StaticDFlashProposer, StaticTarget,  # noqa: E402
                                           cache_len_for, fast_greedy_generate)
from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for, load_drafter  # noqa: E402
from eqc_utils.drafter.speedup import measure_speedup  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# SmolLM2-135M-Instruct's architecture (the teacher of the tiny and small profiles)
SHAPES = {"smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)}
QUESTIONS = ["Explain speculative decoding in two sentences.", "Write a Python function that reverses a list.",
             "What is the capital of France? Answer briefly.", "Give three tips for writing clear documentation."]


# ---------------------------------------------------------------- models
def build_target(args, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if args.target:
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, local_files_only=True)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.random]))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_drafter(args, target, device: str, dtype: torch.dtype) -> DFlashDrafter:
    if args.drafter:
        return load_drafter(args.drafter, device=device, dtype=dtype)
    cfg = drafter_config_for(target.config, num_layers=args.draft_layers, block_size=args.block,
                             target_layer_ids=None, mask_token_id=16)
    torch.manual_seed(0)
    return DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------- timing
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(call, device: str, repeats: int, warmup: int, after=None) -> float:
    """Median wall time of `call()` in ms; `after()` (untimed) restores the state between calls."""
    times = []
    for i in range(warmup + repeats):
        sync(device)
        started = time.perf_counter()
        call()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - started) * 1e3)
        if after is not None:
            after()
    return statistics.median(times)


def step_costs(target, drafter, prompt: list[int], args, device: str, compile: bool) -> tuple[dict, StaticTarget]:
    """Per-call costs at a fixed context: every call is undone before the next."""
    block, context = args.block, len(prompt)
    ids = lambda n: torch.full((1, n), 198, device=device)  # noqa: E731
    run = lambda call, after: median_ms(call, device, args.repeats, args.warmup, after)  # noqa: E731
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        eager = TargetSession(target, [])
        eager.forward(torch.tensor([prompt], device=device))
        eager_verify = TargetSession(target, layer_ids)
        eager_verify.forward(torch.tensor([prompt], device=device))
        out = {"eager_step_ms": run(lambda: eager.forward(ids(1)), lambda: eager.rewind(context, None)),
               "eager_verify_ms": run(lambda: eager_verify.forward(ids(block)),
                                      lambda: eager_verify.rewind(context, None))}
        del eager, eager_verify
    max_len = cache_len_for(context, args.new_tokens, block)
    if compile:
        static = StaticTarget(target, max_len, layer_ids, block)
        static.forward(torch.tensor([prompt], device=device))
        out["static_eager_step_ms"] = run(lambda: static.forward(ids(1)), lambda: static.rewind(context))
        del static
    fast = StaticTarget(target, max_len, layer_ids, block, compile=compile)
    fast.forward(torch.tensor([prompt], device=device))
    out["fast_step_ms"] = run(lambda: fast.forward(ids(1)), lambda: fast.rewind(context))
    out["fast_verify_ms"] = run(lambda: fast.forward(ids(block)), lambda: fast.rewind(context))

    feature = torch.zeros(1, 1, len(layer_ids) * target.config.hidden_size, device=device, dtype=target.dtype)
    cached = DFlashProposer(drafter, target)
    cached(198, context, feature.expand(1, context, -1))
    position = [context]

    def eager_draft():           # context grows by one per call: a negligible drift at 1K positions
        cached(198, position[0] + 1, feature)
        position[0] += 1
    out["eager_draft_ms"] = run(eager_draft, None)
    static_draft = StaticDFlashProposer(drafter, target, max_len, block, compile=compile)
    static_draft(198, context, feature.expand(1, context, -1))
    restart = lambda: setattr(static_draft, "length", context - 1)  # noqa: E731
    restart()
    out["fast_draft_ms"] = run(lambda: static_draft(198, context, feature), restart)
    return out, fast


def timed_generate(generate, prompt: list[int], n: int, device: str):
    """(seconds, result) of one generate(prompt, n) call, bracketed by device synchronisation."""
    sync(device)
    started = time.perf_counter()
    result = generate(prompt, n)
    sync(device)
    return time.perf_counter() - started, result


def greedy_ms_per_token(generate, prompt: list[int], args, device: str) -> float:
    """Median over repeats of (t(N tokens) - t(1 token)) / (N - 1), the two runs back to back: decoding cost
    without the prefill."""
    timed = lambda n: timed_generate(generate, prompt, n, device)[0]  # noqa: E731
    n = args.new_tokens
    timed(n)                                            # warm-up (compilation, graph capture)
    return statistics.median((timed(n) - timed(1)) * 1e3 / (n - 1) for _ in range(args.gen_repeats))


def loop_step_ms(target, drafter, fast: StaticTarget, prompt: list[int], args, device: str, compile: bool) -> dict:
    """The speculative loop's own cost per step (draft + verify + accept + commit, with the host's part), at the
    benchmark's context: median over repeats of (t(N tokens) - t(1 token)) / (steps of N), for the loop that
    keeps acceptance on the device and for the one that reads it after every step, side by side."""
    proposer = StaticDFlashProposer(drafter, target, fast.max_cache_len, args.block, compile=compile)
    decoder = FastSpeculativeDecoder(fast, proposer)
    out = {}
    for name, generate in (("on_device", decoder.generate_on_device), ("stepwise", decoder.generate_stepwise)):
        timed_generate(generate, prompt, args.new_tokens, device)     # warm-up (compilation, graph capture)
        per_step = []
        for _ in range(args.gen_repeats):
            (t_n, result), (t_1, _) = (timed_generate(generate, prompt, n, device) for n in (args.new_tokens, 1))
            per_step.append((t_n - t_1) * 1e3 / len(result.acceptance_lengths))
        out[name] = statistics.median(per_step)
    return out


def chat_prompts(args, target) -> tuple[list[list[int]], set[int]]:
    """Chat-templated questions when the target folder has a tokenizer, else the random context prompt."""
    try:
        from transformers import AutoTokenizer

        from eqc_utils.drafter.runs import prompt_ids, stop_ids
        tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
        rows = [{"conversations": [{"role": "user", "content": q}]} for q in QUESTIONS[:args.prompts]]
        return prompt_ids(tokenizer, rows), stop_ids(tokenizer, target.config)
    except Exception as error:      # no tokenizer (or --random): say so and fall back
        print(f"(no chat prompts: {type(error).__name__}: {error}; using random-token prompts)")
        return [], set()


def speculative_run(target, drafter, args, compile: bool, prompt) -> dict:
    """measure_speedup on the chat prompts (or the last 64 tokens of the random context)."""
    prompts, stops = chat_prompts(args, target) if args.target else ([], set())
    return measure_speedup(target, drafter, prompts or [prompt[-64:]], args.spec_tokens, stops, compile=compile,
                           near_tie_margin=args.near_tie_margin)


# ---------------------------------------------------------------- report
def table(r: dict, args, compile: bool) -> list[tuple[str, str, str]]:
    how, block = "compiled" if compile else "eager", args.block

    def ms(label: str, key: str, unit: str = "ms", bandwidth: bool = True):
        gbs = f"{r['param_bytes'] / (r[key] * 1e-3) / 1e9:8.1f} GB/s" if bandwidth else ""
        return label, f"{r[key]:8.3f} {unit}", gbs

    rows = [ms(f"1-token step, eager HF DynamicCache, context {args.context}", "eager_step_ms")]
    if "static_eager_step_ms" in r:
        rows.append(ms("1-token step, static cache, eager", "static_eager_step_ms"))
    rows += [ms(f"1-token step, static cache, {how}", "fast_step_ms"),
             ("  speed-up over eager HF", f"{r['eager_step_ms'] / r['fast_step_ms']:8.2f} x", ""),
             ms(f"verify {block} tokens, eager HF", "eager_verify_ms"),
             ms(f"verify {block} tokens, static cache, {how}", "fast_verify_ms"),
             (f"  verify {block} / 1-token step, {how}", f"{r['fast_verify_ms'] / r['fast_step_ms']:8.2f} x", ""),
             ms(f"draft pass, eager DraftCache, {r['draft_layers']} layer(s)", "eager_draft_ms", bandwidth=False),
             ms(f"draft pass, fixed shape, {how}", "fast_draft_ms", bandwidth=False),
             ms("plain greedy, decode.greedy_generate", "eager_greedy_ms", "ms/tok"),
             ms(f"plain greedy, fast_greedy_generate, {how}", "fast_greedy_ms", "ms/tok")]
    for tau, p in r["projected"].items():
        rows.append((f"projected speculative, tau {tau}", f"{p['ms_per_token']:8.3f} ms/tok",
                     f"{p['speedup_vs_fast_plain']:5.2f} x fast plain, {p['speedup_vs_eager_plain']:5.2f} x eager"))
    rows += [(f"tau needed for {x:.1f} x fast plain", f"{t:8.2f}", "") for x, t in r["tau_needed"].items()]
    for loop, step in r["loop_step_ms"].items():
        needed = ", ".join(f"{t:.2f} for {x:.1f}x" for x, t in r["tau_needed_in_loop"][loop].items())
        rows.append((f"speculative loop step, {loop.replace('_', ' ')}, {how}", f"{step:8.3f} ms", f"tau {needed}"))
    if "speculative" in r:
        s = r["speculative"]
        rows += [("speculative with the drafter: tau", f"{s['tau']:8.2f}", ""),
                 ("speculative with the drafter", f"{s['spec_ms_per_token']:8.3f} ms/tok",
                  f"{s['speedup']:5.2f} x fast plain ({s['plain_ms_per_token']:.3f}), "
                  f"same output {s['lossless']['tally']}")]
    return rows


def device_slug(device: str) -> str:
    return "cpu" if device == "cpu" else torch.cuda.get_device_name().lower().replace(" ", "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--target", help="a local HF model folder (attention-only: llama / qwen2 / qwen3)")
    which.add_argument("--random", choices=sorted(SHAPES), help="random weights of this shape (default: smollm2)")
    ap.add_argument("--drafter", help="a trained DFlash drafter folder (load_drafter); default: a random one, "
                                      "for step costs only")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="auto: on for CUDA only")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--draft-layers", type=int, default=1, help="layers of the random drafter")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls first (CUDA graphs record on the 2nd)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy ms/token over this many tokens")
    ap.add_argument("--gen-repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="chat prompts for the --drafter run")
    ap.add_argument("--spec-tokens", type=int, default=256, help="tokens per prompt in the --drafter run")
    ap.add_argument("--near-tie-margin", type=float, default=0.5,
                    help="nats: a speculative output that parts from plain decoding passes only at a near-tie")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/decode_<device>.json)")
    args = ap.parse_args()
    if not args.target and not args.random:
        args.random = "smollm2"
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    compile = args.compile == "on" or (args.compile == "auto" and device.startswith("cuda"))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = build_target(args, device, dtype)
    drafter = build_drafter(args, target, device, dtype)
    torch.manual_seed(0)
    prompt = torch.randint(100, target.config.vocab_size, (args.context,)).tolist()

    started = time.perf_counter()
    r, fast = step_costs(target, drafter, prompt, args, device, compile)
    r["param_bytes"] = sum(p.numel() * p.element_size() for p in target.parameters())
    r["draft_layers"] = drafter.config.num_layers
    with torch.no_grad():
        eager_plain, fast_plain = partial(greedy_generate, target), partial(fast_greedy_generate, fast)
        r["eager_greedy_ms"] = greedy_ms_per_token(eager_plain, prompt, args, device)
        r["fast_greedy_ms"] = greedy_ms_per_token(fast_plain, prompt, args, device)
    step = r["fast_verify_ms"] + r["fast_draft_ms"]
    r["projected"] = {tau: {"ms_per_token": step / tau, "speedup_vs_fast_plain": tau * r["fast_greedy_ms"] / step,
                            "speedup_vs_eager_plain": tau * r["eager_greedy_ms"] / step} for tau in (2, 3, 4)}
    # the tau a drafter must reach for a given speed-up over fast plain decoding, from the same step costs
    r["tau_needed"] = {speedup: speedup * step / r["fast_greedy_ms"] for speedup in (1.0, 1.5, 2.0)}
    r["loop_step_ms"] = loop_step_ms(target, drafter, fast, prompt, args, device, compile)
    # the same, from the loop as it runs: its step cost includes what the host adds between the two passes
    r["tau_needed_in_loop"] = {loop: {speedup: speedup * ms / r["fast_greedy_ms"] for speedup in (1.0, 1.5, 2.0)}
                               for loop, ms in r["loop_step_ms"].items()}
    if args.drafter:
        r["speculative"] = speculative_run(target, drafter, args, compile, prompt)
    r["bench_seconds"] = time.perf_counter() - started

    from importlib.metadata import version

    from eqc_utils.headline import describe_machine
    info = {"machine": describe_machine(), "device": torch.cuda.get_device_name() if device != "cpu" else "cpu",
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": version("transformers"), "dtype": str(dtype).replace("torch.", ""), "compile": compile,
            "model": args.target or f"random {args.random}",
            "drafter": args.drafter or f"random, {args.draft_layers} layers",
            "params": sum(p.numel() for p in target.parameters())}
    command = " ".join([Path(sys.executable).name] + sys.argv)
    print(f"\ncommand: {command}\n" + " | ".join(f"{k}: {v}" for k, v in info.items()) + "\n")
    rows = table(r, args, compile)
    width = max(len(k) for k, _, _ in rows)
    for key, value, extra in rows:
        print(f"{key:<{width}}  {value:>16}  {extra}".rstrip())
    out = args.out or RESULTS_DIR / f"decode_{device_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
                               **info, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "results": r}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
