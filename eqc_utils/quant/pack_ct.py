"""Ship the grid: compressed-tensors `pack-quantized` W4A16 (what vLLM loads) + the dense twin.

Per quantised Linear `M` (METHOD.md §2.8): `M.weight_packed` int32 [out, in/8] packed by
compressed-tensors' own `pack_to_int32` from the codes of `grid.grid_codes` (the quantiser's own
expression, never re-derived scales), `M.weight_scale` [out, in/group] = amax / 7 in the scale
dtype, `M.weight_shape` int64 [out, in]; no zero point (symmetric). Every other parameter passes
through in the model dtype, and every Linear left in high precision is named in `ignore`.

The dense twin holds the same tensors except each quantised weight is `codes x stored scale` (what
vLLM reconstructs), as a plain checkpoint transformers loads: the drafter is trained against it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from eqc_utils.io import atomic_path, write_json
from eqc_utils.quant.grid import grid_codes, grid_scales, quantized_modules

WEIGHTS_FILE = "model.safetensors"
NUM_BITS = 4
SIDECAR_SKIP = {"config.json", "model.safetensors", "model.safetensors.index.json", "grid_amax.safetensors"}


class PackError(ValueError):
    """A compressed-tensors pack is malformed or does not reproduce the model's codes."""


def quantization_config(group_size: int, ignore: list[str], version: str) -> dict:
    """The `quantization_config` block, built with compressed-tensors' own schema."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=NUM_BITS, type="int", symmetric=True, strategy="group",
                               group_size=group_size, dynamic=False, observer="minmax")
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, format="pack-quantized")
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", ignore=ignore)
    block = json.loads(config.model_dump_json())
    block.update(quant_method="compressed-tensors", version=version, sparsity_config={}, transform_config={})
    return block


def high_precision_linears(model: nn.Module) -> list[str]:
    """Linear modules that keep their weights (the pack's ignore list), sorted."""
    quantized = set(quantized_modules(model))
    names = [name.removeprefix("module.") for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return sorted(n for n in names if n not in quantized)


def pack_tensors(model: nn.Module, scale_dtype: torch.dtype, dtype: torch.dtype) -> tuple[dict, dict]:
    """(compressed tensors, dense-twin tensors) for the model's parameters; tied weights appear once."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    quantized = quantized_modules(model)
    packed, dense = {}, {}
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        module_name, _, leaf = name.rpartition(".")
        if module_name in quantized and leaf == "weight":
            module = quantized[module_name]
            codes = grid_codes(module).cpu()
            scale = grid_scales(module).cpu().to(scale_dtype)
            packed[f"{module_name}.weight_packed"] = pack_to_int32(codes, NUM_BITS, packed_dim=1)
            packed[f"{module_name}.weight_scale"] = scale
            packed[f"{module_name}.weight_shape"] = torch.tensor(list(codes.shape), dtype=torch.int64)
            group = codes.shape[1] // scale.shape[1]
            dense[name] = (codes.float() * scale.float().repeat_interleave(group, dim=1)).to(dtype)
        else:
            packed[name] = dense[name] = param.detach().cpu().to(dtype).contiguous()
    return packed, dense


def copy_sidecars(source: Path, dest: Path) -> None:
    """Tokenizer, chat template, generation and preprocessor configs: vLLM needs them beside weights."""
    for path in Path(source).iterdir():
        if path.is_file() and path.name not in SIDECAR_SKIP and not path.name.endswith((".safetensors", ".bin", ".pt")):
            shutil.copy2(path, dest / path.name)


def write_ct_pack(model: nn.Module, ct_dir: Path, sidecars_from: Path, pack: dict, group_size: int,
                  dense_dir: Path | None = None) -> dict:
    """Write the compressed-tensors pack (and, if asked, the dense twin); return a summary."""
    scale_dtype = getattr(torch, pack["scale_dtype"])
    packed, dense = pack_tensors(model, scale_dtype, dtype=scale_dtype)
    ignore = high_precision_linears(model)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = pack["scale_dtype"]
    config["torch_dtype"] = pack["scale_dtype"]
    targets = [(Path(ct_dir), packed, {**config, "quantization_config":
                                       quantization_config(group_size, ignore, pack["ct_version"])})]
    if dense_dir is not None:
        targets.append((Path(dense_dir), dense, config))
    for folder, tensors, folder_config in targets:
        with atomic_path(folder) as tmp:
            tmp.mkdir(parents=True)
            copy_sidecars(Path(sidecars_from), tmp)
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            write_json(tmp / "config.json", folder_config)
    return {"quantized_modules": len(quantized_modules(model)), "ignore": ignore,
            "ct_dir": str(ct_dir), "dense_dir": str(dense_dir) if dense_dir else None}


def read_ct_pack(ct_dir: Path) -> dict[str, dict]:
    """{module: {"codes": int8 [out, in], "scale": [out, in/group]}} from a pack's safetensors files."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    files = sorted(Path(ct_dir).glob("*.safetensors"))
    if not files:
        raise PackError(f"{ct_dir}: no *.safetensors files; is this a compressed-tensors checkpoint folder?")
    raw: dict[str, dict] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                for leaf in ("weight_packed", "weight_scale", "weight_shape"):
                    if key.endswith("." + leaf):
                        raw.setdefault(key[: -len(leaf) - 1], {})[leaf] = f.get_tensor(key)
    modules = {}
    for name, parts in raw.items():
        if len(parts) != 3:
            raise PackError(f"{ct_dir}: module {name} has {sorted(parts)}, expected weight_packed, "
                            f"weight_scale and weight_shape (a symmetric pack-quantized checkpoint)")
        shape = torch.Size(parts["weight_shape"].tolist())
        codes = unpack_from_int32(parts["weight_packed"], NUM_BITS, shape, packed_dim=1)
        modules[name] = {"codes": codes, "scale": parts["weight_scale"]}
    return modules


def read_passthrough(ct_dir: Path) -> dict[str, torch.Tensor]:
    """The high-precision tensors of a pack (everything that is not a packed weight's part)."""
    out = {}
    for file in sorted(Path(ct_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if not key.endswith((".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point")):
                    out[key] = f.get_tensor(key)
    return out


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes x scale (scale repeated over each group) in fp32: exact for INT4 x bf16/fp16 scales."""
    group = codes.shape[1] // scale.shape[1]
    return codes.float() * scale.float().repeat_interleave(group, dim=1)


def verify_pack(model: nn.Module, ct_dir: Path) -> dict:
    """Unpacked codes of the pack must equal the model's fake-quant codes bit for bit."""
    stored = read_ct_pack(ct_dir)
    quantized = quantized_modules(model)
    if set(stored) != set(quantized):
        raise PackError(f"{ct_dir}: packed modules differ from the model's quantised modules "
                        f"({len(stored)} vs {len(quantized)})")
    mismatched = {n: int((grid_codes(m).cpu() != stored[n]["codes"]).sum()) for n, m in quantized.items()}
    mismatched = {n: c for n, c in mismatched.items() if c}
    if mismatched:
        first = next(iter(mismatched))
        raise PackError(f"{ct_dir}: {len(mismatched)} modules' packed codes differ from the quantiser's "
                        f"(e.g. {first}: {mismatched[first]} codes)")
    n_codes = sum(v["codes"].numel() for v in stored.values())
    return {"modules": len(stored), "codes_compared": n_codes, "codes_equal": True}
