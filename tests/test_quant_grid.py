"""The INT4 grid: pinning, the pin proof, codes on the grid through training, clear errors."""

import pytest
import torch

from _fixtures_quant import micro_params
from _micro_models import micro_llama, micro_qwen35
from eqc_utils.quant import grid, pack_ct, ptq


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    return {"llama": micro_llama(root / "llama"), "qwen35": micro_qwen35(root / "qwen35")}


@pytest.fixture(scope="module")
def packs(models, tmp_path_factory):
    """A max-calibrated INT4 pack of each micro model (a stand-in for cyankiwi's pack)."""
    root = tmp_path_factory.mktemp("packs")
    params = micro_params()
    out = {}
    for kind, path in models.items():
        model = ptq.load_causal_lm(path)
        grid.attach_int4_quantizers(model, {**params["quant"], "min_quantized_modules": 1})
        grid.pin_grid(model, {n: grid.grid_scales(m).to(torch.bfloat16).float()
                              for n, m in grid.quantized_modules(model).items()})
        pack_ct.write_ct_pack(model, root / kind, sidecars_from=path, pack=params["pack"], group_size=32)
        out[kind] = root / kind
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen35"])
def test_pin_reproduces_pack_codes_and_skips(models, packs, kind):
    quant = {**micro_params()["quant"], "min_quantized_modules": 1}
    student, codes = ptq.student_from_pack(models[kind], packs[kind], quant)
    quantized = grid.quantized_modules(student)
    assert grid.codes_mismatch(student, codes) == {}
    assert not any("lm_head" in n or "embed" in n or "in_proj_a" in n or "in_proj_b" in n for n in quantized)
    if kind == "qwen35":
        assert any("linear_attn.in_proj_qkv" in n for n in quantized)
        assert any("self_attn.q_proj" in n for n in quantized)
    for module in quantized.values():
        assert module.weight_quantizer.amax.dtype == torch.float32


@pytest.mark.parametrize("kind", ["llama", "qwen35"])
def test_grid_survives_training_steps(models, packs, kind):
    """Scales unchanged and every fake-quant weight still a code x scale after optimiser steps."""
    quant = {**micro_params()["quant"], "min_quantized_modules": 1}
    student, codes = ptq.student_from_pack(models[kind], packs[kind], quant)
    amax_before = grid.grid_amax(student)
    optimizer = torch.optim.AdamW(student.parameters(), lr=5e-3)
    ids = torch.randint(0, 49152, (1, 32))
    for _ in range(3):
        student(ids).logits.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(amax_before[n], a) for n, a in grid.grid_amax(student).items())
    changed = grid.codes_mismatch(student, codes)
    assert changed, "lr 5e-3 should flip some codes: the test would not notice a frozen model"
    for name, module in grid.quantized_modules(student).items():
        grid.check_codes_are_quantizer_output(module)
        fq = module.weight_quantizer(module.weight.detach())
        dequant = pack_ct.dequantize(grid.grid_codes(module), grid.grid_scales(module))
        assert torch.allclose(fq, dequant, rtol=0, atol=1e-6)


def test_group_size_not_dividing_a_layer_is_a_clear_error(models):
    model = ptq.load_causal_lm(models["llama"])
    quant = {**micro_params()["quant"], "group_size": 48}
    with pytest.raises(grid.GridError, match="quant.group_size = 48 does not divide"):
        grid.attach_int4_quantizers(model, quant)


def test_too_few_quantised_modules_is_a_clear_error(models):
    model = ptq.load_causal_lm(models["llama"])
    quant = {**micro_params()["quant"], "min_quantized_modules": 500}
    with pytest.raises(grid.GridError, match="min_quantized_modules"):
        grid.attach_int4_quantizers(model, quant)


@pytest.fixture
def cuda_extension_state():
    """skip_cuda_extension changes modelopt's process-wide cache: put it back afterwards."""
    from modelopt.torch.quantization import extensions
    had = hasattr(extensions.get_cuda_ext, "extension")
    saved = getattr(extensions.get_cuda_ext, "extension", None)
    yield extensions
    if had:
        extensions.get_cuda_ext.extension = saved
    elif hasattr(extensions.get_cuda_ext, "extension"):
        del extensions.get_cuda_ext.extension


def test_skip_cuda_extension_leaves_modelopt_its_pytorch_fake_quant(cuda_extension_state):
    """The marker is the one modelopt reads: its CUDA fake-quant entry point fails over (AttributeError, which
    FakeTensorQuantFunction catches), so no extension is compiled, and the fake-quant values are still the grid's."""
    from modelopt.torch.quantization.tensor_quant import fake_quant_impl, fake_tensor_quant
    if hasattr(cuda_extension_state.get_cuda_ext, "extension") and cuda_extension_state.get_cuda_ext.extension:
        pytest.skip("modelopt's CUDA extension is already loaded in this process")
    assert grid.skip_cuda_extension()
    w, amax = torch.randn(4, 32), torch.full((4, 1), 2.0)
    with pytest.raises(AttributeError):
        fake_quant_impl(w, amax, num_bits=4, narrow_range=False)
    expected = torch.clamp(torch.round(w * 7 / 2.0), -8, 7) * 2.0 / 7
    torch.testing.assert_close(fake_tensor_quant(w, amax, None, 4, False, False), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fake_quant_forward_on_cuda_without_the_extension_matches_cpu(models, cuda_extension_state):
    """On a GPU, with the extension marked absent, the INT4 fake-quant forward runs modelopt's PyTorch path (nothing
    is compiled) and gives the CPU's logits."""
    quant = {**micro_params()["quant"], "min_quantized_modules": 1}
    assert grid.skip_cuda_extension()
    ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    logits = {}
    for device in ("cpu", "cuda"):
        model = ptq.load_causal_lm(models["llama"]).to(device)
        grid.attach_int4_quantizers(model, quant)
        with torch.no_grad():
            logits[device] = model(ids.to(device)).logits.float().cpu()
    assert cuda_extension_state.get_cuda_ext() is None
    torch.testing.assert_close(logits["cuda"], logits["cpu"], rtol=1e-3, atol=1e-3)
