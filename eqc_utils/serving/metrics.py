"""vLLM's Prometheus `/metrics`: parsing, and the speculative-decoding counters (drafts, draft tokens,
accepted tokens, accepted per draft position) with the acceptance they imply. Used by the acceptance
measurement of stage 09 and by the vLLM checks of stages 07/08 (eqc_utils.evaluation.acceptance
explains the formulas)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

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
        """By metric name (the three totals)."""
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
