"""Does vLLM serve the target with our drafter (`--speculative-config {"method": "dflash", ...}`), losslessly,
with the acceptance the reference decoder measures?

Two servers in turn, through the project's launcher (killed by PID on exit): the target alone and
the target + drafter. Same token-id prompts, greedy. vLLM's mean acceptance length comes from its
Prometheus counters, 1 + accepted / drafts, read before and after the prompts (the server is idle
otherwise), as in the reference's MAL protocol (METHOD.md §5.3).
"""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def spec_counters(base_url: str) -> dict[str, float]:
    """Sums of vLLM's speculative-decoding counters over all label sets (0 when absent)."""
    metrics_url = base_url.rsplit("/v1", 1)[0] + "/metrics"
    with urllib.request.urlopen(metrics_url, timeout=60) as response:
        text = response.read().decode()
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if match and match.group(1) in totals:
            totals[match.group(1)] += float(match.group(3))
    return totals


def serve_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, vllm_args: dict,
                 drafter_dir: Path | None = None, num_speculative_tokens: int | None = None,
                 log_dir: Path | None = None, device: str = "auto") -> dict:
    """Greedy completions (text) of token-id prompts, sent one at a time, with each request's seconds and
    completion tokens; with a drafter also vLLM's mean acceptance length."""
    from eqc_utils.serving.launcher import VLLMServers

    args = dict(vllm_args)
    if drafter_dir is not None:
        args["speculative-config"] = {"method": "dflash", "model": str(drafter_dir),
                                      "num_speculative_tokens": num_speculative_tokens}
    with VLLMServers(model_dir, n=1, served_name="target", extra_args=args, log_dir=log_dir,
                     device=device) as servers:
        base = servers.base_urls[0]
        before = spec_counters(base) if drafter_dir is not None else None
        texts, seconds, tokens = [], [], []
        for ids in prompts:      # one request at a time: per-request latency, as the paper's latency protocol
            body = {"model": "target", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "top_k": 1}
            started = time.perf_counter()
            reply = _post(base + "/completions", body)
            seconds.append(time.perf_counter() - started)
            texts.append(reply["choices"][0]["text"])
            tokens.append(reply.get("usage", {}).get("completion_tokens"))
        result = {"texts": texts, "seconds": seconds, "completion_tokens": tokens}
        if before is not None:
            after = spec_counters(base)
            delta = {k.split(":")[1]: after[k] - before[k] for k in SPEC_COUNTERS}
            drafts = delta["spec_decode_num_drafts_total"]
            result["counters"] = delta
            result["mean_acceptance_length"] = (1 + delta["spec_decode_num_accepted_tokens_total"] / drafts
                                                if drafts else None)
    return result


def vllm_dflash_check(target_dir: Path, drafter_dir: Path, prompts: list[list[int]], max_tokens: int,
                      block_size: int, vllm_args: dict, log_dir: Path | None = None, device: str = "auto") -> dict:
    """Plain vs speculative greedy outputs on vLLM, and vLLM's mean acceptance length."""
    plain = serve_greedy(target_dir, prompts, max_tokens, vllm_args, log_dir=log_dir, device=device)
    spec = serve_greedy(target_dir, prompts, max_tokens, vllm_args, drafter_dir, block_size - 1, log_dir, device)
    same = [a == b for a, b in zip(plain["texts"], spec["texts"])]
    return {"prompts": len(prompts), "identical": sum(same), "all_identical": all(same),
            "vllm_tau": spec["mean_acceptance_length"], "counters": spec["counters"],
            "examples": [{"plain": a, "speculative": b} for a, b in zip(plain["texts"], spec["texts"])]}
