"""The pinned INT4 forward (qad.fake_quant = pinned) against modelopt's quantiser: the same values and gradients
(clipped and zero groups included), no host reads, a re-pinned grid followed, compilable, clear refusals."""
import copy

import pytest
import torch

from _fixtures_quant import micro_params
from _micro_models import micro_llama, micro_qwen35
from eqc_utils.quant import grid, ptq
from eqc_utils.quant.fake_quant import use_pinned_int4_forward


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_quant")
    return {"llama": micro_llama(root / "llama"), "qwen35": micro_qwen35(root / "qwen35")}


def _student(path) -> torch.nn.Module:
    """A micro model with max-calibrated INT4 quantisers, one group zeroed and some weights pushed past their
    group's amax (so both special cases of the expression and of the clipped gradient occur)."""
    model = ptq.load_causal_lm(path).train()
    grid.attach_int4_quantizers(model, {**micro_params()["quant"], "min_quantized_modules": 1})
    grid.pin_grid(model, {n: grid.grid_scales(m) for n, m in grid.quantized_modules(model).items()})
    first = next(iter(grid.quantized_modules(model).values()))
    with torch.no_grad():
        first.weight_quantizer._amax[0] = 0.0
        first.weight[1, :4] = 2.0 * float(first.weight_quantizer._amax.max())
    return model


def _logits_and_grads(model, ids, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits.float()
    logits.logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "qwen35"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_pinned_forward_equals_modelopt_in_value_and_gradient(models, kind, autocast):
    reference = _student(models[kind])
    pinned = copy.deepcopy(reference)
    assert use_pinned_int4_forward(pinned) == len(grid.quantized_modules(reference))
    ids = torch.randint(100, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    logits_ref, grads_ref = _logits_and_grads(reference, ids, autocast)
    logits, grads = _logits_and_grads(pinned, ids, autocast)
    assert torch.equal(logits, logits_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert torch.equal(grads[name], grads_ref[name]), name
    clipped = next(iter(grid.quantized_modules(pinned).values())).weight.grad
    assert (clipped[1, :4] == 0).all() and (clipped[1, 4:] != 0).any()   # the clipped straight-through gradient


def _host_reads(module, x, monkeypatch) -> int:
    """Tensor-to-Python reads (a device sync each on a GPU) during one forward and backward of `module`."""
    count = {"n": 0}
    for method in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, **kwargs):
            count["n"] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, method, counted)
    module(x).sum().backward()
    monkeypatch.undo()
    return count["n"]


def test_pinned_forward_reads_nothing_from_the_device(models, monkeypatch):
    model = _student(models["llama"])
    name, linear = next(iter(grid.quantized_modules(model).items()))
    x = torch.randn(3, linear.in_features)
    assert _host_reads(linear, x, monkeypatch) > 0, "modelopt's quantiser reads amax on the host (the reason)"
    use_pinned_int4_forward(model)
    assert _host_reads(linear, x, monkeypatch) == 0, name


def test_pinned_forward_follows_a_grid_restored_later(models):
    """The forward reads `_amax` at every call: a checkpoint's grid restored after the switch is the one used."""
    reference = _student(models["llama"])
    pinned = copy.deepcopy(reference)
    use_pinned_int4_forward(pinned)
    coarser = {n: 2 * a for n, a in grid.grid_amax(reference).items()}
    grid.restore_amax(reference, coarser)
    grid.restore_amax(pinned, coarser)
    ids = torch.randint(100, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(pinned(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_pinned_decoder_compiles_to_the_same_values(models):
    """modelopt's quantised Linears stop dynamo (qad.compile without checkpointing failed on one H200); the
    pinned forward is plain torch and compiles."""
    eager = _student(models["llama"])
    use_pinned_int4_forward(eager)
    compiled = copy.deepcopy(eager)
    compiled.get_decoder().compile()
    ids = torch.randint(100, 1000, (2, 16), generator=torch.Generator().manual_seed(2))
    logits_eager, grads_eager = _logits_and_grads(eager, ids, autocast=False)
    logits_compiled, grads_compiled = _logits_and_grads(compiled, ids, autocast=False)
    torch.testing.assert_close(logits_compiled, logits_eager, rtol=1e-4, atol=1e-4)
    for name in grads_eager:
        torch.testing.assert_close(grads_compiled[name], grads_eager[name], rtol=1e-3, atol=1e-5, msg=name)


def test_a_quantiser_it_cannot_replace_is_named(models):
    model = _student(models["llama"])
    name, linear = next(iter(grid.quantized_modules(model).items()))
    linear.input_quantizer.enable()
    with pytest.raises(grid.GridError, match=rf"{name}.*input or output is quantised.*fake_quant: modelopt"):
        use_pinned_int4_forward(model)
