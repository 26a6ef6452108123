"""A static-KV-cache, optionally compiled, speculative decoder for attention-only (Llama-type) targets:
the fast twin of `decode.py`, with the same outputs and statistics (batch 1).

`decode.py` runs transformers eagerly with a DynamicCache and pays a kernel launch per op: 25-40 ms a
step for a 135M target on an H200, where the arithmetic takes well under a millisecond. Here the target
writes into a preallocated `StaticCache` and its two hot shapes, the 1-token decode step and the
B-token verification, can be compiled with `torch.compile(mode="reduce-overhead")`, i.e. replayed as
CUDA graphs. The steps are those of decode.py, each a method that can be called and timed alone:

  prefill   target over the prompt (eager: its length varies) -> first token + context features
  draft     one drafter pass over [last token, MASK x (B-1)] -> B-1 draft logits
  verify    one target pass over the block -> logits and context features at every block position
  accept    greedy longest-prefix match + bonus token, or rejection sampling (decode.rejection_accept)
  commit    move the target's cache length back to the accepted prefix

Greedy decoding with the fixed-shape drafter runs these steps without a host read between them
(`FastSpeculativeDecoder.generate_on_device`: anchor, start and accepted count stay on the device; the
host reads the steps' tokens every few steps), so the host queues the next step while the device runs one.

Why rollback is only moving a length (transformers 5.16+, which no longer take `cache_position`):
each `StaticLayer` writes new keys at its own `cumulative_length` counter, and the causal mask puts the
queries at that same counter, so a key at or past the counter is either masked (after the query) or
rewritten in this very forward before attention reads it. Setting every layer's counter back therefore
forgets the rejected drafts. Recurrent layers (Qwen3.5's Gated DeltaNet) hold a running state that
no length can rewind: those targets are refused here and keep `decode.speculative_generate`.

Context features: the drafter reads the outputs of decoder layers `target_layer_ids` (layer i's output,
i.e. `hidden_states[i + 1]`, as `features.capture_layers` hooks them). transformers' own
`output_hidden_states` breaks the compiled graph (a lock and a ContextVar in its capture hooks) and
replaces the last layer's entry with the final-norm output, so the target forward is written out here
(embed -> mask -> rope -> layers -> norm -> head, the same calls as LlamaModel.forward) and keeps the
chosen layers' outputs on the way.
"""
from __future__ import annotations

import inspect
import time

import torch
from torch import nn

from eqc_utils.drafter.decode import (AcceptanceReport, DFlashProposer, DraftFn, DecodeResult, _pick, _probs,
                                      greedy_loop, pooled_report, rejection_accept)
from eqc_utils.drafter.features import input_embedding, output_head
from eqc_utils.drafter.model import DFlashDrafter
from eqc_utils.generation import slots

# Decoders whose forward is embed -> causal mask -> rope -> layers -> norm, with one full-attention mask.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
def cache_len_for(prompt_len: int, max_new_tokens: int, block_size: int = 1) -> int:
    """Room for the prompt, every token generated and one block verified past the last one (rounded up as the
    slots engine rounds, so nearby budgets share compiled graphs)."""
    return slots.cache_len_for(prompt_len, max_new_tokens + block_size)


class UnsupportedTargetError(ValueError):
    """The target is not an attention-only decoder this module can run (use decode.py for it)."""


def check_supported(target: nn.Module) -> None:
    """Raise (naming the model type) unless `target` is an attention-only decoder this module can run."""
    cfg = target.config.get_text_config(decoder=True)
    kind = getattr(cfg, "model_type", type(target).__name__)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    recurrent = sorted({t for t in layer_types if "attention" not in t or t.startswith("linear")})
    if recurrent:
        raise UnsupportedTargetError(
            f"fast_decode: the target ({kind}) has recurrent layers ({', '.join(recurrent)}), whose state a static "
            "KV cache cannot roll back; use eqc_utils.drafter.decode.speculative_generate / greedy_generate "
            "(DynamicCache with state snapshots) for it")
    if kind not in SUPPORTED_MODEL_TYPES or any(t != "full_attention" for t in layer_types):
        raise UnsupportedTargetError(
            f"fast_decode: supports attention-only {'/'.join(SUPPORTED_MODEL_TYPES)} targets with full attention in "
            f"every layer, not {kind} (layer types {sorted(set(layer_types)) or 'unset'}); use "
            "eqc_utils.drafter.decode.speculative_generate")


