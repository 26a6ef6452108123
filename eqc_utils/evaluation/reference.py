"""Stage 09 on a machine without vLLM (`eval.backend: reference`): the same questions and prompts,
answered in-process, each result labelled `backend: reference`.

* gates: lm-eval's transformers model (`gates.run_gates(None, hf=...)`) on the teacher and on the
  target's dense twin (04: the values the W4A16 pack computes with). The final stack is not scored
  apart: greedy speculative decoding returns the target's own tokens (the static-cache decoder is
  exact in fp32, tests/test_fast_decode.py), so its answers are the target's.
* latency: per bucket, plain greedy against speculative decoding with the final drafter, both on the
  static-cache decoder (compiled on CUDA), over the same token-id prompts, exactly `max_tokens` new
  tokens per request (no stop token, as the served protocol's `ignore_eos`); medians in ms.
* acceptance: τ and per-position acceptance of the final drafter on the acceptance prompt sets
  (chat template, greedy, stops honoured), as vLLM's counters would give them.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Mapping

BACKEND = "reference"


def gates_hf(folder: str | Path, name: str, E: Mapping, out_dir: str | Path, device: str, dtype: str) -> dict:
    from eqc_utils.evaluation import gates
    result = gates.run_gates(None, name, tasks=E["gates"], limit=E["gate_limit"], out_dir=Path(out_dir) / "gates" / name,
                             source=E["gate_source"], mmlu_pro_file=E["mmlu_pro_file"], max_gen_toks=E["max_gen_toks"],
                             seed=E["gate_seed"], hf={"pretrained": str(folder), "device": device, "dtype": dtype,
                                                       "batch_size": E["num_concurrent"]})
    result["backend"] = BACKEND
    return result


def _decoder(target, drafter_dir: str | Path, max_len: int, compile_: bool):
    import torch
    from eqc_utils.drafter.decode import DFlashProposer
    from eqc_utils.drafter.fast_decode import FastSpeculativeDecoder
    from eqc_utils.drafter.model import load_drafter
    parameter = next(target.parameters())
    drafter = load_drafter(drafter_dir, device=parameter.device, dtype=parameter.dtype)
    with torch.no_grad():
        return FastSpeculativeDecoder(target, DFlashProposer(drafter, target), max_cache_len=max_len, compile=compile_)


def _timed(fn):
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    stats = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return stats, (time.perf_counter() - started) * 1000.0


def latency(target, drafter_dir: str | Path, prompts: Mapping, compile_: bool) -> dict:
    """{"autoregressive": {bucket: summary}, "speculative": {bucket: summary}} in the layout of
    `latency.measure_server`, for `latency.report`."""
    import torch
    from eqc_utils.drafter.fast_decode import cache_len_for, fast_greedy_generate

    longest = max(b["prompt_tokens"] for b in prompts["buckets"])
    most = max(b["max_tokens"] for b in prompts["buckets"])
    decoder = _decoder(target, drafter_dir, cache_len_for(longest, most, 64), compile_)
    servers = {"autoregressive": {}, "speculative": {}}
    with torch.no_grad():
        for bucket in prompts["buckets"]:
            name, new = bucket["name"], bucket["max_tokens"]
            runs = {"autoregressive": [], "speculative": []}
            for i, ids in enumerate(prompts["warmup"][name] + prompts["measured"][name]):
                plain, plain_ms = _timed(lambda: fast_greedy_generate(decoder.target, ids, new))
                spec, spec_ms = _timed(lambda: decoder.generate(ids, new))
                if i >= len(prompts["warmup"][name]):
                    runs["autoregressive"].append({"latency_ms": plain_ms, "completion_tokens": len(plain.output_ids)})
                    runs["speculative"].append({"latency_ms": spec_ms, "completion_tokens": len(spec.output_ids),
                                                "tau": spec.tau})
            for server, measured in runs.items():
                servers[server][name] = _summary(measured, bucket)
    return servers


def _summary(runs: list[dict], bucket: Mapping) -> dict:
    latencies = [r["latency_ms"] for r in runs]
    median = statistics.median(latencies) if latencies else None
    return {"prompt_tokens": bucket["prompt_tokens"], "max_tokens": bucket["max_tokens"], "n_ok": len(runs),
            "n_failed": 0, "failures": [], "median_latency_ms": median, "median_ttft_ms": None,
            "median_tokens_per_s": bucket["max_tokens"] / (median / 1000.0) if median else None,
            "median_decode_tokens_per_s": None, "runs": runs, "backend": BACKEND}


def acceptance(target, drafter_dir: str | Path, tokenizer, E: Mapping, stops: set[int], compile_: bool) -> dict:
    """τ per prompt set of `E["acceptance_datasets"]` (one warm-up prompt, then the measured ones), and
    their mean, in the layout of `acceptance.mean_acceptance_length`."""
    import torch
    from eqc_utils.drafter.fast_decode import cache_len_for
    from eqc_utils.conversation import render_prompt
    from eqc_utils.evaluation.acceptance import acceptance_prompts

    sets = {}
    for name in E["acceptance_datasets"]:
        texts = acceptance_prompts(name, E["acceptance_prompts"] + 1, tokenizer=tokenizer,
                                   context_tokens=E["acceptance_context_tokens"])
        sets[name] = [render_prompt(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    longest = max(len(ids) for ids in sum(sets.values(), []))
    decoder = _decoder(target, drafter_dir, cache_len_for(longest, E["acceptance_max_tokens"], 64), compile_)
    per_dataset = {}
    with torch.no_grad():
        for name, prompts in sets.items():
            decoder.generate(prompts[0], E["acceptance_max_tokens"], stops)            # warm-up
            steps = accepted = tokens = 0
            per_pos = None
            for ids in prompts[1:]:
                stats = decoder.generate(ids, E["acceptance_max_tokens"], stops)
                steps += len(stats.acceptance_lengths)
                accepted += sum(stats.acceptance_lengths) - len(stats.acceptance_lengths)
                tokens += len(stats.output_ids)
                per_pos = stats.accepted_at if per_pos is None else [a + b for a, b in zip(per_pos, stats.accepted_at)]
            per_dataset[name] = {"tau": 1.0 + accepted / steps if steps else None,
                                 "acceptance_rate": accepted / (steps * len(per_pos)) if steps and per_pos else None,
                                 "per_position": [a / steps for a in per_pos] if steps else [],
                                 "drafts": steps, "accepted": accepted, "n_prompts": len(prompts) - 1,
                                 "completion_tokens": tokens, "backend": BACKEND}
    taus = [r["tau"] for r in per_dataset.values() if r["tau"] is not None]
    return {"per_dataset": per_dataset, "mean_tau": sum(taus) / len(taus) if taus else None,
            "n_prompts": E["acceptance_prompts"], "max_tokens": E["acceptance_max_tokens"], "backend": BACKEND}
