"""Reading compressed-tensors packs: symmetric packs as compressed-tensors itself decompresses them;
asymmetric (zero-point) and reordered packs refused, never read as symmetric."""
import json

import pytest
import torch
from safetensors.torch import save_file

from eqc_utils.quant import pack_ct

MODULE = "model.layers.0.mlp.down_proj"
OUT, IN, GROUP = 12, 64, 32


def _compress(symmetric: bool, seed: int = 0) -> tuple[dict, object, torch.Tensor]:
    """One Linear's tensors compressed by compressed-tensors' own pack-quantized compressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    torch.manual_seed(seed)
    weight = torch.randn(OUT, IN)
    groups = weight.view(OUT, IN // GROUP, GROUP)
    if symmetric:
        scale = (groups.abs().amax(-1) / 7).to(torch.bfloat16)
        zero_point = torch.zeros(OUT, IN // GROUP, dtype=torch.int8)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).to(torch.bfloat16)
        zero_point = (-8 - torch.round(low / scale.float())).clamp(-8, 7).to(torch.int8)
        assert zero_point.ne(0).any()
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    reference = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]  # in the scale dtype
    return compressed, args, reference


def _write_pack(folder, compressed: dict, args=None) -> None:
    folder.mkdir()
    tensors = {f"{MODULE}.{leaf}": t.contiguous() for leaf, t in compressed.items()}
    tensors["model.embed_tokens.weight"] = torch.zeros(4, IN)
    save_file(tensors, str(folder / "model.safetensors"))
    if args is not None:
        block = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": json.loads(args.model_dump_json())}}}
        (folder / "config.json").write_text(json.dumps({"quantization_config": block}))


def test_symmetric_pack_reads_as_compressed_tensors_decompresses_it(tmp_path):
    compressed, args, reference = _compress(symmetric=True)
    assert "weight_zero_point" not in compressed
    _write_pack(tmp_path / "ct", compressed, args)
    stored = pack_ct.read_ct_pack(tmp_path / "ct")
    assert set(stored) == {MODULE}
    assert reference.dtype == torch.bfloat16
    assert torch.equal(pack_ct.dequantize(stored[MODULE]["codes"], stored[MODULE]["scale"]).to(reference.dtype),
                       reference)
    assert set(pack_ct.read_passthrough(tmp_path / "ct")) == {"model.embed_tokens.weight"}


def test_all_zero_zero_point_is_symmetric(tmp_path):
    """A symmetric pack that kept its (packed, all-zero) zero points reads like one without them."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    compressed, _, reference = _compress(symmetric=True)
    zero = pack_to_int32(torch.zeros(OUT, IN // GROUP, dtype=torch.int8), 4, packed_dim=0)
    _write_pack(tmp_path / "ct", {**compressed, "weight_zero_point": zero})
    stored = pack_ct.read_ct_pack(tmp_path / "ct")[MODULE]
    assert torch.equal(pack_ct.dequantize(stored["codes"], stored["scale"]).to(reference.dtype), reference)


def test_asymmetric_pack_is_refused_naming_file_and_module(tmp_path):
    compressed, args, reference = _compress(symmetric=False)
    assert compressed["weight_zero_point"].dtype == torch.int32  # packed 8 per int32 along the output dim
    # Tensors alone (no config.json): the zero point itself is what gives the pack away.
    _write_pack(tmp_path / "tensors_only", compressed)
    with pytest.raises(pack_ct.PackError) as error:
        pack_ct.read_ct_pack(tmp_path / "tensors_only")
    message = str(error.value)
    assert str(tmp_path / "tensors_only" / "model.safetensors") in message and MODULE in message
    assert "weight_zero_point" in message and "asymmetric" in message and "supported is a symmetric INT4" in message
    # What reading it as symmetric would have produced is far from the real weights: the error matters.
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    codes = unpack_from_int32(compressed["weight_packed"], 4, torch.Size((OUT, IN)))
    assert not torch.allclose(pack_ct.dequantize(codes, compressed["weight_scale"]), reference.float(), atol=0.05)
    # With its config.json, the declaration is refused first.
    _write_pack(tmp_path / "with_config", compressed, args)
    with pytest.raises(pack_ct.PackError, match=r"config\.json: quantization_config group group_0 declares .*"
                                                r"'symmetric': False.*supported is a symmetric INT4"):
        pack_ct.read_ct_pack(tmp_path / "with_config")


def test_reordered_groups_and_other_bit_widths_are_refused(tmp_path):
    compressed, args, _ = _compress(symmetric=True)
    shuffled = torch.randperm(IN, generator=torch.Generator().manual_seed(0)) // GROUP
    _write_pack(tmp_path / "g_idx", {**compressed, "weight_g_idx": shuffled.int()})
    with pytest.raises(pack_ct.PackError, match=f"{MODULE} has a weight_g_idx that reorders"):
        pack_ct.read_ct_pack(tmp_path / "g_idx")
    _write_pack(tmp_path / "in_order", {**compressed, "weight_g_idx": (torch.arange(IN) // GROUP).int()})
    assert set(pack_ct.read_ct_pack(tmp_path / "in_order")) == {MODULE}
    _write_pack(tmp_path / "int8", compressed, args.model_copy(update={"num_bits": 8}))
    with pytest.raises(pack_ct.PackError, match="'num_bits': 8"):
        pack_ct.read_ct_pack(tmp_path / "int8")
    _write_pack(tmp_path / "no_packed", {"weight_scale": compressed["weight_scale"]})
    with pytest.raises(pack_ct.PackError, match=f"module {MODULE} has \\['weight_scale'\\] but lacks"):
        pack_ct.read_ct_pack(tmp_path / "no_packed")
