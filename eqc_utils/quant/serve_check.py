"""Does vLLM serve the pack as the dense twin? Greedy completions of both, compared token for token.

The compressed-tensors pack runs vLLM's W4A16 kernel; the dense twin holds the same dequantised
weights as plain bf16 tensors. Equal greedy outputs on a set of prompts mean the pack is read as
written (codes, scales, group layout, ignore list). Servers are started one at a time through the
project's launcher (which kills them by PID on exit).
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path


def greedy_completions(model_dir: Path, prompts: list[str], max_tokens: int, vllm_args: dict,
                       log_dir: Path | None = None, device: str = "auto") -> list[str]:
    from eqc_utils.serving.launcher import VLLMServers

    outputs = []
    with VLLMServers(model_dir, n=1, served_name="target", extra_args=vllm_args, log_dir=log_dir,
                     device=device) as servers:
        url = servers.base_urls[0] + "/completions"
        for prompt in prompts:
            body = {"model": "target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "top_k": 1}
            request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                outputs.append(json.loads(response.read())["choices"][0]["text"])
    return outputs


def pack_serves_like_twin(ct_dir: Path, dense_dir: Path, prompts: list[str], max_tokens: int,
                          vllm_args: dict, log_dir: Path | None = None, device: str = "auto") -> dict:
    packed = greedy_completions(ct_dir, prompts, max_tokens, vllm_args, log_dir, device)
    dense = greedy_completions(dense_dir, prompts, max_tokens, vllm_args, log_dir, device)
    same = [a == b for a, b in zip(packed, dense)]
    return {"prompts": len(prompts), "identical": sum(same), "all_identical": all(same),
            "examples": [{"prompt": p, "pack": a, "dense": b} for p, a, b in zip(prompts, packed, dense)]}
