"""The paper's first idea: quantisation-aware distillation on a *fixed* INT4 grid.

modelopt puts an INT4 fake-quant weight quantiser (symmetric, one scale per `group_size` input
columns, narrow range off so codes span [-8, 7] and scale = amax / 7) on every Linear the paper
quantises. Its `_amax` buffers are then overwritten with 7 x the init's scales ("pinning"): they are
buffers, not parameters, so training moves only the latent weights and the grid never changes.

Everything that needs integer codes (the pin proof, the compressed-tensors pack) takes them from
`grid_codes`, which is the quantiser's own expression (modelopt's `_tensor_quant`): round(W * (7 /
amax)) clamped to [-8, 7], in fp32. Scales are never re-derived from weights.
"""
from __future__ import annotations

import copy
import fnmatch

import torch
from torch import nn

INT4_MAX = 7          # largest positive INT4 code; with narrow range off the smallest is -8
INT4_MIN = -8
ZERO_AMAX = 1.0 / (1 << 24)   # modelopt: a group whose amax is at most this quantises to 0


class GridError(ValueError):
    """The INT4 grid cannot be attached or pinned as asked."""


def is_skipped(module_name: str, skip_patterns: list[str]) -> bool:
    """True when a module stays in high precision (modelopt matches globs on the quantiser name)."""
    quantizer_name = f"{module_name}.weight_quantizer"
    return any(fnmatch.fnmatch(quantizer_name, p) or fnmatch.fnmatch(module_name, p) for p in skip_patterns)


