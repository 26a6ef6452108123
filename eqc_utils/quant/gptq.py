"""Weight-only INT4/INT8 quantisation of a small model by GPTQ or round-to-nearest, through modelopt,
and its compressed-tensors pack. Stage 08 applies it to the DFlash drafter; nothing here is specific
to the drafter (the calibration forward loop is the caller's).

grid   modelopt attaches its integer weight quantisers (max calibration): one scale per `group_size`
       input columns, scale = max|W| / qmax with qmax = 2^(bits-1) - 1, codes in [-qmax - 1, qmax],
       symmetric, no zero point. The scales are first rounded to the dtype the checkpoint stores
       (bf16), so every later step works on the grid vLLM will compute with.
RTN    round to nearest on that grid: the baseline.
GPTQ   one calibration pass collects each Linear's input Hessian H = 2/n sum x x^T (modelopt's
       `update_hessian`), on the unquantised model and for every Linear at once (no sequential
       re-collection). Then, per Linear, columns in natural order (no act-order): quantise a column,
       spread its error over the columns not yet quantised with the upper Cholesky factor of H^-1
       (modelopt's `prepare_hessian_inverse`, damping `percdamp` x mean diag H), in blocks of
       `update_block` columns with lazy updates of the rest. A group's scale is taken at its first
       column from the error-updated weights (`static_groups` false, the paper's choice) or kept from
       the RTN grid (`static_groups` true, what modelopt's `gptq_lite` does). Inputs that never fire
       (zero Hessian diagonal) get diagonal 1: their columns are rounded and pass no error on.
       The column loop is ours because modelopt's `blockwise_weight_update` fake-quantises the whole
       weight once per column (O(out x in^2): minutes for a drafter on a CPU); with static groups
       both give the same weights (tests check this).
pack   compressed-tensors `pack-quantized`, as the target's (`pack_ct`): per quantised Linear
       `weight_packed` int32 [out, in * bits / 32], `weight_scale` [out, in / group], `weight_shape`;
       every other tensor in the storage dtype. Modules kept in high precision are named in `ignore`
       as regular expressions: the serving engine renames modules (vLLM numbers draft layers after
       the target's and fuses q/k/v into qkv_proj, gate/up into gate_up_proj), so a pattern must
       match a module by its suffix, and fused siblings must be kept or quantised together.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from eqc_utils.io import atomic_path, write_json
from eqc_utils.quant import grid
from eqc_utils.quant.pack_ct import WEIGHTS_FILE, dequantize, quantization_config, read_passthrough

BITS = (4, 8)
METHODS = ("gptq", "rtn")
# Modules a serving engine fuses into one GEMM: all of a set are quantised, or none.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class QuantParamsError(ValueError):
    """A quantisation parameter does not fit the model."""


# ----------------------------------------------------------------------------------------- which modules

def kept_in_high_precision(name: str, keep_patterns: list[str]) -> bool:
    return any(re.search(p, name) for p in keep_patterns)


def target_linears(model: nn.Module, keep_patterns: list[str]) -> dict[str, nn.Linear]:
    """The Linear modules to quantise, by name (those not matched by a keep pattern)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not kept_in_high_precision(name, keep_patterns)}


def check_params(model: nn.Module, Q: dict, section: str = "drafter_quant") -> dict[str, nn.Linear]:
    """Validate a quantisation params section against the model; return the Linears to quantise.
    Every error names the parameter (`section.key`) and what to change."""
    if Q["bits"] not in BITS:
        raise QuantParamsError(f"{section}.bits = {Q['bits']}: only 4 or 8 bit integer weights are supported "
                               f"(W4A16 is the paper's; vLLM's CPU kernels serve 4 only)")
    if Q["group_size"] <= 0:
        raise QuantParamsError(f"{section}.group_size = {Q['group_size']}: must be a positive number of input columns")
    if not 0.0 < Q["percdamp"] <= 1.0:
        raise QuantParamsError(f"{section}.percdamp = {Q['percdamp']}: must be in (0, 1] (the paper uses 0.01)")
    if Q["update_block"] <= 0 or Q["update_block"] % Q["group_size"]:
        raise QuantParamsError(f"{section}.update_block = {Q['update_block']} must be a positive multiple of "
                               f"{section}.group_size = {Q['group_size']} (a group must not straddle two blocks)")
    for pattern in Q["keep_bf16"]:
        try:
            re.compile(pattern)
        except re.error as err:
            raise QuantParamsError(f"{section}.keep_bf16: {pattern!r} is not a regular expression: {err}") from err
        if pattern.startswith("^"):
            raise QuantParamsError(f"{section}.keep_bf16: {pattern!r} is anchored at the start; name modules by "
                                   f"their suffix (e.g. 'self_attn\\.[qkv]_proj$'): vLLM's module names carry "
                                   f"other prefixes and layer numbers")
    linears = target_linears(model, Q["keep_bf16"])
    if not linears:
        raise QuantParamsError(f"{section}.keep_bf16 = {Q['keep_bf16']} keeps every Linear in high precision: "
                               f"nothing left to quantise")
    for name, module in linears.items():
        if module.in_features % Q["group_size"]:
            raise QuantParamsError(
                f"{section}.group_size = {Q['group_size']} does not divide the input size {module.in_features} "
                f"of {name}: choose a group size that divides every quantised Linear (the paper's 128 fits "
                f"Qwen3.5-4B; SmolLM2's 576 needs 64 or 32), or keep the module in BF16 ({section}.keep_bf16)")
    all_linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for siblings in FUSED_SIBLINGS:
        for name in all_linears:
            prefix, _, leaf = name.rpartition(".")
            if leaf != siblings[0]:
                continue
            family = [f"{prefix}.{s}" for s in siblings if f"{prefix}.{s}" in all_linears]
            quantised = {f in linears for f in family}
            if len(quantised) > 1:
                raise QuantParamsError(f"{section}.keep_bf16 keeps only part of {family}: vLLM fuses them into one "
                                       f"layer, which is quantised as a whole; keep all of them or none")
    return linears


