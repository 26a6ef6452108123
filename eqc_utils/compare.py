"""Do two greedy runs give the same output, up to numerics?

Two implementations of the same model (a W4A16 kernel and its dense bf16 twin; speculative and plain
decoding) round differently. Where the greedy path passes a near-tie -- top-1 and top-2 almost equally
likely -- either token may come out, and the two outputs part from there on although nothing is wrong.
So outputs are compared by token ids, and a divergence is accepted as numerics only when the
*reference* run was nearly tied at the first differing position k: its top-1 minus top-2 log-probability
margin there is at most `near_tie_margin` nats. Anything else is a real mismatch: a clear choice that
changed, or one run ending (or going on) where the reference was not near a tie.

    reference = [complete_greedy(dense_url, p, 64, margins=True) for p in prompts]    # needs margins
    other = [complete_greedy(pack_url, p, 64) for p in prompts]                      # ids are enough
    result = compare_runs(prompts, reference, other, near_tie_margin=0.05, names=("dense", "pack"))
    assert result["passed"], result["summary"]

For the reference decoder (transformers), `teacher_forced_margins` gives a plain greedy run's margins
from one forward pass over prompt + output.
"""
from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from typing import Sequence

IDENTICAL, NEAR_TIE, MISMATCH = "identical", "near-tie", "mismatch"
TOKEN_ID_PREFIX = "token_id:"      # how vLLM names tokens with return_tokens_as_token_ids


@dataclass
class GreedyRun:
    """One greedy completion. `margins[i]`: top-1 minus top-2 log-probability (nats) of the
    distribution that produced `ids[i]` (None where unknown); needed for reference runs only."""
    ids: list[int]
    text: str = ""
    margins: list[float | None] | None = None
    seconds: float | None = None        # wall time of the request, when the run came from a server


@dataclass
class Verdict:
    """How a run compares with its reference. position: first differing token (0-based, counted from
    the first generated token); margin: the reference's top-1 minus top-2 log-prob there; the tokens
    there (None: that run had already ended)."""
    kind: str
    position: int | None = None
    margin: float | None = None
    reference_token: int | None = None
    other_token: int | None = None

    def describe(self, names: tuple[str, str] = ("reference", "other")) -> str:
        if self.kind == IDENTICAL:
            return IDENTICAL
        margin = "unknown" if self.margin is None else f"{self.margin:.3f} nats"
        return (f"{self.kind} at token {self.position}: {names[0]} {_token(self.reference_token)} vs "
                f"{names[1]} {_token(self.other_token)}, {names[0]} margin {margin}")


def _token(token_id: int | None) -> str:
    return "<end>" if token_id is None else str(token_id)


def judge(reference: GreedyRun, other: GreedyRun, near_tie_margin: float) -> Verdict:
    """The verdict for one prompt (see the module docstring for the rule)."""
    a, b = list(reference.ids), list(other.ids)
    if a == b:
        return Verdict(IDENTICAL)
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    margins = reference.margins or []
    margin = margins[k] if k < len(margins) and k < len(a) else None
    kind = NEAR_TIE if margin is not None and margin <= near_tie_margin else MISMATCH
    return Verdict(kind, k, margin, a[k] if k < len(a) else None, b[k] if k < len(b) else None)


