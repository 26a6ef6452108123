"""The DFlash draft model (docs/recipe.md §3.1): a few Qwen3 decoder layers that fill a block of mask tokens
in one pass, conditioned on hidden states of the frozen target.

What makes it DFlash rather than a small LM:
* its keys/values are the block's own plus the *target context*: hidden states of a few target layers,
  concatenated and projected by `fc` + `hidden_norm`, one key/value per already-verified position;
* its queries come from the block only, and the block attends to itself bidirectionally;
* it has no embedding and no LM head: the block is embedded with the target's embedding and drafted
  tokens are read out through the target's LM head. Both stay frozen and are not saved here.

The saved folder follows the z-lab DFlash layout (`architectures: ["DFlashDraftModel"]`,
`model_type: "qwen3"`, `block_size`, `dflash_config.{mask_token_id,target_layer_ids}`), which vLLM's
`method: "dflash"` speculative decoding loads next to the target.

Sliding window (`DrafterConfig.sliding_window` = W, stage 08): the block sees only the last
context positions (the rule is in `mask.py`). The model applies it itself, from positions, on every
path: training (ANDed onto the anchor-strict mask), the reference decoder (which also drops cached
context keys no later block can see, so a draft step costs O(W), not O(context)). The config records it
the way vLLM's dflash model reads it: every layer "sliding_attention" with `sliding_window` = W,
`dflash_config.use_swa` / `swa_window_size`, and `dflash_config.causal: false` (without it vLLM makes a
sliding layer causal, and the block's slots would stop seeing the slots after them, unlike training).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from eqc_utils.drafter.mask import check_window, flex_attend, is_block_mask, restrict_to_window
from eqc_utils.io import atomic_path

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class DrafterConfig:
    """Everything needed to rebuild a drafter; serialised as a Qwen3-style config.json."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Sliding window over the context (stage 08); None = full attention.
    sliding_window: int | None = None

    def __post_init__(self):
        check_window(self.sliding_window, self.block_size)

    def to_hf_dict(self) -> dict:
        layer_type = "sliding_attention" if self.sliding_window else "full_attention"
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.sliding_window:
            dflash.update(use_swa=True, swa_window_size=self.sliding_window, causal=False)
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": True,
            "use_sliding_window": bool(self.sliding_window),
            "sliding_window": self.sliding_window,
            "layer_types": [layer_type] * self.num_layers,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": "bfloat16",
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        special = {"num_layers", "target_layer_ids", "mask_token_id", "rope_theta", "sliding_window"}
        plain = {f.name for f in fields(cls)} - special
        rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        dflash = d["dflash_config"]
        return cls(num_layers=d["num_hidden_layers"], target_layer_ids=list(dflash["target_layer_ids"]),
                   mask_token_id=dflash["mask_token_id"], rope_theta=float(rope_theta),
                   sliding_window=_window_of(d), **{k: d[k] for k in plain if k in d})


