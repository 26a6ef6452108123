"""Greedy speculative decoding of many prompts at once, for measuring tau: the batched twin of
`fast_decode.FastSpeculativeDecoder` (same tokens, same acceptance counts), for attention-only targets.

The batch-1 decoders spend a τ pass mostly waiting on kernel launches and the host: one prompt, one block, a
few milliseconds of arithmetic per step at best. Here `slots` prompts decode side by side, each at its own
position, on the target's `generation.slots.SlotCache` (one static KV cache row per prompt) and a drafter
context buffer of the same rows; a prompt that ends hands its row to the next one. One step for every row:

  draft    the drafter over [anchor, MASK x (B-1)] of every row, its context the row's target features at
           positions < start (one fixed shape: the whole buffer, masked per row)
  verify   the target over [anchor, drafts] at positions start .. start + B - 1 of every row
  accept   per row: longest prefix of drafts equal to the target's argmax, plus the bonus token
  commit   per row: start moves past the accepted tokens. Nothing is copied back or cut: the target's keys and
           the drafter's context features at rejected positions are hidden by the masks and overwritten by the
           next step, which starts at or before them

With `compile`, draft, verify and accept run as one compiled step (one shape), replayed from a CUDA graph on
a GPU; only the per-row counts and tokens go to the host each step. Temperature 0 only (tau is measured
greedy everywhere in this project); `measure_acceptance_batched` pools the counts exactly as
`decode.measure_acceptance` does.
"""
from __future__ import annotations

import time
from collections import deque

import torch
from torch import nn

from eqc_utils.drafter.decode import AcceptanceReport, DecodeResult, DFlashProposer, pooled_report
from eqc_utils.drafter.fast_decode import _count, _emit, cache_len_for
from eqc_utils.drafter.features import input_embedding, output_head
from eqc_utils.generation.slots import SlotCache, capture