# ----------------------------------------------------------------------------------------- Hessians

@torch.no_grad()
def collect_hessians(model: nn.Module, forward_loop, names: list[str]) -> dict[str, torch.Tensor]:
    """Input Hessians 2/n sum x x^T (fp32) of the named Linears over one run of `forward_loop(model)`."""
    from modelopt.torch.quantization.model_calib import update_hessian

    modules = dict(model.named_modules())
    state: dict[str, list] = {}

    def hook(name):
        def fn(module, args, output):
            x = args[0].detach()
            if name not in state:
                state[name] = [torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float32, device=x.device), 0]
            state[name][0], state[name][1] = update_hessian(x, state[name][0], state[name][1])
        return fn

    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    try:
        forward_loop(model)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in state]
    if missing:
        raise RuntimeError(f"the calibration forward loop never reached {missing[0]} ({len(missing)} modules): "
                           f"no Hessian to quantise it with")
    return {n: state[n][0] for n in names}


# ----------------------------------------------------------------------------------------- the grid

def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def storable(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scales rounded to what a checkpoint of `dtype` stores."""
    return scale.to(dtype).float()


def quant_config(bits: int, group_size: int) -> dict:
    """modelopt config: integer weights of `bits`, one scale per `group_size` inputs, max calibration."""
    cfg = grid.int4_quant_config(group_size, skip_patterns=[], algorithm="max")
    cfg["quant_cfg"]["*weight_quantizer"]["num_bits"] = bits
    return cfg


def attach_quantizers(model: nn.Module, linears: dict[str, nn.Linear], bits: int, group_size: int,
                      scale_dtype: torch.dtype) -> None:
    """modelopt quantisers on `linears` (others disabled), max-calibrated on the weights, scales made storable."""
    import modelopt.torch.quantization as mtq

    mtq.quantize(model, quant_config(bits, group_size), forward_loop=None)
    for name, module in model.named_modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is None:
            continue
        if name in linears:
            if not quantizer.is_enabled:
                raise RuntimeError(f"modelopt's default config left {name} unquantised; rename the module or "
                                   f"extend eqc_utils.quant.gptq.quant_config")
            set_scales(module, storable(scales_of(module, bits), scale_dtype), bits)
        else:
            quantizer.disable()


def scales_of(module: nn.Module, bits: int) -> torch.Tensor:
    """fp32 [out, in / group] scales of a quantised Linear: amax / qmax."""
    out_features, in_features = module.weight.shape
    return module.weight_quantizer.amax.detach().float().reshape(out_features, -1) / qmax(bits)


def set_scales(module: nn.Module, scales: torch.Tensor, bits: int) -> None:
    """Pin the quantiser's `_amax` to qmax x scales (fp32 buffer: exact for storable scales)."""
    quantizer = module.weight_quantizer
    amax = (scales.float() * qmax(bits)).reshape(quantizer.amax.shape).to(module.weight.device)
    del quantizer._amax
    quantizer.register_buffer("_amax", amax)


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, codes x scale) of values w on the grid `scale` (same shape, broadcast); a zero scale gives 0."""
    step = torch.where(scale > 0, 1.0 / scale.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(scale))
    codes = torch.clamp(torch.round(w * step), -qmax(bits) - 1, qmax(bits))
    return codes, codes * scale


@torch.no_grad()
def weight_codes(module: nn.Module, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], fp32 scales [out, in / group]) of a quantised Linear's weight: modelopt's
    expression round(W x qmax / amax), clamped (for 4 bits, exactly `grid.grid_codes`)."""
    scales = scales_of(module, bits)
    group = module.weight.shape[1] // scales.shape[1]
    w = module.weight.detach().float().reshape(scales.shape[0], scales.shape[1], group)
    amax = module.weight_quantizer.amax.detach().float().reshape(scales.shape[0], scales.shape[1], 1)
    step = torch.tensor(float(qmax(bits)), device=amax.device) / amax
    step[amax <= 1.0 / (1 << 24)] = 0
    codes = torch.clamp((w * step).round_(), -qmax(bits) - 1, qmax(bits))
    return codes.reshape(module.weight.shape).to(torch.int8), scales


