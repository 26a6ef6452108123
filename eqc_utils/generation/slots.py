"""Engine `slots`: continuous batching inside one fixed, compiled shape, for attention-only decoders
(Llama, Qwen2, Qwen3: the small profile's SmolLM2 teacher and its QAD twin).

Why a fourth engine. The `static` engine decodes batches to their end: with the small teacher's answers
(median ~200 of 384 tokens) half of a batch's places decode finished answers, and its rounds bring new
cache sizes that the compiled step records again. transformers' own continuous batcher frees places at
once but runs eagerly on a paged cache (11x slower than `static` without flash attention). Here a fixed
number of *slots* share one static KV cache (per layer `[slots, kv_heads, cache_len, head_dim]`); each slot
holds its own sequence at its own position, so one compiled decoding step serves every mix of lengths:

  prefill  new sequences, right-padded, through the same layers (eager: their widths vary), their keys and
           values written into the free slots, their first token sampled from the last prompt position
  decode   `sync_every` steps of all slots, captured once as one CUDA graph: per slot, the token at its own
           position (RoPE from a precomputed table, keys and values written at that position, attention
           masked to the slot's positions), then sampling (temperature, top-k, top-p over the k best)
  collect  one copy of the new tokens to the host; answers that ended (end-of-sequence token or budget)
           are emitted and their slots go to the next prompts

A finished slot keeps decoding until the next collect (at most `sync_every` - 1 wasted steps). A slot's
stale keys past its position are harmless: the mask hides them until a decoding step overwrites them.

Greedy answers equal each prompt's unbatched `generate` (tests/test_generation.py, fp32); sampled answers
follow the same distribution as the other engines (not the same draws: the tokens are drawn by an
exponential race, which compiles into the step).
"""
from __future__ import annotations

import logging
import sys
import time
from collections import deque

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
CACHE_ROUND = 128          # cache lengths are rounded up to this, so nearby lengths share compiled graphs
PREFILL_TOKENS = 65_536    # padded prompt tokens per prefill forward (bounds its activations)


class UnsupportedModelError(ValueError):
    """The model is not an attention-only decoder the slots engine can run."""


def check_supported(lm) -> None:
    cfg = lm.config.get_text_config(decoder=True)
    kind = getattr(cfg, "model_type", type(lm).__name__)
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kind not in SUPPORTED_MODEL_TYPES or layer_types != {"full_attention"} or getattr(cfg, "sliding_window", None) \
            and getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"generation.hf_engine 'slots' runs attention-only {'/'.join(SUPPORTED_MODEL_TYPES)} decoders with full "
            f"attention in every layer, not {kind} (layer types {sorted(layer_types)}); set generation.hf_engine: "
            "static (or generate) for this model")


def check_cache_fits(nbytes: int, slots: int, cache_len: int, device) -> None:
    """Refuse, naming the settings to change, a key/value cache larger than 90% of the memory free for it."""
    import psutil
    import torch
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if nbytes > 0.9 * free:
        raise ValueError(f"generation.hf_batch_size: {slots} slots x {cache_len} positions (longest prompt + "
                         f"generation.max_tokens) need {nbytes / 2**30:.1f} GiB of key/value cache, {free / 2**30:.1f} "
                         f"GiB are free on {device}; lower generation.hf_batch_size (or prompts.max_prompt_tokens, "
                         "generation.max_tokens)")


