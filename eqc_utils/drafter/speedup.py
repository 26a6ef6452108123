"""Wall-clock speed-up of speculative greedy decoding over plain greedy decoding, batch 1.

Both decoders run on one static-cache target (fast_decode.StaticTarget: the same cache and, on CUDA, the same
compiled graphs), over the same prompts with the same token budget. Each prompt is decoded twice by each
decoder and the second pair is timed: the first pays compilation and CUDA-graph capture. The speculative
output is judged against plain decoding by the near-tie rule of eqc_utils.compare (bf16 kernels of different
shapes may flip a near-tied token; anything else is a mismatch).

    report = measure_speedup(target, drafter, prompts, 256, stops, compile=True, near_tie_margin=0.5)
    report["speedup"], report["tau"], report["lossless"]["tally"]
"""
from __future__ import annotations

import statistics

import torch
from torch import nn

from eqc_utils.compare import GreedyRun, compare_runs, teacher_forced_margins
from eqc_utils.drafter.decode import DFlashProposer
from eqc_utils.drafter.fast_decode import FastSpeculativeDecoder, StaticTarget, cache_len_for, fast_greedy_generate
from eqc_utils.drafter.model import DFlashDrafter


def _synced(device: torch.device, call):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result


@torch.no_grad()
def measure_speedup(target: nn.Module, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
                    stop_ids: set[int] = frozenset(), *, compile: bool | str = False, near_tie_margin: float = 0.5,
                    progress: bool = True) -> dict:
    """Plain vs speculative greedy decoding of every prompt, side by side. Returns a JSON-ready dict:
    prompts (one row each: prompt_tokens, tokens, tau, plain_ms_per_token, spec_ms_per_token), the medians of
    tau and of both ms/token, speedup (median plain ms/token / median speculative ms/token), and lossless
    (compare_runs of speculative against plain; plain's margins from one teacher-forced pass where they
    differ)."""
    from tqdm.auto import tqdm
    if not prompts:
        raise ValueError("measure_speedup: no prompts")
    device = next(target.parameters()).device
    proposer = DFlashProposer(drafter, target)
    longest = max(len(p) for p in prompts)
    session = StaticTarget(target, cache_len_for(longest, max_new_tokens, proposer.block_size),
                           proposer.target_layer_ids, proposer.block_size, compile)
    decoder = FastSpeculativeDecoder(session, proposer, compile=compile)
    rows, plain_runs, spec_runs = [], [], []
    for ids in tqdm(prompts, desc="speed-up", leave=False, disable=not progress):
        for _ in range(2):          # the first pair pays compilation and graph capture
            plain = _synced(device, lambda: fast_greedy_generate(session, ids, max_new_tokens, stop_ids))
            spec = _synced(device, lambda: decoder.generate(ids, max_new_tokens, stop_ids))
        rows.append({"prompt_tokens": len(ids), "tokens": len(spec.output_ids), "tau": spec.tau,
                     "plain_ms_per_token": plain.seconds * 1e3 / max(1, len(plain.output_ids)),
                     "spec_ms_per_token": spec.seconds * 1e3 / max(1, len(spec.output_ids))})
        margins = (teacher_forced_margins(target, ids, plain.output_ids)
                   if spec.output_ids != plain.output_ids else None)
        plain_runs.append(GreedyRun(plain.output_ids, margins=margins))
        spec_runs.append(GreedyRun(spec.output_ids))
    median = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    lossless = compare_runs([f"prompt {i}" for i in range(len(prompts))], plain_runs, spec_runs, near_tie_margin,
                            names=("plain", "speculative"))
    lossless.pop("examples")
    return {"prompts": rows, "tau": median("tau"), "plain_ms_per_token": median("plain_ms_per_token"),
            "spec_ms_per_token": median("spec_ms_per_token"),
            "speedup": median("plain_ms_per_token") / median("spec_ms_per_token"),
            "compiled": bool(compile), "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
            "max_new_tokens": max_new_tokens, "lossless": lossless}
