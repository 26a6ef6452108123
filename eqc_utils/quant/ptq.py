"""The INT4 init: where the grid comes from, and the student built on it (docs/recipe.md §2.1-2.3).

Two sources, chosen by `quant.init`, both ending in a compressed-tensors INT4 pack:
- "awq": real post-training quantisation of the teacher with nvidia-modelopt's AWQ clip search
  (per-group clipping ratios chosen on calibration activations), packed like any other grid. AWQ's
  clip search gives a pure per-group scale grid, as the paper's MSE-searched cyankiwi grid is; the
  activation-scaling half of AWQ would need its scales folded into the previous norms first.
- "ct_pack": a published pack such as `cyankiwi/Qwen3.5-4B-AWQ-4bit`.

The student is the teacher's architecture with every packed Linear overwritten by its dequantised
weight (codes x scale), then modelopt quantisers pinned to the pack's scales. The "PTQ model" of
the start gate is the same dequantised weights without quantisers.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from eqc_utils.quant import grid
from eqc_utils.quant.pack_ct import dequantize, read_ct_pack, read_passthrough, write_ct_pack



def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.config.use_cache = False
    return model


def resolve_pack(spec: str, hub_allowed: bool) -> Path:
    """A local folder for `quant.init_pack` (hub snapshot only when the profile allows the hub)."""
    path = Path(spec)
    if path.exists():
        return path
    if not hub_allowed:
        raise FileNotFoundError(f"quant.init_pack = '{spec}' is not a local folder and assets.hub_allowed is "
                                f"false: download it first and point quant.init_pack at the folder")
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(spec, allow_patterns=["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja"]))


def awq_pack(teacher_path: Path, calib_ids: torch.Tensor, quant: dict, pack: dict, out_dir: Path,
             device: str = "cpu") -> dict:
    """PTQ of the teacher with modelopt AWQ (clip search), written as a compressed-tensors pack.

    The pack stores scales in `pack.scale_dtype`; the grid is snapped onto those storable scales
    before packing, so the pack holds exactly the grid that QAD will be pinned to.
    """
    from tqdm.auto import tqdm

    # The clip search runs where the model is: on a GPU it takes seconds, on 2 CPU cores minutes.
    model = load_causal_lm(teacher_path).to(device)
    if not quant["cuda_extension"]:
        grid.skip_cuda_extension()

    def forward_loop(m):
        with torch.no_grad():
            for row in tqdm(calib_ids, desc="AWQ calibration", leave=False):
                m(row[None].to(device))

    # awq_clip scores 11 clip ratios per group on a subsample of each Linear's input tokens; its cost grows
    # with that subsample (quant.awq_tokens_per_batch), which the tiny profile keeps small for 2 CPU cores.
    algorithm = {"method": "awq_clip", "max_tokens_per_batch": quant["awq_tokens_per_batch"],
                 "max_co_batch_size": 4096}  # modelopt fake-quantises the whole weight once per output batch
    grid.attach_int4_quantizers(model, quant, forward_loop=forward_loop, algorithm=algorithm)
    model.to("cpu")
    storable = getattr(torch, pack["scale_dtype"])
    grid.pin_grid(model, {name: grid.grid_scales(m).to(storable).float()
                          for name, m in grid.quantized_modules(model).items()})
    return write_ct_pack(model, out_dir, sidecars_from=teacher_path, pack=pack, group_size=quant["group_size"])


def _model_name(pack_name: str, model_names: set[str]) -> str | None:
    """Pack names follow the hub checkpoint (`model.language_model.*` for Qwen3.5); map to the model's."""
    for candidate in (pack_name, pack_name.replace("model.language_model.", "model.", 1)):
        if candidate in model_names:
            return candidate
    return None


@torch.no_grad()
def overlay_pack(model: nn.Module, pack_dir: Path, skip_patterns: list[str]) -> dict[str, dict]:
    """Write the pack's dequantised weights (and its high-precision tensors) into `model`.

    Returns {model module name: {"codes", "scale"}}. A packed module the model lacks is fatal
    unless it is skipped on purpose (e.g. cyankiwi's MTP block, absent from the HF model).
    """
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    grid_of = {}
    for pack_name, entry in read_ct_pack(pack_dir).items():
        name = _model_name(pack_name, set(modules))
        if name is None:
            if grid.is_skipped(pack_name, skip_patterns):
                continue
            raise grid.GridError(f"{pack_dir}: packed module {pack_name} has no counterpart in the model")
        weight = modules[name].weight
        if tuple(weight.shape) != tuple(entry["codes"].shape):
            raise grid.GridError(f"{pack_dir}: {pack_name} is {tuple(entry['codes'].shape)} in the pack, "
                                 f"{tuple(weight.shape)} in the model")
        weight.copy_(dequantize(entry["codes"], entry["scale"]).to(weight.dtype))
        grid_of[name] = entry
    for key, tensor in read_passthrough(pack_dir).items():
        name = _model_name(key, set(params))
        if name is not None and params[name].shape == tensor.shape:
            params[name].copy_(tensor.to(params[name].dtype))
    return grid_of


def dense_ptq_model(base_path: Path, pack_dir: Path, quant: dict, dtype=torch.float32) -> nn.Module:
    """The PTQ model as deployed: dequantised pack weights, no quantisers (the gate's reference)."""
    model = load_causal_lm(base_path, dtype)
    overlay_pack(model, pack_dir, quant["skip_patterns"])
    return model.eval()


def student_from_pack(base_path: Path, pack_dir: Path, quant: dict, dtype=torch.float32):
    """(student with modelopt quantisers pinned to the pack's grid, the pack's codes by module).

    Proves the pin before returning: the quantiser's codes of the latent weights equal the pack's.
    """
    model = load_causal_lm(base_path, dtype)
    grid_of = overlay_pack(model, pack_dir, quant["skip_patterns"])
    grid.attach_int4_quantizers(model, quant)
    unpinned = sorted(set(grid.quantized_modules(model)) - set(grid_of))
    if unpinned:
        raise grid.GridError(f"{pack_dir} has no grid for {len(unpinned)} modules the model quantises "
                             f"(e.g. {unpinned[0]}); add them to quant.skip_patterns or use another pack")
    grid.pin_grid(model, {name: entry["scale"] for name, entry in grid_of.items()})
    codes = {name: entry["codes"] for name, entry in grid_of.items()}
    wrong = grid.codes_mismatch(model, codes)
    if wrong:
        first = next(iter(wrong))
        raise grid.GridError(f"pin proof failed: {len(wrong)} modules' fake-quant codes differ from {pack_dir} "
                             f"(e.g. {first}: {wrong[first]} codes)")
    for module in grid.quantized_modules(model).values():
        grid.check_codes_are_quantizer_output(module)
    return model, codes
