import json

import pytest
import torch

from eqc_utils.drafter.features import context_features, input_embedding
from eqc_utils.drafter.mask import dense_block_mask
from eqc_utils.drafter.model import (DFlashDrafter, DraftCache, default_target_layer_ids, drafter_config_for,
                                     load_drafter, pick_mask_token_id, save_drafter)
from eqc_utils.drafter.train import new_drafter
from tests._fixtures_drafter import load_causal_lm, tiny_params


def test_default_target_layers_match_the_paper():
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(30, 2) == [1, 27]
    assert default_target_layer_ids(30, 1) == [15]


def test_smollm2_mask_token_is_a_spare_special_token(tokenizer):
    mask_id = pick_mask_token_id(tokenizer)
    assert mask_id == 16 and tokenizer.convert_ids_to_tokens(mask_id) == "<empty_output>"


def test_checkpoint_has_the_dflash_layout_and_round_trips(micro_llama_dir, tmp_path):
    target = load_causal_lm(micro_llama_dir)
    cfg = drafter_config_for(target.config, num_layers=2, block_size=8, target_layer_ids=[0, 1], mask_token_id=16)
    drafter = DFlashDrafter(cfg)
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 8
    assert config["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [0, 1]}
    assert config["layer_types"] == ["full_attention"] * 2 and config["sliding_window"] is None
    from safetensors import safe_open
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.1.mlp.down_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)      # shared with the target, not saved
    loaded = load_drafter(tmp_path / "d")
    for (name, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=name)


def test_training_pass_equals_incremental_inference(micro_llama_dir):
    """The anchor-strict mask over a whole sequence gives the block the same hidden states as
    inference, where the drafter only has the context before the anchor (fed in two steps, cached)."""
    torch.manual_seed(0)
    target = load_causal_lm(micro_llama_dir)
    cfg = drafter_config_for(target.config, num_layers=2, block_size=4, target_layer_ids=[0, 1], mask_token_id=16)
    drafter = DFlashDrafter(cfg).eval()
    ids = torch.randint(100, 1000, (1, 20))
    features = context_features(target, ids, None, cfg.target_layer_ids)
    anchors, valid = torch.tensor([[3, 9, 14]]), torch.ones(1, 3, dtype=torch.bool)
    blocks = torch.full((1, 3, 4), 16)
    blocks[0, :, 0] = ids[0, anchors[0]]
    block_pos = (anchors[0, :, None] + torch.arange(4)).flatten()[None]
    embeds = input_embedding(target)(blocks.flatten(1))
    positions = torch.cat([torch.arange(20)[None], block_pos], dim=1)
    with torch.no_grad():
        train_out = drafter(embeds, features, positions, mask=dense_block_mask(anchors, valid, 20, 4))
        cache = DraftCache()
        # step 1: context 0..4 with some other block at 5 (its output is ignored)
        drafter(embeds[:, :4], features[:, :5], torch.arange(9)[None], cache=cache)
        # step 2: the rest of the context up to anchor 9, then the block at 9
        infer_out = drafter(embeds[:, 4:8], features[:, 5:9], torch.arange(5, 13)[None], cache=cache)
    torch.testing.assert_close(infer_out, train_out[:, 4:8], atol=1e-5, rtol=1e-4)


def test_target_last_init_copies_the_last_layers_and_the_final_norm(micro_llama_dir, micro_qwen35_dir, tokenizer):
    target = load_causal_lm(micro_llama_dir)              # 2 layers
    drafter = new_drafter(tiny_params(num_layers=1, init_layers="target_last"), target, tokenizer, None)
    last = target.model.layers[-1]
    for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight"):
        assert torch.equal(drafter.layers[0].get_parameter(name), last.get_parameter(name)), name
    assert not torch.equal(drafter.layers[0].self_attn.q_proj.weight, target.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    features = torch.randn(1, 3, len(drafter.config.target_layer_ids) * drafter.config.hidden_size)
    deepest = drafter.config.target_layer_ids.index(max(drafter.config.target_layer_ids))
    h = drafter.config.hidden_size
    assert torch.equal(drafter.fc(features), features[..., deepest * h:(deepest + 1) * h])
    random = new_drafter(tiny_params(num_layers=1), target, tokenizer, None)
    assert not torch.equal(random.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    # Qwen3.5: the layer before the last full-attention one is Gated DeltaNet, which has no q_proj to copy
    qwen = load_causal_lm(micro_qwen35_dir)
    with pytest.raises(ValueError, match="init_layers.*lacks self_attn.q_proj.weight"):
        new_drafter(tiny_params(num_layers=2, init_layers="target_last"), qwen, tokenizer, None)