def int4_quant_config(group_size: int, skip_patterns: list[str], algorithm="max") -> dict:
    """modelopt config: INT4 weight-only, group `group_size`, narrow range off, skips disabled."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    cfg["quant_cfg"]["*weight_quantizer"] = {
        "num_bits": 4, "block_sizes": {-1: group_size, "type": "static"}, "enable": True,
        "narrow_range": False}
    for pattern in skip_patterns:
        cfg["quant_cfg"][pattern] = {"enable": False}
    cfg["algorithm"] = algorithm
    return cfg


def skip_cuda_extension() -> bool:
    """Have modelopt fake-quantise CUDA tensors with its PyTorch code instead of compiling its CUDA extension.

    modelopt compiles `modelopt_cuda_ext` the first time it fake-quantises a CUDA tensor (about a minute on a node
    without a torch-extensions build cache) and falls back to its PyTorch path where that extension is absent, as
    after a failed build. Marking it absent before first use takes that path. An extension already loaded stays.
    Returns whether the PyTorch path is now the one used."""
    from modelopt.torch.quantization import extensions

    if not hasattr(extensions.get_cuda_ext, "extension"):
        extensions.get_cuda_ext.extension = None   # modelopt's own "not available" marker (get_cuda_ext caches it)
    return extensions.get_cuda_ext() is None


def check_group_size(model: nn.Module, group_size: int, skip_patterns: list[str]) -> None:
    """Every Linear to be quantised must split into whole groups (and vLLM's kernels need it too)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not is_skipped(name, skip_patterns):
            if module.in_features % group_size:
                raise GridError(
                    f"quant.group_size = {group_size} does not divide the input size {module.in_features} "
                    f"of {name} ({type(model).__name__}); choose a group size that divides every quantised "
                    f"Linear, or add the module to quant.skip_patterns")


def attach_int4_quantizers(model: nn.Module, quant: dict, forward_loop=None, algorithm="max") -> dict:
    """Insert INT4 weight quantisers (params section `quant`) and calibrate them.

    With `forward_loop=None` and algorithm "max" the calibration reads only the weights: it merely
    creates the `_amax` buffers that `pin_grid` then overwrites. AWQ passes its own algorithm and data.
    """
    import modelopt.torch.quantization as mtq

    check_group_size(model, quant["group_size"], quant["skip_patterns"])
    mtq.quantize(model, int4_quant_config(quant["group_size"], quant["skip_patterns"], algorithm), forward_loop)
    modules = quantized_modules(model)
    if len(modules) < quant["min_quantized_modules"]:
        raise GridError(
            f"only {len(modules)} modules got an INT4 quantiser, quant.min_quantized_modules = "
            f"{quant['min_quantized_modules']}; check quant.skip_patterns against the model's module names")
    return modules


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules with an enabled weight quantiser, by name (prefix of a wrapped model stripped)."""
    found = {}
    for name, module in model.named_modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is not None and quantizer.is_enabled:
            found[name.removeprefix("module.")] = module
    return found


def _grouped_shape(module: nn.Module) -> tuple[int, int, int]:
    out_features, in_features = module.weight.shape
    group = module.weight_quantizer.block_sizes[-1]
    return out_features, in_features // group, group


def grid_scales(module: nn.Module) -> torch.Tensor:
    """fp32 [out, in/group] scales of a quantised module: amax / 7 (what a checkpoint stores)."""
    out_features, groups, _ = _grouped_shape(module)
    return module.weight_quantizer.amax.detach().float().reshape(out_features, groups) / INT4_MAX


def pin_grid(model: nn.Module, scales: dict[str, torch.Tensor]) -> int:
    """Overwrite every quantiser's `_amax` with 7 x the given scale (kept in fp32); return how many."""
    modules = quantized_modules(model)
    missing = sorted(set(modules) - set(scales))
    if missing:
        raise GridError(f"no grid scale for {len(missing)} quantised modules, e.g. {missing[0]}; "
                        f"the init checkpoint and the model do not match")
    for name, module in modules.items():
        out_features, groups, _ = _grouped_shape(module)
        scale = scales[name].float()
        if scale.numel() != out_features * groups:
            raise GridError(f"{name}: init scale has {tuple(scale.shape)}, the model needs "
                            f"[{out_features}, {groups}] (is quant.group_size the init's group size?)")
        quantizer = module.weight_quantizer
        amax = (scale.reshape(quantizer.amax.shape) * INT4_MAX).to(module.weight.device)
        del quantizer._amax  # re-register in fp32: a bf16 buffer could not hold 7 x scale exactly
        quantizer.register_buffer("_amax", amax)
    return len(modules)


def grid_amax(model: nn.Module) -> dict[str, torch.Tensor]:
    """The pinned `_amax` buffers by module name (saved beside every checkpoint)."""
    return {name: m.weight_quantizer.amax.detach().float().cpu().clone()
            for name, m in quantized_modules(model).items()}


def restore_amax(model: nn.Module, amax: dict[str, torch.Tensor]) -> int:
    return pin_grid(model, {name: value / INT4_MAX for name, value in amax.items()})


def int4_step(amax: torch.Tensor) -> torch.Tensor:
    """fp32 7 / amax per group, 0 where amax <= ZERO_AMAX: modelopt's scale. A tensor divided by a tensor, as
    modelopt does (`7 / amax` in torch is reciprocal-then-multiply, an ulp off)."""
    amax = amax.float()
    return torch.where(amax <= ZERO_AMAX, 0.0, amax.new_tensor(float(INT4_MAX)) / amax)


@torch.no_grad()
def grid_codes(module: nn.Module) -> torch.Tensor:
    """int8 [out, in] codes of the latent weight: modelopt's expression round(W * (7 / amax))."""
    out_features, groups, group = _grouped_shape(module)
    weight = module.weight.detach().float().reshape(out_features, groups, group)
    amax = module.weight_quantizer.amax.detach().float().reshape(out_features, groups, 1)
    codes = torch.clamp((weight * int4_step(amax)).round_(), INT4_MIN, INT4_MAX)
    return codes.reshape(out_features, groups * group).to(torch.int8)


@torch.no_grad()
def check_codes_are_quantizer_output(module: nn.Module) -> None:
    """Proof that `grid_codes` are the quantiser's integers: modelopt's fake-quant output, divided
    by its own step amax / 7, rounds back to exactly these codes (the output itself may differ from
    codes x step by one ulp, depending on how the backend orders its fp32 operations)."""
    out_features, groups, group = _grouped_shape(module)
    amax = module.weight_quantizer.amax.detach().float().reshape(out_features, groups, 1)
    fake_quant = module.weight_quantizer(module.weight.detach().float()).float()
    recovered = (fake_quant.reshape(out_features, groups, group) * (INT4_MAX / amax)).round()
    recovered[(amax <= ZERO_AMAX).expand_as(recovered)] = 0
    if not torch.equal(recovered.reshape(out_features, -1).to(torch.int8), grid_codes(module)):
        raise GridError("grid_codes disagrees with modelopt's fake quantiser: the pin proof cannot stand")


def codes_mismatch(model: nn.Module, expected: dict[str, torch.Tensor]) -> dict[str, int]:
    """Per module, how many codes of the latent weights differ from `expected` (empty = identical)."""
    wrong = {}
    for name, module in quantized_modules(model).items():
        diff = int((grid_codes(module).cpu() != expected[name].cpu()).sum())
        if diff:
            wrong[name] = diff
    return wrong