def _mask_options() -> dict:
    from transformers.masking_utils import create_causal_mask
    known = inspect.signature(create_causal_mask).parameters
    return {"allow_is_causal_skip": False} if "allow_is_causal_skip" in known else {}


_ALWAYS_MATERIALISE = _mask_options()


def _compile(fn, how: bool | str):
    """`how`: True = inductor with CUDA graphs ("reduce-overhead"); a string = that torch.compile backend
    (e.g. "aot_eager": the same tracing and functionalisation, no code generation; for tests)."""
    # CUDA graphs need fixed shapes: dynamic=False gives one graph per input shape (1 and B tokens)
    if isinstance(how, str):
        return torch.compile(fn, backend=how, fullgraph=False, dynamic=False)
    return torch.compile(fn, mode="reduce-overhead", fullgraph=False, dynamic=False)


class StaticTarget:
    """The target with a preallocated KV cache of `max_cache_len` positions, for one sequence at a time.

    `forward(ids)` appends ids at the current length; `rewind(n)` forgets everything from position n on.
    With `compile`, forwards of 1 and of `block_size` tokens run compiled (CUDA graphs on a GPU); other
    lengths (the prompt) run eagerly. One StaticTarget serves many prompts (`reset`), so its compiled
    graphs are built once."""

    def __init__(self, target: nn.Module, max_cache_len: int, layer_ids=(), block_size: int = 1,
                 compile: bool | str = False):
        from transformers import StaticCache
        check_supported(target)
        self.target, self.layer_ids = target.eval(), list(layer_ids)
        self.max_cache_len, self.block_size = max_cache_len, block_size
        self.device = next(target.parameters()).device
        self.cache = StaticCache(config=target.config, max_cache_len=max_cache_len)
        if not all(hasattr(layer, "cumulative_length") for layer in self.cache.layers):
            raise RuntimeError("fast_decode relies on StaticLayer.cumulative_length (transformers 5.16-5.19): "
                               "this transformers' StaticCache keeps its length elsewhere")
        self.length = 0
        self.compiled = _compile(self._forward, compile) if compile else None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor):
        """LlamaModel.forward + lm_head, keeping the outputs of the chosen layers on the way."""
        from transformers.masking_utils import create_causal_mask
        decoder = self.target.get_decoder()
        hidden = decoder.embed_tokens(ids)
        # always a materialised mask: the "plain causal, let sdpa's is_causal do it" shortcut tests the
        # cache length (a tensor) in Python, which breaks the compiled graph of the B-token verify
        mask = create_causal_mask(config=decoder.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=self.cache, position_ids=positions, **_ALWAYS_MATERIALISE)
        rope = decoder.rotary_emb(hidden, positions)
        kept = {}
        for i, layer in enumerate(decoder.layers[: decoder.config.num_hidden_layers]):
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions,
                           past_key_values=self.cache, use_cache=True)
            if i in self.layer_ids:
                kept[i] = hidden
        logits = self.target.lm_head(decoder.norm(hidden)).float()
        features = torch.cat([kept[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        return logits, features

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `ids` [1, T]; returns (logits [1, T, V] fp32, features [1, T, F] or None)."""
        n = ids.shape[1]
        if self.length is None:
            raise RuntimeError("StaticTarget: after forward_at its length lives on the device; call rewind(n) or "
                               "reset() before forward")
        if self.length + n > self.max_cache_len:
            raise ValueError(f"StaticTarget: {self.length} + {n} tokens exceed max_cache_len={self.max_cache_len}")
        positions = torch.arange(self.length, self.length + n, device=self.device)[None]
        logits, features = self._run(ids, positions, graphable=self.length > 0)
        self.length += n
        return logits, features

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, graphable: bool = True):
        """The compiled graph for the 1- and B-token shapes (not for a prompt: `graphable` False), else eager."""
        if self.compiled is not None and ids.shape[1] in (1, self.block_size) and graphable:
            torch.compiler.cudagraph_mark_step_begin()
            logits, features = self.compiled(ids, positions)
            # graph outputs live in memory the next replay overwrites
            return logits.clone(), None if features is None else features.clone()
        return self._forward(ids, positions)

    @torch.no_grad()
    def forward_at(self, ids: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` with the position held on the device (a 0-dim long tensor): the cache is cut back to
        `start` and `ids` [1, T] go there, with no host read. The caller keeps start + T within
        max_cache_len: past it the cache write fails on the device, not here."""
        n = ids.shape[1]
        self.rewind(start)
        logits, features = self._run(ids, (start + torch.arange(n, device=self.device))[None])
        self.length = None                      # known on the device only, until the next rewind(int)
        return logits, features

    def rewind(self, length: int | torch.Tensor) -> None:
        """Forget positions >= length: keys there are masked, then overwritten (module docstring)."""
        for layer in self.cache.layers:
            if isinstance(layer.cumulative_length, torch.Tensor):
                layer.cumulative_length.fill_(length)   # in place: compiled graphs hold its address
            else:
                layer.cumulative_length = length
        self.length = length

    def reset(self) -> None:
        self.rewind(0)


class StaticDFlashProposer(DraftFn):
    """`decode.DFlashProposer` with fixed shapes, so the block pass can be compiled.

    DFlashProposer keeps a DraftCache that grows by a variable number of keys per step (torch.cat),
    which CUDA graphs cannot replay. Here the verified context features go into a preallocated
    [1, max_len, F] buffer and every step runs the drafter over the whole buffer plus the block, with a
    mask hiding positions >= start: one shape for the whole generation. The price is re-projecting the
    context each step (O(max_len) rows through `fc` and the drafter's k/v projections, no cache): a few
    GFLOP at 1K context for a SmolLM2-sized drafter, noise next to a launch-bound eager step, but it
    grows with the context. Drafts equal DFlashProposer's up to float rounding."""

    def __init__(self, drafter: DFlashDrafter, target: nn.Module, max_len: int, block_size: int | None = None,
                 compile: bool | str = False):
        self.drafter, self.target, self.max_len = drafter.eval(), target, max_len
        self.block_size = block_size or drafter.block_size
        self.target_layer_ids = drafter.config.target_layer_ids
        self.features: torch.Tensor | None = None   # [1, max_len, F], allocated at the first call
        self.length = 0                             # context positions in the buffer
        self.compiled = _compile(self._block_pass, compile) if compile else None

    @classmethod
    def like(cls, proposer: DFlashProposer, max_len: int, compile: bool | str = False) -> "StaticDFlashProposer":
        return cls(proposer.drafter, proposer.target, max_len, proposer.block_size, compile)

    def reset(self) -> None:
        self.length = 0

    def _block_pass(self, anchor: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        device, block = anchor.device, self.block_size
        masks = torch.full((block - 1,), self.drafter.mask_token_id, device=device, dtype=anchor.dtype)
        embeds = input_embedding(self.target)(torch.cat([anchor, masks])[None])
        slots = torch.arange(self.max_len, device=device)
        positions = torch.cat([slots, start + torch.arange(block, device=device)])[None]
        visible = torch.cat([slots < start, torch.ones(block, dtype=torch.bool, device=device)])
        mask = visible.expand(1, 1, block, -1)
        hidden = self.drafter(embeds, self.features, positions, mask=mask)
        return output_head(self.target)(hidden[0, 1:]).float()

    def _buffer_for(self, new_context: torch.Tensor) -> None:
        if self.features is None or self.features.dtype != new_context.dtype:
            self.features = new_context.new_zeros(1, self.max_len, new_context.shape[-1])
            torch._dynamo.mark_static_address(self.features)   # updated in place, read by the graph

    @torch.no_grad()
    def draft_at(self, anchor: torch.Tensor, start: torch.Tensor, context: torch.Tensor,
                 context_at: torch.Tensor) -> torch.Tensor:
        """`__call__` with everything on the device: anchor [1], start and context_at 0-dim long tensors.
        All rows of `context` [1, n, F] are written from `context_at` on, also those past `start` (a
        verified block's rejected tail): the mask hides positions >= start, and the next block's context
        overwrites them. Same drafts as `__call__`, with no host read."""
        self._buffer_for(context)
        rows = context_at + torch.arange(context.shape[1], device=context.device)
        self.features.index_copy_(1, rows, context)
        self.length = None                      # the host no longer tracks it (see __call__)
        return self._run(anchor, start)

    def _run(self, anchor: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        if self.compiled is None:
            return self._block_pass(anchor, start)
        torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(anchor, start).clone()

    @torch.no_grad()
    def __call__(self, anchor_token: int, start: int, new_context: torch.Tensor) -> torch.Tensor:
        self._buffer_for(new_context)
        n = new_context.shape[1]
        if self.length + n != start or start > self.max_len:
            raise ValueError(f"StaticDFlashProposer: context {self.length} + {n} != block start {start} "
                             f"or past max_len {self.max_len}")
        self.features[:, self.length:start] = new_context
        self.length = start
        device = new_context.device
        return self._run(torch.tensor([anchor_token], device=device), torch.tensor(start, device=device))


class FastSpeculativeDecoder:
    """Speculative decoding on a StaticTarget; `generate` = decode.speculative_generate, step by step.
    Build once, call `generate` for many prompts of up to `max_cache_len - max_new_tokens - B` tokens."""

    def __init__(self, target: nn.Module | StaticTarget, proposer: DraftFn, max_cache_len: int | None = None,
                 compile: bool | str = False):
        self.block = proposer.block_size
        if not isinstance(target, StaticTarget):
            if max_cache_len is None:
                raise ValueError("FastSpeculativeDecoder: give max_cache_len (see cache_len_for) or a StaticTarget")
            target = StaticTarget(target, max_cache_len, proposer.target_layer_ids, self.block, compile)
        elif target.block_size != self.block or target.layer_ids != list(proposer.target_layer_ids):
            raise ValueError("FastSpeculativeDecoder: the StaticTarget's block_size / layer_ids differ from the "
                             "drafter's")
        if compile and isinstance(proposer, DFlashProposer):   # its growing DraftCache cannot be graphed
            proposer = StaticDFlashProposer.like(proposer, target.max_cache_len, compile=compile)
        self.target, self.proposer = target, proposer
        self.device = target.device

    # --- the named steps -------------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh sequence: (logits after the prompt [V], context features of the prompt [1, P, F])."""
        self.target.reset()
        self.proposer.reset()
        logits, features = self.target.forward(torch.tensor([prompt_ids], device=self.device))
        return logits[0, -1], features

    def draft(self, token: int, start: int, new_context: torch.Tensor) -> torch.Tensor:
        """Draft logits [B-1, V] for the block anchored at `token`, at position `start`."""
        return self.proposer(token, start, new_context)

    def verify(self, token: int, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Target over [token, drafts]: (block ids [1, B], logits [B, V], features [1, B, F])."""
        block_ids = torch.cat([torch.tensor([token], device=self.device), drafts])[None]
        logits, features = self.target.forward(block_ids)
        return block_ids, logits[0], features

    @staticmethod
    def accept(drafts: torch.Tensor, logits: torch.Tensor, temperature: float = 0.0,
               draft_probs: torch.Tensor | None = None, generator=None) -> tuple[int, int]:
        """(drafts accepted, next token): greedy prefix match + bonus, or rejection sampling."""
        if temperature > 0:
            return rejection_accept(drafts, draft_probs, _probs(logits, temperature), generator)
        predicted = logits.argmax(-1)
        accepted = (drafts == predicted[:-1]).int().cumprod(0).sum()
        accepted, next_token = torch.stack([accepted, predicted[accepted]]).tolist()   # one host sync
        return accepted, next_token

    def commit(self, start: int, committed: int, features: torch.Tensor) -> torch.Tensor:
        """Keep anchor + accepted drafts in the target's cache; their features are the drafter's new context."""
        self.target.rewind(start + committed)
        return features[:, :committed]

    # --- the loops --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset(),
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> DecodeResult:
        """Greedy decoding with the fixed-shape drafter runs `generate_on_device` (same ids and statistics);
        sampling, and drafters without `draft_at`, run the named steps with one host read per step."""
        if temperature == 0 and isinstance(self.proposer, StaticDFlashProposer):
            return self.generate_on_device(prompt_ids, max_new_tokens, stop_ids)
        return self.generate_stepwise(prompt_ids, max_new_tokens, stop_ids, temperature, generator)

    @torch.no_grad()
    def generate_on_device(self, prompt_ids: list[int], max_new_tokens: int,
                           stop_ids: set[int] = frozenset()) -> DecodeResult:
        """Greedy speculative decoding whose steps never wait for the host: the anchor, the block start, the
        accepted count and the drafter's new context stay on the device, and the host reads the steps'
        (target argmaxes, accepted) every STEPS_PER_READ steps, so it queues step t+1 while the device runs
        step t. The emitted tokens of a step are the target's argmaxes up to the accepted count (the
        accepted drafts equal them), then the bonus. Steps queued past a stop or the budget are discarded
        work; statistics count the steps up to the finishing one, as generate_stepwise does."""
        block = self.block
        stats = _empty_stats(block)
        started = time.perf_counter()
        if max_new_tokens <= 0:
            return stats
        logits, context = self.prefill(prompt_ids)
        token = logits.argmax(-1).view(1)
        out = [int(token)]                      # the one read outside the steps: the first token
        finished = out[0] in stop_ids or len(out) >= max_new_tokens
        known_start = len(prompt_ids)           # block start after the steps read so far
        start = torch.tensor(known_start, device=self.device)
        context_at = torch.zeros((), dtype=torch.long, device=self.device)
        pending: list[torch.Tensor] = []        # per queued step: [target argmax x B, accepted]
        while not finished:
            # each queued step moves the start by at most B: read first if another could pass the cache's end
            if pending and (len(pending) == STEPS_PER_READ or len(out) + len(pending) >= max_new_tokens
                            or known_start + block * (len(pending) + 1) > self.target.max_cache_len):
                for row in torch.stack(pending).tolist():
                    accepted, tokens = row[-1], row[:row[-1] + 1]
                    _count(stats, accepted, block)
                    emitted, finished = _emit(tokens, out, max_new_tokens, stop_ids)
                    out += emitted
                    known_start += accepted + 1
                    if finished:
                        break
                pending = []
                continue
            if known_start + block > self.target.max_cache_len:
                raise ValueError(f"FastSpeculativeDecoder: a block at {known_start} passes max_cache_len="
                                 f"{self.target.max_cache_len}; size the cache with cache_len_for")
            drafts = self.proposer.draft_at(token, start, context, context_at).argmax(-1)
            logits, features = self.target.forward_at(torch.cat([token, drafts])[None], start)
            predicted = logits[0].argmax(-1)
            accepted = (drafts == predicted[:-1]).long().cumprod(0).sum()
            pending.append(torch.cat([predicted, accepted.view(1)]))
            token = predicted.gather(0, accepted.view(1))    # gather, not [accepted]: indexing would read it
            context, context_at = features, start
            start = start + accepted + 1
        stats.output_ids = out
        stats.seconds = time.perf_counter() - started
        return stats

    @torch.no_grad()
    def generate_stepwise(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset(),
                          temperature: float = 0.0, generator: torch.Generator | None = None) -> DecodeResult:
        """The named steps in turn, the host reading (accepted, next token) after every verification."""
        block = self.block
        stats = _empty_stats(block)
        started = time.perf_counter()
        if max_new_tokens <= 0:
            return stats
        logits, new_context = self.prefill(prompt_ids)
        token = _pick(logits, temperature, generator)
        out = [token]
        finished = token in stop_ids or len(out) >= max_new_tokens
        start = len(prompt_ids)                 # position of `token`, the next block's anchor
        while not finished:
            draft_logits = self.draft(token, start, new_context)
            draft_probs = _probs(draft_logits, temperature) if temperature > 0 else None
            drafts = (torch.multinomial(draft_probs, 1, generator=generator)[:, 0] if temperature > 0
                      else draft_logits.argmax(-1))
            _, logits, features = self.verify(token, drafts)
            accepted, next_token = self.accept(drafts, logits, temperature, draft_probs, generator)
            _count(stats, accepted, block)
            emitted, finished = _emit(drafts[:accepted].tolist() + [next_token], out, max_new_tokens, stop_ids)
            out += emitted
            if finished:
                break                           # nothing after this step is needed: skip the commit
            new_context = self.commit(start, accepted + 1, features)
            start += accepted + 1
            token = next_token
        stats.output_ids = out
        stats.seconds = time.perf_counter() - started
        return stats


def _empty_stats(block: int) -> DecodeResult:
    return DecodeResult([], accepted_at=[0] * (block - 1), drafted_at=[0] * (block - 1))


STEPS_PER_READ = 4   # generate_on_device: speculative steps queued between two host reads


def _count(stats: DecodeResult, accepted: int, block: int) -> None:
    """vLLM's count: every draft the target accepted, whatever the stop/budget trims afterwards."""
    for k in range(block - 1):
        stats.drafted_at[k] += 1
        stats.accepted_at[k] += int(k < accepted)
    stats.acceptance_lengths.append(accepted + 1)


def _emit(tokens: list[int], out: list[int], max_new_tokens: int, stop_ids) -> tuple[list[int], bool]:
    """The step's tokens up to and including the first stop, within the budget; and whether decoding
    ends here (plain decoding would have ended at whichever comes first)."""
    room = max_new_tokens - len(out)
    stop_at = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    if stop_at is not None and stop_at < room:
        return tokens[:stop_at + 1], True
    if len(tokens) >= room:
        return tokens[:room], True
    return tokens, False


# --- entry points ----------------------------------------------------------------------------------

def _static_target(target, prompt_len: int, max_new_tokens: int, layer_ids=(), block_size: int = 1,
                   compile: bool | str = False) -> StaticTarget:
    if isinstance(target, StaticTarget):
        return target
    return StaticTarget(target, cache_len_for(prompt_len, max_new_tokens, block_size), layer_ids, block_size, compile)


@torch.no_grad()
def fast_greedy_generate(target: nn.Module | StaticTarget, prompt_ids: list[int], max_new_tokens: int,
                         stop_ids: set[int] = frozenset(), temperature: float = 0.0,
                         generator: torch.Generator | None = None, compile: bool | str = False) -> DecodeResult:
    """decode.greedy_generate on a static cache (the speed-up baseline). Pass a StaticTarget to reuse its
    cache and compiled graphs across calls; an nn.Module gets a fresh one sized for this call."""
    session = _static_target(target, len(prompt_ids), max_new_tokens, compile=compile)
    session.reset()
    return greedy_loop(session, prompt_ids, max_new_tokens, stop_ids, temperature, generator, session.device)


def fast_speculative_generate(target: nn.Module | StaticTarget, proposer: DraftFn, prompt_ids: list[int],
                              max_new_tokens: int, stop_ids: set[int] = frozenset(), temperature: float = 0.0,
                              generator: torch.Generator | None = None, compile: bool | str = False) -> DecodeResult:
    """decode.speculative_generate on a static cache. For many prompts build one FastSpeculativeDecoder
    (or call measure_acceptance_fast), which keeps its cache and compiled graphs."""
    session = _static_target(target, len(prompt_ids), max_new_tokens, proposer.target_layer_ids,
                             proposer.block_size, compile)
    return FastSpeculativeDecoder(session, proposer, compile=compile).generate(
        prompt_ids, max_new_tokens, stop_ids, temperature, generator)


def measure_acceptance_fast(target: nn.Module, proposer: DraftFn, prompts: list[list[int]], max_new_tokens: int,
                            stop_ids: set[int] = frozenset(), temperature: float = 0.0, seed: int = 0,
                            progress: bool = True, compile: bool | str = False) -> AcceptanceReport:
    """decode.measure_acceptance on one cache sized for the longest prompt, reset between prompts, so
    compiled graphs are built once."""
    from tqdm.auto import tqdm
    longest = max((len(p) for p in prompts), default=1)
    decoder = FastSpeculativeDecoder(target, proposer, cache_len_for(longest, max_new_tokens, proposer.block_size),
                                     compile=compile)
    generator = torch.Generator(device=decoder.device).manual_seed(seed)
    started = time.perf_counter()
    results = [decoder.generate(ids, max_new_tokens, stop_ids, temperature, generator)
               for ids in tqdm(prompts, desc="acceptance", leave=False, disable=not progress)]
    return pooled_report(results, time.perf_counter() - started)
