import pytest

from eqc_utils import assets


def test_teacher_is_converted_once_and_loads_fast():
    from transformers import AutoConfig, AutoTokenizer
    folder = assets.teacher_dir("smollm2")
    assert (folder / ".complete").exists() and assets.teacher_dir("smollm2") == folder
    config = AutoConfig.from_pretrained(folder)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


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
    llama = AutoModelForCausalLM.from_pretrained(assets.micro_llama(tmp_path / "llama"))
    qwen = AutoModelForCausalLM.from_pretrained(assets.micro_qwen35(tmp_path / "qwen"))
    assert llama.config.head_dim >= 32 and qwen.config.head_dim >= 32
    assert qwen.config.layer_types.count("full_attention") == 1 and "linear_attention" in qwen.config.layer_types
    ids = torch.tensor([[1, 5, 9, 13]])
    assert llama(ids).logits.shape == qwen(ids).logits.shape == (1, 4, 49152)
    assert (tmp_path / "qwen" / "tokenizer.json").exists()