# ----------------------------------------------------------------------------------------- GPTQ

def hessian_inverse_factor(hessian: torch.Tensor, weight: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damping)^-1 (modelopt's `prepare_hessian_inverse`), after giving
    dead inputs (zero diagonal) a unit diagonal so that H stays invertible whatever the damping."""
    from modelopt.torch.quantization.model_calib import prepare_hessian_inverse

    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    return prepare_hessian_inverse(h, weight, percdamp)


@torch.no_grad()
def gptq_weight(weight: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, *, bits: int,
                percdamp: float, update_block: int, static_groups: bool,
                scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of one weight [out, in] against its input Hessian [in, in].
    `scales` [out, in / group]: the RTN grid (kept with static groups, else recomputed per group).
    Returns (weights on the grid, fp32, = codes x scales; the grid's scales, storable in `scale_dtype`)."""
    w = weight.detach().float().clone()
    out_features, columns = w.shape
    group = columns // scales.shape[1]
    scales = scales.float().clone()
    h_inv = hessian_inverse_factor(hessian.to(w.device), w, percdamp)
    result = torch.zeros_like(w)
    for start in range(0, columns, update_block):
        end = min(start + update_block, columns)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        h_block = h_inv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            g = column // group
            if not static_groups and column % group == 0:
                amax = block[:, i:i + group].abs().amax(dim=1)
                scales[:, g] = storable(amax / qmax(bits), scale_dtype)
            _, q = round_to_grid(block[:, i], scales[:, g], bits)
            result[:, column] = q
            err = (block[:, i] - q) / h_block[i, i]
            block[:, i:] -= err[:, None] * h_block[i, i:][None, :]
            errors[:, i] = err
        w[:, end:] -= errors @ h_inv[start:end, end:]
    return result, scales


@torch.no_grad()
def quantize_weights(model: nn.Module, method: str, Q: dict, scale_dtype: str = "bfloat16",
                     hessians: dict[str, torch.Tensor] | None = None, section: str = "drafter_quant") -> list[str]:
    """Quantise `model` in place (modelopt quantisers stay attached; their fake-quant forward is the
    quantised model). method "rtn" or "gptq" (needs `hessians`, from `collect_hessians`). Returns the
    quantised module names."""
    if method not in METHODS:
        raise QuantParamsError(f"quantisation method {method!r}: use one of {METHODS}")
    linears = check_params(model, Q, section)
    dtype = getattr(torch, scale_dtype)
    if method == "gptq":
        missing = sorted(set(linears) - set(hessians or {}))
        if missing:
            raise ValueError(f"GPTQ needs the input Hessian of every quantised Linear; none for {missing[0]}")
    attach_quantizers(model, linears, Q["bits"], Q["group_size"], dtype)
    if method == "gptq":
        for name, module in linears.items():
            weight, scales = gptq_weight(module.weight, hessians[name], scales_of(module, Q["bits"]), bits=Q["bits"],
                                         percdamp=Q["percdamp"], update_block=Q["update_block"],
                                         static_groups=Q["static_groups"], scale_dtype=dtype)
            module.weight.data = weight.to(module.weight.dtype)
            set_scales(module, scales, Q["bits"])
    return sorted(linears)


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    return grid.quantized_modules(model)


@torch.no_grad()
def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight a (fake-)quantised Linear computes with."""
    quantizer = getattr(module, "weight_quantizer", None)
    weight = module.weight.detach().float()
    return quantizer(weight) if quantizer is not None and quantizer.is_enabled else weight


@torch.no_grad()
def output_errors(reference: nn.Module, quantized: nn.Module, hessians: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per Linear, the relative output error on the calibration inputs, from the Hessians:
    ||X (W_q - W)^T||^2 / ||X W^T||^2 = tr(dW H dW^T) / tr(W H W^T)."""
    ref_modules, q_modules = dict(reference.named_modules()), dict(quantized.named_modules())
    errors = {}
    for name, h in hessians.items():
        w = ref_modules[name].weight.detach().float()
        delta = effective_weight(q_modules[name]) - w
        h = h.to(w.device)
        errors[name] = float(((delta @ h) * delta).sum() / ((w @ h) * w).sum().clamp_min(1e-30))
    return errors


# ----------------------------------------------------------------------------------------- pack

def ignore_list(keep_patterns: list[str]) -> list[str]:
    """compressed-tensors `ignore` entries for modules kept in high precision (vLLM matches `re:` entries
    with re.match against its own module names, hence the leading .*)."""
    return [f"re:.*{p}" for p in keep_patterns]


def pack_tensors(model: nn.Module, bits: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    quantized = quantized_linears(model)
    tensors = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        if module_name in quantized and leaf == "weight":
            codes, scales = weight_codes(quantized[module_name], bits)
            tensors[f"{module_name}.weight_packed"] = pack_to_int32(codes.cpu(), bits, packed_dim=1)
            tensors[f"{module_name}.weight_scale"] = scales.cpu().to(dtype)
            tensors[f"{module_name}.weight_shape"] = torch.tensor(list(codes.shape), dtype=torch.int64)
        else:
            tensors[name] = param.detach().cpu().to(dtype).contiguous()
    return tensors


def write_pack(model: nn.Module, out_dir: Path, config: dict, Q: dict, scale_dtype: str, ct_version: str,
               extra_files: dict[str, bytes] | None = None) -> dict:
    """Write `model` (quantised by `quantize_weights`) as a compressed-tensors checkpoint: `config`
    (the model's own config.json dict) plus `quantization_config`; atomically."""
    dtype = getattr(torch, scale_dtype)
    block = quantization_config(Q["group_size"], ignore_list(Q["keep_bf16"]), ct_version)
    for scheme in block["config_groups"].values():
        scheme["weights"]["num_bits"] = Q["bits"]
    tensors = pack_tensors(model, Q["bits"], dtype)
    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        write_json(tmp / "config.json", {**config, "dtype": scale_dtype, "quantization_config": block})
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
    kept = sorted(n for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) and n not in quantized_linears(model))
    return {"dir": str(out_dir), "quantized_modules": len(quantized_linears(model)), "kept_bf16": kept,
            "bytes": (out_dir / WEIGHTS_FILE).stat().st_size}


def pack_bits(ct_dir: Path) -> int:
    config = json.loads((Path(ct_dir) / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    return int(next(iter(groups.values()))["weights"]["num_bits"])


def read_pack(ct_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {"codes": int8 [out, in], "scale": [out, in / group]}} of a pack written by `write_pack`
    (any bit width; `pack_ct.read_ct_pack` reads the same 4-bit packs)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    bits = pack_bits(ct_dir)
    raw: dict[str, dict] = {}
    with safe_open(str(Path(ct_dir) / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            module, _, leaf = key.rpartition(".")
            if leaf in ("weight_packed", "weight_scale", "weight_shape"):
                raw.setdefault(module, {})[leaf] = f.get_tensor(key)
    modules = {}
    for name, parts in raw.items():
        shape = torch.Size(parts["weight_shape"].tolist())
        codes = unpack_from_int32(parts["weight_packed"], bits, shape, packed_dim=1)
        modules[name] = {"codes": codes, "scale": parts["weight_scale"]}
    return modules


def dequantized_state_dict(ct_dir: Path) -> dict[str, torch.Tensor]:
    """A plain state dict of a pack: each packed weight as codes x stored scale (what vLLM computes
    with), every other tensor as stored."""
    state = dict(read_passthrough(ct_dir))
    for name, parts in read_pack(ct_dir).items():
        state[f"{name}.weight"] = dequantize(parts["codes"], parts["scale"])
    return state


def verify_pack(model: nn.Module, ct_dir: Path, bits: int, scale_dtype: str) -> dict:
    """The pack's codes and scales must equal the quantised model's, bit for bit."""
    stored = read_pack(ct_dir)
    quantized = quantized_linears(model)
    if set(stored) != set(quantized):
        raise ValueError(f"{ct_dir}: packed modules {sorted(set(stored) ^ set(quantized))[:3]} differ from the "
                         f"model's quantised modules")
    dtype = getattr(torch, scale_dtype)
    for name, module in quantized.items():
        codes, scales = weight_codes(module, bits)
        if not torch.equal(codes.cpu(), stored[name]["codes"]) or not torch.equal(scales.cpu().to(dtype),
                                                                                  stored[name]["scale"]):
            raise ValueError(f"{ct_dir}: {name}: packed codes or scales differ from the quantised model's")
    return {"modules": len(stored), "codes_compared": sum(v["codes"].numel() for v in stored.values()),
            "codes_equal": True}
