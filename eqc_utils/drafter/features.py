"""What the drafter takes from the frozen target: the hidden states of a few decoder layers (its
context), the input embedding (to embed its block) and the LM head (to read tokens out).

Hidden states are caught with forward hooks on the chosen decoder layers, so one mechanism serves
training (where the forward may stop right after the last chosen layer: the rest of the target and
its full-vocabulary head are never computed) and speculative decoding (where the same verification
forward also gives the logits). "Layer i" means the output of decoder layer i, i.e. index i + 1 of
transformers' `hidden_states` tuple, as in the reference.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


class _EnoughLayers(Exception):
    """Raised by the last hook to end a features-only forward early."""


def _decoder(target: nn.Module) -> nn.Module:
    return target.get_decoder() if hasattr(target, "get_decoder") else target.model


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    layers = getattr(_decoder(target), "layers", None)
    if layers is None:
        raise TypeError(f"{type(target).__name__}: cannot find its decoder layers (expected .model.layers)")
    return layers


def final_norm(target: nn.Module) -> nn.Module | None:
    """The norm between the last decoder layer and the LM head (None where the model has none by that name)."""
    return getattr(_decoder(target), "norm", None)


def input_embedding(target: nn.Module) -> nn.Embedding:
    return target.get_input_embeddings()


def output_head(target: nn.Module) -> nn.Module:
    return target.get_output_embeddings()


@contextlib.contextmanager
def capture_layers(target: nn.Module, layer_ids: list[int], stop_early: bool = False):
    """Within the block, every forward of `target` fills the yielded list with the chosen layers'
    outputs, in `layer_ids` order. With `stop_early`, the forward ends after the last chosen layer."""
    layers = decoder_layers(target)
    captured: dict[int, torch.Tensor] = {}
    last = max(layer_ids)
    out: list[torch.Tensor] = []

    def hook(index):
        def fn(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
            if len(captured) == len(set(layer_ids)):
                out[:] = [captured[i] for i in layer_ids]
                captured.clear()
                if stop_early and index == last:
                    raise _EnoughLayers
        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def context_features(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     layer_ids: list[int]) -> torch.Tensor:
    """[B, S, len(layer_ids) * H]: the chosen layers' hidden states, concatenated on the feature axis.
    Runs only the decoder up to the deepest chosen layer (no final norm, no LM head)."""
    with capture_layers(target, layer_ids, stop_early=True) as out:
        try:
            _decoder(target)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _EnoughLayers:
            pass
    return _concatenated(out)


@torch.no_grad()
def context_features_and_last(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                              layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(context_features, last): the same features from one full forward of the target, and its last hidden
    state [B, S, H] after the final norm, what the LM head reads: last[:, p] gives the target's distribution of the
    token at p + 1. The head itself is left to the loss, which applies it chunk by chunk."""
    with capture_layers(target, layer_ids) as out:
        last = _decoder(target)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return _concatenated(out), last


@torch.no_grad()
def context_features_and_greedy(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                                layer_ids: list[int], chunk_positions: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(context_features, greedy): the same features from one full forward of the target, and greedy [B, S]: at
    position p the target's argmax token after positions < p (greedy[:, 0] = input_ids[:, 0]), the token that
    greedy verification accepts there. The LM head runs over `chunk_positions` positions at a time, so the
    [B, S, vocab] logits never exist at once."""
    features, last = context_features_and_last(target, input_ids, attention_mask, layer_ids)
    head = output_head(target)
    flat = last[:, :-1].reshape(-1, last.shape[-1])
    picks = torch.cat([head(flat[i:i + chunk_positions]).argmax(-1) for i in range(0, flat.shape[0], chunk_positions)])
    greedy = torch.cat([input_ids[:, :1], picks.view(input_ids.shape[0], -1)], dim=1)
    return features, greedy


def _concatenated(out: list[torch.Tensor]) -> torch.Tensor:
    if not out:
        raise RuntimeError("the target forward finished without passing the chosen layers; check target_layer_ids")
    return torch.cat(out, dim=-1)


def freeze(target: nn.Module) -> nn.Module:
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target