def _window_of(d: dict) -> int | None:
    """The window a DFlash config asks for, read as vLLM reads it: a Qwen3 config may carry a
    `sliding_window` value while `use_sliding_window` is off, which means no window."""
    dflash = d.get("dflash_config") or {}
    sliding = dflash.get("use_swa") or d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or [])
    if not sliding:
        return None
    return dflash.get("swa_window_size") or d.get("sliding_window")


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Evenly spaced target layers, skipping the first and the last three (the reference's rule):
    5 ids over 32 layers -> [1, 8, 15, 22, 29]; one id -> the middle layer."""
    if num_ids < 1:
        raise ValueError("drafter.target_layer_ids: need at least one target layer")
    if num_ids == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_ids - 1)) for i in range(num_ids)]


def pick_mask_token_id(tokenizer) -> int:
    """A token id the drafter uses for "to be filled". Prefer a dedicated mask token; otherwise the
    highest spare special token that the chat template never emits (SmolLM2: id 16, `<empty_output>`),
    so the vocabulary (and the target's embedding) need not grow."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    template = getattr(tokenizer, "chat_template", None) or ""
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    reserved |= set(getattr(tokenizer, "all_special_ids", []))
    spare = [token_id for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
             if added.special and token_id not in reserved and added.content not in template]
    if not spare:
        raise ValueError("the tokenizer has no spare special token to use as the DFlash mask: "
                         "set drafter.mask_token_id in the profile")
    return max(spare)


def drafter_config_for(target_config, *, num_layers: int, block_size: int, target_layer_ids: list[int] | None,
                       mask_token_id: int, intermediate_size: int | None = None) -> DrafterConfig:
    """A drafter shaped like the target (hidden size, heads, RoPE), so embeddings and head can be shared."""
    cfg = getattr(target_config, "text_config", None) or target_config
    num_target_layers = cfg.num_hidden_layers
    ids = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(num_target_layers, num_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"drafter.target_layer_ids {ids}: {bad} outside the target's {num_target_layers} layers")
    heads = cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0
    return DrafterConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=intermediate_size or cfg.intermediate_size,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        vocab_size=cfg.vocab_size,
        num_target_layers=num_target_layers,
        target_layer_ids=ids,
        mask_token_id=int(mask_token_id),
        block_size=block_size,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 32768),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_id=getattr(cfg, "eos_token_id", None),
        pad_token_id=getattr(cfg, "pad_token_id", None),
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Rope(nn.Module):
    """Rotary embedding. The frequencies are recomputed in fp32 on every call rather than kept in a
    buffer, which `.to(bfloat16)` would round (positions in the thousands then rotate wrongly)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin of shape [B, 1, T, head_dim] for integer positions [B, T]."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        freqs = positions[..., None].float() * (1.0 / self.theta ** exponents)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass
class DraftCache:
    """Keys/values of the target context seen so far, per layer (already rotated), and their positions.
    Block keys are never cached: each step drafts a fresh block, while verified context only grows.
    With a sliding window the keys no later block can see are dropped, so `length` (context positions
    taken in, i.e. the next context position) can exceed the number of keys kept."""
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    positions: torch.Tensor | None = None      # [B, kept]
    length: int = 0

    def drop_before(self, first: torch.Tensor) -> None:
        """Forget keys at positions < first[b] (kept where any row still needs them)."""
        keep = (self.positions >= first[:, None]).any(0)
        if bool(keep.all()):
            return
        self.positions = self.positions[:, keep]
        self.keys = [k[:, :, keep] for k in self.keys]
        self.values = [v[:, :, keep] for v in self.values]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim)

    def forward(self, block: torch.Tensor, context: torch.Tensor, rope, mask, cache: DraftCache | None,
                layer: int) -> torch.Tensor:
        batch, q_len, _ = block.shape
        cos, sin = rope                                        # over [context | block] positions
        q = self.q_norm(self._heads(self.q_proj(block), self.heads)).transpose(1, 2)
        kv_in = torch.cat([context, block], dim=1)             # same projections for context and block
        k = self.k_norm(self._heads(self.k_proj(kv_in), self.kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(kv_in), self.kv_heads).transpose(1, 2)
        q = rotate(q, cos[:, :, -q_len:], sin[:, :, -q_len:])
        k = rotate(k, cos, sin)
        if cache is not None:
            ctx_len = context.shape[1]
            if len(cache.keys) <= layer:
                cache.keys.append(k[:, :, :ctx_len])
                cache.values.append(v[:, :, :ctx_len])
            else:
                cache.keys[layer] = torch.cat([cache.keys[layer], k[:, :, :ctx_len]], dim=2)
                cache.values[layer] = torch.cat([cache.values[layer], v[:, :, :ctx_len]], dim=2)
            k = torch.cat([cache.keys[layer], k[:, :, ctx_len:]], dim=2)
            v = torch.cat([cache.values[layer], v[:, :, ctx_len:]], dim=2)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


def attend(q, k, v, mask) -> torch.Tensor:
    """Non-causal attention; `mask` is None (all visible), a dense boolean mask, or a flex BlockMask."""
    if is_block_mask(mask):
        return flex_attend(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = Qwen3MLP(_mlp_config(cfg))
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, block, context, rope, mask, cache, layer):
        block = block + self.self_attn(self.input_layernorm(block), context, rope, mask, cache, layer)
        return block + self.mlp(self.post_attention_layernorm(block))


def _mlp_config(cfg: DrafterConfig):
    return SimpleNamespace(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, hidden_act="silu",
                           mlp_bias=False)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def forward(self, block_embeds: torch.Tensor, context_features: torch.Tensor, positions: torch.Tensor,
                mask=None, cache: DraftCache | None = None) -> torch.Tensor:
        """Hidden states of the block positions.

        block_embeds: [B, Q, H] target-embedded block tokens (anchor token then mask tokens);
        context_features: [B, C, L*H] concatenated target hidden states of the (new) context positions;
        positions: [B, C + Q] positions of those context keys then of the block;
        mask: None at inference (the block sees all context and itself), else [B, 1, Q, K] or a BlockMask;
        cache: context keys/values of earlier steps (inference); the new context is appended to it.
        """
        context = self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))
        hidden = block_embeds.to(context.dtype)
        rope = self.rope(positions, hidden.dtype)
        window = self.config.sliding_window
        q_pos, ctx_pos = positions[:, -hidden.shape[1]:], positions[:, :context.shape[1]]
        if window is not None:
            kv_pos = positions if cache is None or cache.positions is None else torch.cat([cache.positions, positions], 1)
            mask = restrict_to_window(mask, q_pos, kv_pos, window)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, context, rope, mask, cache, i)
        if cache is not None:
            cache.positions = ctx_pos if cache.positions is None else torch.cat([cache.positions, ctx_pos], 1)
            cache.length += context.shape[1]
            if window is not None:      # later blocks start further right: these keys are out of reach for good
                cache.drop_before(q_pos.min(1).values - window + 1)
        return self.norm(hidden)


def save_drafter(drafter: DFlashDrafter, path: str | Path, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write config.json + model.safetensors (bf16, the deployable form) atomically into `path`."""
    from safetensors.torch import save_file
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.mkdir(parents=True)
        (tmp / CONFIG_FILE).write_text(json.dumps(drafter.config.to_hf_dict(), indent=2) + "\n")
        state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in unwrap(drafter).state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
    return path


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> DFlashDrafter:
    """A drafter folder: plain BF16, or a compressed-tensors pack (stage 08), whose packed weights are
    dequantised to codes x scale, the values vLLM computes with."""
    from safetensors.torch import load_file
    path = Path(path)
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{path} is not a DFlash drafter folder (no {CONFIG_FILE}); "
                                "point to a checkpoint written by eqc_utils.drafter.save_drafter")
    config = json.loads((path / CONFIG_FILE).read_text())
    drafter = DFlashDrafter(DrafterConfig.from_hf_dict(config))
    if "quantization_config" in config:
        from eqc_utils.quant.gptq import dequantized_state_dict
        state = dequantized_state_dict(path)
    else:
        state = load_file(str(path / WEIGHTS_FILE))
    drafter.load_state_dict(state)
    return drafter.to(device=device, dtype=dtype)


def unwrap(model: nn.Module) -> nn.Module:
    """The drafter inside a DDP/FSDP/compile wrapper."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model
