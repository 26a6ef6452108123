"""A small reference speculative decoder for DFlash drafters (batch 1, PyTorch, CPU or CUDA), used to
measure acceptance during training and to check losslessness. Named steps, as in gpt-fast:

  prefill   target over the prompt -> first token + context features of the prompt
  draft     one drafter pass fills block = [last token, MASK x (B-1)] -> B-1 draft tokens
  verify    one target pass over the block -> its prediction at every block position
  accept    greedy: longest prefix where draft k == target's argmax after k-1, plus the target's
            bonus token; sampling: rejection sampling (accept x with prob min(1, p/q), else resample
            from norm(max(p - q, 0))), which leaves the output distributed exactly as the target's
  commit    keep the accepted positions in the target's cache, drop the rest

Output: exactly what plain decoding (`greedy_generate`) gives, including where it ends: the first stop
token is the last token emitted, wherever it lands in a step (prefill token, an accepted draft, the
bonus), and at most max_new_tokens tokens are emitted; the step in which either happens is the last.

tau (mean acceptance length) = accepted drafts + 1 (the bonus) per verification step, 1 <= tau <= B,
counted as vLLM counts it (1 + accepted / drafts): the last step counts every draft the target accepted,
even when its output is cut by max_new_tokens or by a stop token among them (vLLM's scheduler records
the accepted drafts before it checks for stops and trims the step's tokens).

Targets with recurrent layers (Qwen3.5's Gated DeltaNet) keep a running state that a KV-cache crop
cannot rewind: before each verification we snapshot those states; after a partial acceptance we
restore them, crop the attention layers, and re-run just the accepted tokens through the target.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from eqc_utils.drafter.features import capture_layers, input_embedding, output_head
from eqc_utils.drafter.model import DFlashDrafter, DraftCache


@dataclass
class DecodeResult:
    """One decoded sequence: its new token ids, and per verification step how many tokens were accepted."""
    output_ids: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted drafts + bonus, per verification step
    accepted_at: list[int] = field(default_factory=list)        # accepted_at[k-1]: steps whose draft k was accepted
    drafted_at: list[int] = field(default_factory=list)         # drafted_at[k-1]: steps that verified a draft k
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))


class TargetSession:
    """The target's cache for one sequence, with rollback that also works for recurrent layers."""

    def __init__(self, target: nn.Module, layer_ids: list[int]):
        from transformers import DynamicCache
        self.target, self.layer_ids = target, layer_ids
        self.cache = DynamicCache(config=target.config)
        self.length = 0

    def _recurrent_layers(self):
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
        return [layer for layer in self.cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `ids` [1, T]; returns (logits [1, T, V], context features [1, T, F])."""
        positions = torch.arange(self.length, self.length + ids.shape[1], device=ids.device)[None]
        if not self.layer_ids:      # plain decoding needs no features
            out = self.target(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True)
            self.length += ids.shape[1]
            return out.logits.float(), None
        with capture_layers(self.target, self.layer_ids) as hidden:
            out = self.target(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True)
        self.length += ids.shape[1]
        return out.logits.float(), torch.cat(hidden, dim=-1)

    def snapshot(self):
        """Copies of the recurrent states (small, fixed size); attention layers need none (crop)."""
        return [({i: s.clone() for i, s in layer.conv_states.items() if s is not None},
                 {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None})
                for layer in self._recurrent_layers()]

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self._recurrent_layers())

    def rewind(self, length: int, snapshot) -> None:
        """Back to `length` tokens: crop attention caches; restore recurrent states from `snapshot`
        (taken when the cache held `snapshot_length` tokens; the caller re-runs the gap)."""
        from transformers.cache_utils import DynamicLayer
        remove = self.length - length
        if remove > 0:
            for layer in self.cache.layers:
                if isinstance(layer, DynamicLayer) and layer.is_initialized:
                    DynamicLayer.crop(layer, -remove)
        for layer, (conv, recurrent) in zip(self._recurrent_layers(), snapshot or []):
            for i, s in conv.items():
                layer.conv_states[i] = s.clone()
            for i, s in recurrent.items():
                layer.recurrent_states[i] = s.clone()
        self.length = length


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def rejection_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling over one block. draft_tokens [K], draft_probs [K, V] (the distribution each
    was sampled from), target_probs [K + 1, V] (target after the anchor, after draft 1, ...).
    Returns (number accepted, next token): the resampled token at the first rejection, else a bonus
    sample from the last target distribution."""
    for k in range(draft_tokens.shape[0]):
        x = draft_tokens[k]
        p, q = target_probs[k, x], draft_probs[k, x]
        u = torch.rand((), generator=generator, device=p.device)
        if u * q <= p:          # accept with probability min(1, p/q)
            continue
        residual = (target_probs[k] - draft_probs[k]).clamp_min(0)
        total = residual.sum()
        residual = residual / total if total > 0 else target_probs[k]
        return k, int(torch.multinomial(residual, 1, generator=generator))
    return draft_tokens.shape[0], int(torch.multinomial(target_probs[-1], 1, generator=generator))


def _pick(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(_probs(logits, temperature), 1, generator=generator))


@torch.no_grad()
def greedy_generate(target: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: set[int] = frozenset(), temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> DecodeResult:
    """Plain decoding, one target forward per token (the baseline speculative decoding must match)."""
    session = TargetSession(target, [])
    return greedy_loop(session, prompt_ids, max_new_tokens, stop_ids, temperature, generator,
                       next(target.parameters()).device)


STOP_CHECK_EVERY = 8   # greedy_loop: decoding steps between two reads of the chosen tokens by the host


def greedy_loop(session, prompt_ids: list[int], max_new_tokens: int, stop_ids, temperature: float, generator,
                device) -> DecodeResult:
    """One target forward per token on any session with `forward(ids) -> (logits, features)` (this
    module's DynamicCache session, fast_decode's static one)."""
    started = time.perf_counter()
    if max_new_tokens <= 0:
        return DecodeResult([], acceptance_lengths=[], seconds=0.0)
    logits, _ = session.forward(torch.tensor([prompt_ids], device=device))
    out: list[int] = []
    if temperature > 0:
        while len(out) < max_new_tokens:
            token = _pick(logits[0, -1], temperature, generator)
            out.append(token)
            if token in stop_ids or len(out) == max_new_tokens:
                break
            logits, _ = session.forward(torch.tensor([[token]], device=device))
        return DecodeResult(out, acceptance_lengths=[1] * len(out), seconds=time.perf_counter() - started)
    # greedy: the chosen token stays on the device and feeds the next step; the host reads the tokens (and looks
    # for a stop id) only every STOP_CHECK_EVERY steps, so it queues step t+1 while the device still runs step t.
    # Steps after a stop id are wasted work (fewer than STOP_CHECK_EVERY) and cut from the output.
    pending: list[torch.Tensor] = []
    while len(out) < max_new_tokens:
        token = logits[0, -1].argmax().view(1, 1)
        pending.append(token)
        if len(pending) == STOP_CHECK_EVERY or len(out) + len(pending) == max_new_tokens:
            values, pending = torch.cat(pending).flatten().tolist(), []
            stop = next((i for i, value in enumerate(values) if value in stop_ids), None)
            out += values if stop is None else values[:stop + 1]
            if stop is not None:
                break
        if len(out) < max_new_tokens:
            logits, _ = session.forward(token)
    return DecodeResult(out, acceptance_lengths=[1] * len(out), seconds=time.perf_counter() - started)


class DraftFn(Protocol):
    """What the decoder asks of a drafter: given the new context features and the block start,
    return draft logits for block slots 1..B-1. DFlashProposer wraps a trained DFlashDrafter."""
    block_size: int
    target_layer_ids: list[int]

    def reset(self) -> None: ...

    def __call__(self, anchor_token: int, start: int, new_context: torch.Tensor) -> torch.Tensor: ...


class DFlashProposer(DraftFn):
    def __init__(self, drafter: DFlashDrafter, target: nn.Module, block_size: int | None = None):
        self.drafter, self.target = drafter.eval(), target
        self.block_size = block_size or drafter.block_size
        self.target_layer_ids = drafter.config.target_layer_ids
        self.cache = DraftCache()

    def reset(self) -> None:
        self.cache = DraftCache()

    def __call__(self, anchor_token: int, start: int, new_context: torch.Tensor) -> torch.Tensor:
        device = new_context.device
        block = torch.full((1, self.block_size), self.drafter.mask_token_id, device=device)
        block[0, 0] = anchor_token
        embeds = input_embedding(self.target)(block)
        ctx_start = self.cache.length
        positions = torch.cat([torch.arange(ctx_start, start, device=device),
                               torch.arange(start, start + self.block_size, device=device)])[None]
        hidden = self.drafter(embeds, new_context, positions, cache=self.cache)
        return output_head(self.target)(hidden[0, 1:]).float()


@torch.no_grad()
def speculative_generate(target: nn.Module, proposer: DraftFn, prompt_ids: list[int], max_new_tokens: int,
                         stop_ids: set[int] = frozenset(), temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> DecodeResult:
    device = next(target.parameters()).device
    block = proposer.block_size
    session = TargetSession(target, proposer.target_layer_ids)
    proposer.reset()
    stats = DecodeResult([], accepted_at=[0] * (block - 1), drafted_at=[0] * (block - 1))
    started = time.perf_counter()

    if max_new_tokens <= 0:
        return stats
    # prefill: context features of the prompt, first token from the target
    logits, new_context = session.forward(torch.tensor([prompt_ids], device=device))
    token = _pick(logits[0, -1], temperature, generator)
    out = [token]
    finished = token in stop_ids or len(out) >= max_new_tokens
    start = len(prompt_ids)                 # position of `token`, the next block's anchor
    while not finished:
        # draft
        draft_logits = proposer(token, start, new_context)
        if temperature > 0:
            draft_probs = _probs(draft_logits, temperature)
            drafts = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        else:
            drafts = draft_logits.argmax(-1)
        # verify
        snapshot = session.snapshot() if session.has_recurrent_state else None
        block_ids = torch.cat([torch.tensor([token], device=device), drafts])[None]
        logits, features = session.forward(block_ids)
        # accept
        if temperature > 0:
            accepted, next_token = rejection_accept(drafts, draft_probs, _probs(logits[0], temperature), generator)
        else:
            predicted = logits[0].argmax(-1)
            matches = (drafts == predicted[:-1]).int()
            accepted = int(matches.cumprod(0).sum())
            next_token = int(predicted[accepted])
        committed = accepted + 1
        # stats, vLLM-style: everything the target accepted in this step, whatever is emitted below
        for k in range(block - 1):
            stats.drafted_at[k] += 1
            stats.accepted_at[k] += int(k < accepted)
        stats.acceptance_lengths.append(committed)
        # emit: accepted drafts + the next token, up to and including the first stop token, within the
        # budget; plain decoding would have ended at whichever of the two comes first
        emitted = drafts[:accepted].tolist() + [next_token]
        room = max_new_tokens - len(out)
        stop_at = next((i for i, t in enumerate(emitted) if t in stop_ids), None)
        if stop_at is not None and stop_at < room:
            emitted, finished = emitted[:stop_at + 1], True
        elif len(emitted) >= room:
            emitted, finished = emitted[:room], True
        out += emitted
        if finished:
            break                           # nothing after this step is needed: skip the commit
        # commit: anchor + accepted drafts are now verified context; the next token is the new anchor
        if committed < block:
            if snapshot is not None:
                session.rewind(start, snapshot)
                _, features = session.forward(block_ids[:, :committed])
            else:
                session.rewind(start + committed, None)
        new_context = features[:, :committed]
        start += committed
        token = next_token
    stats.output_ids = out
    stats.seconds = time.perf_counter() - started
    return stats


@dataclass
class AcceptanceReport:
    tau: float
    steps: int                                # verification steps
    tokens: int                               # generated tokens
    acceptance_per_position: list[float]      # P(draft k accepted), k = 1..B-1
    per_prompt_tau: list[float]
    seconds: float
    per_prompt_steps: list[int] = field(default_factory=list)  # verification steps of each prompt

    def tau_by_group(self, groups: list[str]) -> dict[str, float]:
        """tau pooled within each group of prompts (groups[i]: prompt i's group, e.g. its data category), as the
        whole report pools over all prompts: summed acceptance lengths / verification steps."""
        if len(groups) != len(self.per_prompt_steps):
            raise ValueError(f"tau_by_group: {len(groups)} groups for {len(self.per_prompt_steps)} prompts")
        lengths: dict[str, float] = {}
        steps: dict[str, int] = {}
        for group, tau, n in zip(groups, self.per_prompt_tau, self.per_prompt_steps):
            lengths[group] = lengths.get(group, 0.0) + tau * n
            steps[group] = steps.get(group, 0) + n
        return {group: lengths[group] / max(1, steps[group]) for group in sorted(lengths)}


def measure_acceptance(target: nn.Module, proposer: DraftFn, prompts: list[list[int]], max_new_tokens: int,
                       stop_ids: set[int] = frozenset(), temperature: float = 0.0, seed: int = 0,
                       progress: bool = True) -> AcceptanceReport:
    """tau over several prompts: summed acceptance lengths / verification steps (pooled, as vLLM's
    1 + accepted / drafts), with per-position acceptance rates."""
    from tqdm.auto import tqdm
    generator = torch.Generator(device=next(target.parameters()).device).manual_seed(seed)
    started = time.perf_counter()
    results = [speculative_generate(target, proposer, ids, max_new_tokens, stop_ids, temperature, generator)
               for ids in tqdm(prompts, desc="acceptance", leave=False, disable=not progress)]
    return pooled_report(results, time.perf_counter() - started)


def pooled_report(results: list[DecodeResult], seconds: float) -> AcceptanceReport:
    """The prompts' counts pooled: summed acceptance lengths / verification steps, per-position rates."""
    steps = sum(len(r.acceptance_lengths) for r in results)
    lengths = sum(sum(r.acceptance_lengths) for r in results)
    accepted = [sum(col) for col in zip(*(r.accepted_at for r in results))]
    drafted = [sum(col) for col in zip(*(r.drafted_at for r in results))]
    rates = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
    return AcceptanceReport(lengths / max(1, steps), steps, sum(len(r.output_ids) for r in results), rates,
                            [r.tau for r in results], seconds, [len(r.acceptance_lengths) for r in results])
