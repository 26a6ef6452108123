"""The QAD student's INT4 Linears as one plain autograd function per weight, for training speed.

modelopt's quantised Linear routes every forward through its quantiser object: block reshapes, dtype
bookkeeping and, on CPU, three `if amax ...` tests per call that each read a tensor on the host (630 host
reads per forward of SmolLM2's 210 quantised Linears). It also hides the weight behind dynamic attributes that
`torch.compile` cannot trace. Once the grid is pinned none of that is needed: the forward is a fixed expression
of the latent weight and the pinned `_amax` buffer.

`use_pinned_int4_forward` gives each quantised Linear of a model a forward that computes exactly modelopt's
fake quantisation (`_tensor_quant`: round(W * 7/amax) clamped to [-8, 7], divided by 7/amax, in fp32; a zero
group gives 0) and its straight-through gradient with clipping (the gradient flows where |W| <= amax),
without host reads. It reads `_amax` from the quantiser at every call, so a grid restored or re-pinned later is
the one used; modelopt's modules, buffers and state-dict keys stay as they are (checkpoints and the pack do
not change). Tests prove it equal to modelopt's quantiser in value and gradient.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from eqc_utils.quant.grid import INT4_MAX, INT4_MIN, ZERO_AMAX, GridError, int4_step, quantized_modules


class PinnedInt4(torch.autograd.Function):
    """fake_quant(weight) on a pinned grid: `amax` is [out x groups, 1] (modelopt's static block layout)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, amax: torch.Tensor, group: int) -> torch.Tensor:
        blocked = weight.float().reshape(-1, group)
        step = int4_step(amax)                  # grid_codes' scale: the codes are the pack's
        codes = torch.clamp((blocked * step).round_(), INT4_MIN, INT4_MAX)
        ctx.save_for_backward(weight, amax)
        ctx.group = group
        return (codes / torch.where(amax <= ZERO_AMAX, 1.0, step)).reshape(weight.shape).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weight, amax = ctx.saved_tensors
        inside = (weight.reshape(-1, ctx.group).abs() <= amax).reshape(weight.shape)
        return torch.where(inside, grad_output, torch.zeros((), dtype=grad_output.dtype,
                                                              device=grad_output.device)), None, None


def _pinned_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    quantizer = self._modules["weight_quantizer"]
    weight = PinnedInt4.apply(self._parameters["weight"], quantizer._buffers["_amax"], quantizer.block_sizes[-1])
    return F.linear(input, weight, self._parameters["bias"])


def _unsupported(name: str, module: nn.Module) -> str | None:
    """Why modelopt's forward of this module is not the pinned INT4 expression (None: it is)."""
    weight_q = module.weight_quantizer
    checks = {
        "its input or output is quantised too": any(getattr(module, q).is_enabled
                                                    for q in ("input_quantizer", "output_quantizer")),
        "the weight quantiser is not 4-bit signed with the full range [-8, 7]":
            weight_q.num_bits != 4 or weight_q.unsigned or weight_q.narrow_range,
        "the weight quantiser is not static per-group along the input":
            not weight_q.block_sizes or weight_q.block_sizes.get("type", "static") != "static"
            or set(weight_q.block_sizes) - {-1, "type"},
        "it scales, rotates or biases before quantising (pre_quant_scale, rotation, bias)":
            weight_q.pre_quant_scale is not None or weight_q._rotate or weight_q._get_bias(module.weight) is not None,
        "it is calibrating, uses a custom backend or passes gradients through unclipped":
            weight_q._if_calib or weight_q.backend is not None or weight_q._pass_through_bwd
            or not weight_q._fake_quant,
        "it has no fp32 _amax": getattr(weight_q, "_amax", None) is None or weight_q._amax.dtype != torch.float32,
    }
    reason = next((why for why, failed in checks.items() if failed), None)
    return None if reason is None else f"{name}: {reason}"


def use_pinned_int4_forward(model: nn.Module) -> int:
    """Give every quantised Linear the pinned INT4 forward (call after `pin_grid`); returns how many.
    GridError, naming the module, if one is not a plain pinned INT4 weight quantiser (keep qad.fake_quant =
    modelopt for such models)."""
    modules = quantized_modules(model)
    for name, module in modules.items():
        reason = _unsupported(name, module)
        if reason is not None:
            raise GridError(f"qad.fake_quant = pinned cannot take over {reason}; set qad.fake_quant: modelopt")
    for module in modules.values():
        module.forward = types.MethodType(_pinned_forward, module)
    return len(modules)