class BatchedSpeculativeDecoder:
    """`slots` rows of greedy DFlash speculative decoding over one target (see the module doc)."""

    def __init__(self, target: nn.Module, proposer: DFlashProposer, slots: int, max_len: int, *,
                 compile: bool = False, graphs: bool | None = None):
        self.drafter, self.block = proposer.drafter.eval(), proposer.block_size
        self.target = target
        self.slots, self.max_len = slots, max_len
        self.cache = SlotCache(target, slots, max_len, keep_layers=proposer.target_layer_ids)
        device = self.device = self.cache.device
        self.features = None                          # [slots, max_len, F], made at the first prefill
        self.anchors = torch.zeros(slots, dtype=torch.long, device=device)
        self.starts = torch.zeros(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        self.accepted = torch.zeros(slots, dtype=torch.long, device=device)
        self.emitted = torch.zeros(slots, self.block, dtype=torch.long, device=device)   # drafts[:acc] + bonus
        self.compile, self.graphs = compile, (device.type == "cuda" if graphs is None else graphs) and compile
        self._step_fn, self._graph = self._step, None

    # ---------------------------------------------------------------- one step of every row
    def _draft(self):
        block = self.block
        masks = torch.full((self.slots, block - 1), self.drafter.mask_token_id, device=self.device)
        embeds = input_embedding(self.target)(torch.cat([self.anchors[:, None], masks], dim=1))
        context = torch.arange(self.max_len, device=self.device)
        positions = torch.cat([context.expand(self.slots, -1),
                               self.starts[:, None] + torch.arange(block, device=self.device)], dim=1)
        visible = torch.cat([context[None] < self.starts[:, None],
                             torch.ones(self.slots, block, dtype=torch.bool, device=self.device)], dim=1)
        hidden = self.drafter(embeds, self.features, positions, mask=visible[:, None, None].expand(-1, 1, block, -1))
        return output_head(self.target)(hidden[:, 1:]).argmax(-1)                 # [slots, B-1]

    def _step(self):
        drafts = self._draft()
        hidden, features = self.cache.forward(torch.cat([self.anchors[:, None], drafts], dim=1), self.starts)
        predicted = self.cache.logits(hidden).argmax(-1)                           # [slots, B]
        accepted = (drafts == predicted[:, :-1]).long().cumprod(1).sum(1)
        bonus = predicted.gather(1, accepted[:, None])
        keep = torch.arange(self.block - 1, device=self.device)[None] < accepted[:, None]
        emitted = torch.cat([torch.where(keep, drafts, 0), torch.zeros_like(bonus)], dim=1)
        emitted.scatter_(1, accepted[:, None], bonus)
        return accepted, emitted, bonus[:, 0], features

    def _advance(self):
        accepted, emitted, bonus, features = self._step_fn()
        # the block's features go to its positions; those past the accepted prefix stay hidden until rewritten
        rows = torch.arange(self.slots, device=self.device)[:, None]
        spots = (self.starts[:, None] + torch.arange(self.block, device=self.device)).clamp_(max=self.max_len - 1)
        self.features[rows, spots] = features.to(self.features.dtype)
        self.accepted.copy_(accepted)
        self.emitted.copy_(emitted)
        self.anchors.copy_(bonus)
        # idle rows stay at 0 so they never run past the buffer
        self.starts.copy_(torch.where(self.active, self.starts + accepted + 1, 0).clamp_(max=self.max_len - self.block))

    def step(self) -> tuple[list[int], list[list[int]]]:
        """One step of every row; (accepted drafts per row, emitted tokens per row: drafts[:acc] + bonus)."""
        if self.compile and self._step_fn is self._step:
            self._build()
        if self._graph is not None:
            self._graph.replay()
        else:
            with torch.inference_mode():
                self._advance()
        return self.accepted.tolist(), self.emitted.tolist()

    def _build(self) -> None:
        self._step_fn = torch.compile(self._step, dynamic=False, fullgraph=True)
        if self.graphs:
            self._graph = capture(self._advance, (self.anchors, self.starts, self.active, self.features))

    # ---------------------------------------------------------------- rows in and out
    def prefill(self, rows: list[int], prompts: list[list[int]]) -> list[int]:
        """Start `prompts` in `rows`: their keys, their context features, their first (greedy) token."""
        logits, features = self.cache.prefill(rows, prompts)
        with torch.inference_mode():
            if self.features is None:
                self.features = torch.zeros(self.slots, self.max_len, features[0].shape[-1], device=self.device,
                                            dtype=features[0].dtype)
            for row, feats in zip(rows, features):
                self.features[row, :feats.shape[0]] = feats
            first = logits.argmax(-1)
            index = torch.tensor(rows, device=self.device)
            self.anchors[index] = first
            self.starts[index] = torch.tensor([len(p) for p in prompts], device=self.device)
            self.active[index] = True
        return first.tolist()

    def release(self, row: int) -> None:
        self.active[row] = False


def measure_acceptance_batched(target: nn.Module, proposer: DFlashProposer, prompts: list[list[int]],
                               max_new_tokens: int, stop_ids: set[int] = frozenset(), *, slots: int = 32,
                               compile: bool = False, progress: bool = True) -> AcceptanceReport:
    """`decode.measure_acceptance` at temperature 0 with `slots` prompts decoding at once: the same report
    (pooled tau, per-position acceptance, per-prompt tau in prompt order)."""
    started = time.perf_counter()
    results = speculative_generate_batched(target, proposer, prompts, max_new_tokens, stop_ids, slots=slots,
                                           compile=compile, progress=progress)
    return pooled_report(results, time.perf_counter() - started)


def speculative_generate_batched(target: nn.Module, proposer: DFlashProposer, prompts: list[list[int]],
                                 max_new_tokens: int, stop_ids: set[int] = frozenset(), *, slots: int = 32,
                                 compile: bool = False, progress: bool = True) -> list[DecodeResult]:
    """Greedy speculative decoding of every prompt, `slots` at a time: per prompt the DecodeResult that
    `fast_decode.fast_speculative_generate` gives (same ids and counts; tests/test_batched_decode.py, fp32)."""
    from tqdm.auto import tqdm
    block = proposer.block_size
    results = [DecodeResult([], accepted_at=[0] * (block - 1), drafted_at=[0] * (block - 1)) for _ in prompts]
    queue = deque(sorted(range(len(prompts)), key=lambda j: -len(prompts[j])))
    if max_new_tokens <= 0 or not queue:
        return results
    slots = min(slots, len(queue))
    # two blocks past the last token: a finished row's last block may still be written before it is released
    max_len = cache_len_for(len(prompts[queue[0]]), max_new_tokens, 2 * block)
    decoder = BatchedSpeculativeDecoder(target, proposer, slots, max_len, compile=compile)
    held: list[int | None] = [None] * slots
    free = list(range(slots))
    bar = tqdm(total=len(prompts), desc="acceptance (batched)", leave=False, disable=not progress)
    with torch.no_grad():
        while queue or any(j is not None for j in held):
            while free and queue:      # new prompts into free rows; a prompt can end at its first token
                taken = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                rows, free = free[:len(taken)], free[len(taken):]
                for row, j, first in zip(rows, taken, decoder.prefill(rows, [prompts[j] for j in taken])):
                    results[j].output_ids = [first]
                    if first in stop_ids or max_new_tokens <= 1:
                        decoder.release(row)
                        free.append(row)
                        bar.update(1)
                    else:
                        held[row] = j
            if not any(j is not None for j in held):
                continue
            accepted, emitted = decoder.step()
            for row, j in enumerate(held):
                if j is None:
                    continue
                out = results[j].output_ids
                _count(results[j], accepted[row], block)
                tokens, finished = _emit(emitted[row][:accepted[row] + 1], out, max_new_tokens, stop_ids)
                out += tokens
                if finished:
                    decoder.release(row)
                    held[row] = None
                    free.append(row)
                    bar.update(1)
    bar.close()
    return results