def compare_runs(prompts: Sequence, reference: Sequence[GreedyRun], other: Sequence[GreedyRun],
                 near_tie_margin: float, names: tuple[str, str] = ("reference", "other"),
                 labels: Sequence[str] | None = None) -> dict:
    """Judge every prompt; return a JSON-ready summary:

    prompts, identical, near_tie, mismatch (counts), passed (no mismatch), all_identical,
    near_tie_margin, tally ("6/6 (1 near-tie)": prompts with the same output up to near-ties),
    summary (one line, for an assertion message), examples (one row per prompt: prompt, verdict,
    position, margin, the two tokens there and both texts, keyed by `names`).
    `labels` replace the prompts in the rows (e.g. readable text for token-id prompts)."""
    if not len(prompts) == len(reference) == len(other):
        raise ValueError(f"compare_runs: {len(prompts)} prompts, {len(reference)} reference runs, "
                         f"{len(other)} other runs")
    ref_name, other_name = names
    verdicts = [judge(r, o, near_tie_margin) for r, o in zip(reference, other)]
    count = {kind: sum(v.kind == kind for v in verdicts) for kind in (IDENTICAL, NEAR_TIE, MISMATCH)}
    n = len(verdicts)
    notes = [f"{count[kind]} {kind}" for kind in (NEAR_TIE, MISMATCH) if count[kind]]
    tally = f"{n - count[MISMATCH]}/{n}" + (f" ({', '.join(notes)})" if notes else "")
    summary = (f"{other_name} vs {ref_name}: {n - count[MISMATCH]}/{n} prompts give the same output "
               f"({count[IDENTICAL]} identical, {count[NEAR_TIE]} near-tie), {count[MISMATCH]} mismatch "
               f"(near-tie: {ref_name}'s top-1 minus top-2 log-prob <= {near_tie_margin} nats at the first "
               f"differing token)")
    first = next((i for i, v in enumerate(verdicts) if v.kind == MISMATCH), None)
    if first is not None:
        summary += f"; first mismatch: prompt {first}, {verdicts[first].describe(names)}"
    rows = []
    for i, (v, r, o) in enumerate(zip(verdicts, reference, other)):
        prompt = labels[i] if labels is not None else prompts[i]
        rows.append({"prompt": prompt, "verdict": v.kind, "position": v.position, "margin": v.margin,
                     f"{ref_name}_token": v.reference_token, f"{other_name}_token": v.other_token,
                     ref_name: r.text, other_name: o.text})
    return {"prompts": n, "identical": count[IDENTICAL], "near_tie": count[NEAR_TIE], "mismatch": count[MISMATCH],
            "passed": count[MISMATCH] == 0, "all_identical": count[IDENTICAL] == n,
            "near_tie_margin": near_tie_margin, "tally": tally, "summary": summary, "examples": rows}


# ---------------------------------------------------------------- runs from a vLLM server

def margins_from_top_logprobs(top_logprobs: Sequence[dict | None]) -> list[float | None]:
    """Top-1 minus top-2 log-prob per position from the OpenAI-style `top_logprobs` entries.

    vLLM puts the sampled token first and then the top-k (so k + 1 entries, or k where the sampled
    token is one of the top-k): the two largest values are the top-2 in either case."""
    out: list[float | None] = []
    for entry in top_logprobs:
        values = sorted((entry or {}).values(), reverse=True)
        out.append(values[0] - values[1] if len(values) >= 2 else None)
    return out


def run_from_completion(choice: dict) -> GreedyRun:
    """A GreedyRun from one choice of a vLLM /v1/completions reply requested with `return_token_ids`
    (ids in `token_ids`) or `return_tokens_as_token_ids` + `logprobs` (tokens as "token_id:123")."""
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        tokens = logprobs.get("tokens")
        if tokens is None or not all(str(t).startswith(TOKEN_ID_PREFIX) for t in tokens):
            raise ValueError("completion has no token ids: request return_token_ids, or logprobs together with "
                             "return_tokens_as_token_ids")
        ids = [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]
    top = logprobs.get("top_logprobs")
    margins = margins_from_top_logprobs(top) if top else None
    if margins is not None and len(margins) != len(ids):
        raise ValueError(f"completion has {len(ids)} token ids but {len(margins)} top_logprobs entries")
    return GreedyRun(ids=[int(i) for i in ids], text=choice.get("text", ""), margins=margins)


def complete_greedy(base_url: str, prompt: str | list[int], max_tokens: int, *, margins: bool = False,
                    model: str = "target", timeout: float = 600.0) -> GreedyRun:
    """One greedy completion from a vLLM server (`base_url` ends in /v1): token ids, text, and with
    `margins` the top-2 log-prob margin per position (vLLM's default logprobs mode gives the raw
    model log-probs, before greedy sampling's processing)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "top_k": 1,
            "return_token_ids": True}
    if margins:
        body.update(logprobs=2, return_tokens_as_token_ids=True)
    request = urllib.request.Request(base_url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        reply = json.loads(response.read())
    run = run_from_completion(reply["choices"][0])
    run.seconds = time.perf_counter() - started
    if margins and run.margins is None and run.ids:
        raise ValueError(f"{base_url}: asked for logprobs but the reply has no top_logprobs")
    return run


# ---------------------------------------------------------------- runs from a transformers model

def teacher_forced_margins(model, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[float]:
    """Top-1 minus top-2 log-prob (nats) of `model` at each output position, from one forward pass over
    prompt + output (the margins of a greedy run that produced `output_ids`). The log-prob margin is the
    logit margin: log-softmax subtracts the same constant from every logit of a position."""
    import torch

    if not output_ids:
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(output_ids)[:-1]], device=device)
    with torch.no_grad():
        try:
            logits = model(input_ids=ids, logits_to_keep=len(output_ids)).logits
        except TypeError:       # a model without logits_to_keep: all positions
            logits = model(input_ids=ids).logits
    top = logits[0, -len(output_ids):].float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()