def cache_len_for(longest_prompt: int, max_tokens: int) -> int:
    return -(-(longest_prompt + max_tokens) // CACHE_ROUND) * CACHE_ROUND


def sample(logits, temperature: float, top_k: int, top_p: float):
    """Next token of each row: argmax at temperature 0; else temperature, the k best, top-p over them (the rule
    of `hf.TopKTopP`: a token stays while the mass of the better ones is below top_p, the best always), and a
    draw by exponential race (argmax of p / E, E ~ Exp(1), picks token i with probability p_i)."""
    import torch
    if temperature <= 0:
        return logits.argmax(-1)
    k = min(top_k, logits.shape[-1]) if top_k > 0 else logits.shape[-1]
    values, index = (logits.float() / temperature).topk(k, dim=-1)
    probs = values.softmax(-1)
    if top_p < 1.0:
        keep = probs.cumsum(-1) - probs < top_p
        keep[..., 0] = True
        probs = probs * keep
    race = probs / torch.empty_like(probs).exponential_()
    return index.gather(-1, race.argmax(-1, keepdim=True)).squeeze(-1)


class SlotCache:
    """A decoder's layers over a static KV cache of `slots` rows, each row one sequence at its own position:
    `forward` runs W new tokens of every row at that row's positions, `prefill` writes whole prompts into chosen
    rows. `keep_layers`: decoder layers whose outputs `forward` and `prefill` also return (a drafter's context
    features). Used by `SlotDecoder` (W = 1) and by the batched speculative decoder (W = the block)."""

    def __init__(self, lm, slots: int, cache_len: int, keep_layers=()):
        import torch
        check_supported(lm)
        self.lm, self.slots, self.cache_len, self.keep_layers = lm.eval(), slots, cache_len, list(keep_layers)
        decoder = lm.get_decoder()
        self.layers = list(decoder.layers)
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.heads, self.kv_heads = lm.config.num_attention_heads, lm.config.num_key_value_heads
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        weight = next(lm.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        # one tensor per layer: a write into a slice of one [layers, ...] tensor made the compiled step copy the
        # whole cache at every layer (one H200: 178 ms a step against 23.5 eager)
        shape = (slots, self.kv_heads, cache_len, self.head_dim)
        check_cache_fits(2 * len(self.layers) * slots * self.kv_heads * cache_len * self.head_dim * self.dtype.itemsize,
                         slots, cache_len, self.device)
        self.keys = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.values = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        with torch.no_grad():
            positions = torch.arange(cache_len, device=self.device)[None]
            cos, sin = decoder.rotary_emb(self.keys[0][:1, 0], positions)
        self.cos, self.sin = cos[0], sin[0]                                   # [cache_len, head_dim]

    def _layer(self, i: int, layer, hidden, cos, sin, attend):
        """One decoder layer; `attend(layer index, q, k, v)` reads and writes the cache."""
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        batch, width, _ = x.shape
        q = attn.q_proj(x).view(batch, width, self.heads, self.head_dim)
        k = attn.k_proj(x).view(batch, width, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(batch, width, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):   # Qwen3 normalises each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [batch, heads, width, head_dim]
        context = attend(i, q, k, v.transpose(1, 2))
        hidden = hidden + attn.o_proj(context.transpose(1, 2).reshape(batch, width, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _run(self, ids, cos, sin, attend):
        import torch
        hidden, kept = self.lm.get_decoder().embed_tokens(ids), {}
        for i, layer in enumerate(self.layers):
            hidden = self._layer(i, layer, hidden, cos, sin, attend)
            if i in self.keep_layers:
                kept[i] = hidden
        return hidden, torch.cat([kept[i] for i in self.keep_layers], dim=-1) if kept else None

    def logits(self, hidden):
        """Output logits of last-layer hidden states."""
        return self.lm.lm_head(self.lm.get_decoder().norm(hidden))

    def forward(self, ids, starts):
        """`ids` [slots, W] at positions starts[s] .. starts[s] + W - 1 of every row: their keys and values are
        written there and query j of row s sees that row's positions <= starts[s] + j (what lies beyond is stale
        and hidden). Returns (last-layer hidden [slots, W, H], kept-layer features [slots, W, F] or None)."""
        import torch
        import torch.nn.functional as F
        slots, width = ids.shape
        group = self.heads // self.kv_heads
        positions = starts[:, None] + torch.arange(width, device=self.device)         # [slots, W]
        cos, sin = self.cos[positions], self.sin[positions]                           # [slots, W, head_dim]
        rows = torch.arange(slots, device=self.device)[:, None]
        visible = torch.arange(self.cache_len, device=self.device) <= positions[:, :, None]   # [slots, W, L]
        # a row's query heads grouped by their key/value head (no repeated keys and values): query row g * W + j
        mask = visible[:, None] if width == 1 else \
            visible[:, None, None].expand(slots, 1, group, width, self.cache_len).reshape(slots, 1, group * width, -1)

        def attend(i, q, k, v):
            self.keys[i][rows, :, positions] = k.transpose(1, 2)
            self.values[i][rows, :, positions] = v.transpose(1, 2)
            q = q.reshape(slots, self.kv_heads, group * width, self.head_dim)
            out = F.scaled_dot_product_attention(q, self.keys[i], self.values[i], attn_mask=mask, scale=self.scaling)
            return out.reshape(slots, self.heads, width, self.head_dim)

        return self._run(ids, cos, sin, attend)

    def prefill(self, rows: list[int], prompts: list[list[int]]):
        """Write `prompts` into rows `rows` (positions 0 .. len - 1). Returns (logits at each prompt's last
        position [n, V], and with keep_layers each prompt's features [len, F] in a list, else None)."""
        import torch
        logits, features = [None] * len(prompts), [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda j: -len(prompts[j]))
        start = 0
        while start < len(order):   # chunks of similar width, at most PREFILL_TOKENS padded tokens each
            chunk = order[start:start + max(1, PREFILL_TOKENS // len(prompts[order[start]]))]
            last, kept = self._prefill_chunk([rows[j] for j in chunk], [prompts[j] for j in chunk])
            for k, j in enumerate(chunk):
                logits[j] = last[k]
                features[j] = None if kept is None else kept[k, :len(prompts[j])]
            start += len(chunk)
        return torch.stack(logits), features if self.keep_layers else None

    def _prefill_chunk(self, rows: list[int], prompts: list[list[int]]):
        import torch
        import torch.nn.functional as F
        width = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        index = torch.tensor(rows, device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        cos, sin = self.cos[:width][None], self.sin[:width][None]       # [1, width, head_dim]
        group = self.heads // self.kv_heads

        def attend(i, q, k, v):
            # right padding: causal attention keeps every real position away from the padding after it
            self.keys[i][index, :, :width] = k
            self.values[i][index, :, :width] = v
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)

        with torch.inference_mode():
            hidden, kept = self._run(ids, cos, sin, attend)
            last = hidden[torch.arange(len(prompts), device=self.device), lengths - 1]
            return self.logits(last), kept


class SlotDecoder:
    """`slots` sequences of up to `cache_len` positions decoded together by one model (see the module doc)."""

    def __init__(self, lm, slots: int, cache_len: int, sampling: tuple[float, int, float], *,
                 sync_every: int = 16, graphs: bool | None = None):
        import torch
        self.cache = SlotCache(lm, slots, cache_len)
        self.slots, self.cache_len, self.sampling, self.sync_every = slots, cache_len, sampling, sync_every
        device = self.cache.device
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.out = torch.zeros(sync_every, slots, dtype=torch.long, device=device)
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self._step_fn = self._decode_step
        self._graph = None

    def _decode_step(self):
        hidden, _ = self.cache.forward(self.tokens[:, None], self.positions)
        return sample(self.cache.logits(hidden[:, -1]), *self.sampling)

    def _decode_steps(self):
        for s in range(self.sync_every):
            new = self._step_fn()
            self.out[s].copy_(new)
            self.tokens.copy_(new)
            self.positions.add_(1).clamp_(max=self.cache_len - 1)

    def compile(self) -> None:
        """Compile the decoding step (inductor, one fixed shape) and, with graphs (default: on a GPU), capture
        `sync_every` steps as one CUDA graph that `decode` replays. Call it before the first prefill."""
        import torch
        self._step_fn = torch.compile(self._decode_step, dynamic=False, fullgraph=True)
        if not self.graphs:
            return
        self._graph = capture(self._decode_steps, (self.tokens, self.positions))

    def decode(self):
        """`sync_every` steps of every slot; returns the new tokens on the host, [sync_every, slots]."""
        import torch
        if self._graph is not None:
            self._graph.replay()
        else:
            with torch.inference_mode():
                self._decode_steps()
        return self.out.cpu()

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> list[int]:
        """Write `prompts` into `slots` and return each one's first sampled token."""
        import torch
        logits, _ = self.cache.prefill(slots, prompts)
        with torch.inference_mode():
            first = sample(logits, *self.sampling)
            rows = torch.tensor(slots, device=self.cache.device)
            self.tokens[rows] = first
            self.positions[rows] = torch.tensor([len(p) for p in prompts], device=self.cache.device)
        return first.tolist()


def capture(steps, state: tuple):
    """A CUDA graph of `steps()` (compiled code inside), after two warm-up calls on a side stream that pay the
    compile; the tensors in `state` are put back as they were, since the warm-ups ran the steps for real."""
    import torch
    saved = [t.clone() for t in state]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            steps()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        steps()
    for t, before in zip(state, saved):
        t.copy_(before)
    return graph


def run_slots(lm, sequences: list, gen: dict, eos_ids: set, emit, *, sync_every: int | None = None,
              compile: bool | None = None) -> None:
    """Answer `sequences` (hf.Sequence: .ids, .job) with `hf_batch_size` slots; `emit(sequence, new token ids)`
    as each answer ends (cut after its end-of-sequence token, at most `max_tokens`). Prompts are taken longest
    first (a cache or batch that does not fit fails at once), so a prompt's samples run side by side."""
    if not sequences:
        return
    queue = deque(sorted(sequences, key=lambda s: -len(s.ids)))
    max_tokens = gen["max_tokens"]
    cache_len = cache_len_for(len(queue[0].ids), max_tokens)
    slots = min(gen["hf_batch_size"], len(queue))
    on_gpu = lm.device.type == "cuda"
    sampling = (gen["temperature"], gen["top_k"], gen["top_p"])
    decoder = SlotDecoder(lm, slots, cache_len, sampling, sync_every=sync_every or (16 if on_gpu else 4))
    if on_gpu if compile is None else compile:
        started = time.monotonic()
        decoder.compile()
        log.info("slots: %d slots x %d positions compiled in %.1f s", slots, cache_len, time.monotonic() - started)
    answers: list[list[int] | None] = [None] * slots      # tokens so far of the sequence in each slot
    held: list = [None] * slots
    free = list(range(slots))
    steps = 0
    while queue or any(a is not None for a in answers):
        if free and queue:
            taken = [queue.popleft() for _ in range(min(len(free), len(queue)))]
            places, free = free[:len(taken)], free[len(taken):]
            for place, seq, first in zip(places, taken, decoder.prefill(places, [s.ids for s in taken])):
                held[place], answers[place] = seq, [first]
        new = decoder.decode().tolist()
        steps += decoder.sync_every
        for place in range(slots):
            answer = answers[place]
            if answer is None:
                continue
            for row in new:
                if answer[-1] in eos_ids or len(answer) >= max_tokens:
                    break
                answer.append(row[place])
            if answer[-1] in eos_ids or len(answer) >= max_tokens:
                emit(held[place], answer)
                answers[place], held[place] = None, None
                free.append(place)
    log.info("slots: %d sequences in %d decoding steps of %d slots", len(sequences), steps, slots)
