"""Ship the grid: compressed-tensors `pack-quantized` W4A16 (what vLLM loads) + the dense twin.

Per quantised Linear `M` (docs/recipe.md §2.8): `M.weight_packed` int32 [out, in/8] packed by
compressed-tensors' own `pack_to_int32` from the codes of `grid.grid_codes` (the quantiser's own
expression, never re-derived scales), `M.weight_scale` [out, in/group] = amax / 7 in the scale
dtype, `M.weight_shape` int64 [out, in]; no zero point (symmetric). Every other parameter passes
through in the model dtype, and every Linear left in high precision is named in `ignore`.

`read_ct_pack` reads such packs back (ours, or another symmetric INT4 pack such as cyankiwi's) and refuses,
naming the file and module, a pack it would misread: asymmetric (a non-zero `weight_zero_point`),
group-reordered (`weight_g_idx`), or declared other than 4-bit symmetric int in its config.

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


SUPPORTED_PACK = ("a symmetric INT4 pack-quantized checkpoint: per module weight_packed, weight_scale and "
                  "weight_shape, weight = codes x scale, no zero point and no activation reordering (g_idx)")
PACK_LEAVES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def _check_pack_config(ct_dir: Path) -> None:
    """Refuse a pack whose config declares weights this reader would misread (asymmetric, not 4-bit)."""
    path = Path(ct_dir) / "config.json"
    if not path.exists():
        return
    block = json.loads(path.read_text()).get("quantization_config") or {}
    for group_name, group in (block.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        declared = {key: weights[key] for key in ("num_bits", "type", "symmetric") if key in weights}
        if declared.get("num_bits", NUM_BITS) != NUM_BITS or declared.get("type", "int") != "int" \
                or declared.get("symmetric", True) is not True:
            raise PackError(f"{path}: quantization_config group {group_name} declares weights {declared}; "
                            f"supported is {SUPPORTED_PACK}")


def _zero_point_is_zero(zero_point: torch.Tensor, out_features: int, n_groups: int) -> bool:
    """True if a stored zero point is zero everywhere (a symmetric pack that kept its zero points)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    if zero_point.dtype == torch.int32 and tuple(zero_point.shape) == (-(-out_features * NUM_BITS // 32), n_groups):
        # compressed-tensors packs zero points 8 to an int32 along the output dimension, offset by 2^(bits-1)
        zero_point = unpack_from_int32(zero_point, NUM_BITS, torch.Size((out_features, n_groups)), packed_dim=0)
    elif zero_point.numel() not in (out_features * n_groups, 1):
        return False
    return not bool(zero_point.ne(0).any())


def read_ct_pack(ct_dir: Path) -> dict[str, dict]:
    """{module: {"codes": int8 [out, in], "scale": [out, in/group]}} from a pack's safetensors files.

    Only symmetric packs are read (weight = codes x scale). A pack with a non-zero `weight_zero_point`
    (asymmetric: weight = (codes - zero point) x scale) or with a reordering `weight_g_idx` is refused with
    a PackError naming the file and the module, instead of being read as if it were symmetric.
    """
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    files = sorted(Path(ct_dir).glob("*.safetensors"))
    if not files:
        raise PackError(f"{ct_dir}: no *.safetensors files; is this a compressed-tensors checkpoint folder?")
    _check_pack_config(Path(ct_dir))
    raw: dict[str, dict] = {}
    where: dict[tuple[str, str], Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                for leaf in PACK_LEAVES:
                    if key.endswith("." + leaf):
                        module = key[: -len(leaf) - 1]
                        raw.setdefault(module, {})[leaf] = f.get_tensor(key)
                        where[module, leaf] = file
    modules = {}
    for name, parts in raw.items():
        missing = [leaf for leaf in PACK_LEAVES[:3] if leaf not in parts]
        if missing:
            file = where[name, next(iter(parts))]
            raise PackError(f"{file}: module {name} has {sorted(parts)} but lacks {missing}; supported is "
                            f"{SUPPORTED_PACK}")
        shape = torch.Size(parts["weight_shape"].tolist())
        scale = parts["weight_scale"]
        if len(shape) != 2 or scale.ndim != 2 or scale.shape[0] != shape[0] or shape[1] % scale.shape[1]:
            raise PackError(f"{where[name, 'weight_scale']}: module {name} has weight_shape {list(shape)} and "
                            f"weight_scale {list(scale.shape)}: not a per-group scale of a 2-D weight")
        if "weight_zero_point" in parts and not _zero_point_is_zero(parts["weight_zero_point"], shape[0],
                                                                    scale.shape[1]):
            raise PackError(f"{where[name, 'weight_zero_point']}: module {name} has a weight_zero_point that is not "
                            f"all zeros (an asymmetric pack, weight = (codes - zero point) x scale), which this reader "
                            f"would misread as symmetric; supported is {SUPPORTED_PACK}")
        if "weight_g_idx" in parts:
            group = shape[1] // scale.shape[1]
            in_order = torch.arange(shape[1]) // group
            if not torch.equal(parts["weight_g_idx"].long().reshape(-1), in_order):
                raise PackError(f"{where[name, 'weight_g_idx']}: module {name} has a weight_g_idx that reorders "
                                f"its groups (activation ordering); supported is {SUPPORTED_PACK}")
        codes = unpack_from_int32(parts["weight_packed"], NUM_BITS, shape, packed_dim=1)
        modules[name] = {"codes": codes, "scale": scale}
    if not modules:
        raise PackError(f"{ct_dir}: no packed weights (*.weight_packed) in {[f.name for f in files]}; "
                        f"supported is {SUPPORTED_PACK}")
    return modules


def read_passthrough(ct_dir: Path) -> dict[str, torch.Tensor]:
    """The high-precision tensors of a pack (everything that is not a packed weight's part)."""
    out = {}
    for file in sorted(Path(ct_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if not key.endswith(tuple("." + leaf for leaf in PACK_LEAVES)):
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
