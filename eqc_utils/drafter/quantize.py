"""What notebook 08 does, as a few sentences: the fine-tuned drafter quantised to W4A16 by GPTQ (and by
round-to-nearest, the baseline), packed for vLLM with its sliding window, and measured.

    loop = calibration_loop(target, tokenizer, calib_rows, P, DQ, seed)
    result = quantize_drafter(drafter_dir, loop, DQ, S.params["pack"], {"gptq": S.path("drafter_w4"),
                              "rtn": S.path("drafter_w4_rtn")}, window=DQ["window"])
    taus = tau_table({"BF16": drafter_dir, "W4 GPTQ": ..., "W4 RTN": ...}, target, prompts, stops, P)

Calibration is built as in training: QAD-target conversations, tokenised with the drafter's data code,
the target's hidden states as context, `calib_anchors` blocks per conversation drawn like training
anchors, all blocks of a conversation in one teacher-forced pass under the anchor-strict mask (plus the
drafter's window). Each context position is projected once, as at inference, where context K/V are
computed once and cached; the reference instead re-ran the drafter per anchor on the prefix.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from eqc_utils.drafter.data import build_examples
from eqc_utils.drafter.features import context_features, input_embedding
from eqc_utils.drafter.mask import build_block_mask
from eqc_utils.drafter.model import load_drafter
from eqc_utils.drafter.objective import block_targets, sample_anchors
from eqc_utils.drafter.swa import AS_SAVED, measure, set_window
from eqc_utils.quant import gptq

META_FILE = "quant_meta.json"


def calibration_loop(target, tokenizer, rows: list[dict], P: dict, DQ: dict, seed: int = 0):
    """forward_loop(drafter) for modelopt-style calibration: one teacher-forced pass per conversation."""
    def forward_loop(drafter):
        cfg = drafter.config
        examples = build_examples(rows[:DQ["calib_conversations"]], tokenizer, P["max_length"], 2 * cfg.block_size,
                                  where="drafter_quant calibration")
        generator = torch.Generator().manual_seed(seed)
        device = next(drafter.parameters()).device
        blocks_seen = 0
        with torch.no_grad():
            for example in examples:
                ids = torch.tensor([example.input_ids], device=device)
                loss_mask = torch.tensor([example.loss_mask], device=device)
                lengths = torch.tensor([ids.shape[1]], device=device)
                features = context_features(target, ids, None, cfg.target_layer_ids)
                anchors, valid = sample_anchors(loss_mask, lengths, cfg.block_size, DQ["calib_anchors"], generator)
                blocks = block_targets(ids, loss_mask, lengths, anchors, valid, cfg.block_size, cfg.mask_token_id, 1.0)
                mask = build_block_mask(anchors, valid, ids.shape[1], cfg.block_size, P["attention"])
                positions = torch.cat([torch.arange(ids.shape[1], device=device)[None], blocks["positions"]], dim=1)
                drafter(input_embedding(target)(blocks["block_ids"]), features, positions, mask=mask)
                blocks_seen += int(valid.sum())
        forward_loop.conversations, forward_loop.blocks = len(examples), blocks_seen
    return forward_loop


def quantize_drafter(drafter_dir: Path, forward_loop, DQ: dict, pack: dict, outputs: dict[str, Path],
                     window: int | None, device: str = "cpu") -> dict:
    """Calibrate once, then quantise a copy of the drafter per method in `outputs` ({"gptq": dir, "rtn": dir}),
    each written as a compressed-tensors pack with `window` in its config and checked bit-exact.
    Returns {"layers": per-Linear relative output errors per method, "packs": summaries, "seconds": ...}."""
    base = set_window(load_drafter(drafter_dir, device=device, dtype=torch.float32).eval(), window)
    names = sorted(gptq.check_params(base, DQ))
    started = time.perf_counter()
    hessians = gptq.collect_hessians(base, forward_loop, names)
    seconds = {"calibration": time.perf_counter() - started}
    errors, packs = {}, {}
    for method, out_dir in outputs.items():
        started = time.perf_counter()
        model = copy.deepcopy(base)
        gptq.quantize_weights(model, method, DQ, pack["scale_dtype"], hessians)
        seconds[method] = time.perf_counter() - started
        errors[method] = gptq.output_errors(base, model, hessians)
        meta = {"method": method, "source": str(drafter_dir), "window": window,
                **{k: DQ[k] for k in ("bits", "group_size", "percdamp", "update_block", "static_groups", "keep_bf16",
                                      "calib_conversations", "calib_anchors")},
                "calibration": {"conversations": getattr(forward_loop, "conversations", None),
                                "blocks": getattr(forward_loop, "blocks", None)}}
        packs[method] = gptq.write_pack(model, out_dir, model.config.to_hf_dict(), DQ, pack["scale_dtype"],
                                        pack["ct_version"], extra_files={META_FILE: json.dumps(meta, indent=2).encode()})
        packs[method]["verify"] = gptq.verify_pack(model, out_dir, DQ["bits"], pack["scale_dtype"])
    layers = [{"module": name, **{method: errors[method][name] for method in outputs}} for name in names]
    return {"layers": layers, "packs": packs, "seconds": seconds,
            "bf16_bytes": sum(p.numel() * 2 for p in base.parameters())}


def tau_table(drafters: dict[str, Path], target, prompts: list[list[int]], stops: set[int], P: dict,
              window=None) -> list[dict]:
    """tau and drafter ms/step of several drafters on the same prompts, all with the same `window`
    (default full attention, so that quantisation alone differs; AS_SAVED = each one's own)."""
    rows = []
    for label, path in drafters.items():
        result = measure(path, target, prompts, stops, P, window=window)
        rows.append({"drafter": label, **result})
    return rows


def vllm_check(target_ct: Path, target, drafter_dir: Path, prompts: list[list[int]], stops: set[int], P: dict,
               log_dir: Path | None = None, device: str = "auto", labels: list[str] | None = None) -> dict:
    """vLLM serving the W4 target with the W4 drafter vs plain vLLM decoding (token ids; near-ties of plain
    decoding pass, see `serve_check.vllm_dflash_check`), and vLLM's mean acceptance length vs the reference
    decoder's tau on the same prompts: with the drafter's window (what vLLM is asked to do) and without it."""
    from eqc_utils import io
    from eqc_utils.drafter.serve_check import vllm_dflash_check

    block = int(io.read_json(Path(drafter_dir) / "config.json")["block_size"])
    check = vllm_dflash_check(target_ct, drafter_dir, prompts, P["eval_max_new_tokens"], block, P["vllm_args"],
                              near_tie_margin=P["near_tie_margin"], log_dir=log_dir, device=device, labels=labels)
    windowed = measure(drafter_dir, target, prompts, stops, P, window=AS_SAVED)
    full = measure(drafter_dir, target, prompts, stops, P, window=None)
    check.update(reference_tau=windowed["tau"], reference_tau_full_attention=full["tau"], window=windowed["window"])
    if check.get("vllm_tau"):
        check["relative_gap"] = (check["vllm_tau"] - windowed["tau"]) / windowed["tau"]
    return check


def plot_tau(rows: list[dict], *paths: Path):
    """tau per drafter (bars) and P(draft k accepted) per block position (lines)."""
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_pos) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_tau.bar([r["drafter"] for r in rows], [r["tau"] for r in rows], color=["gray", "tab:blue", "tab:orange"][:len(rows)])
    for r in rows:
        rates = r["acceptance_per_position"]
        ax_pos.plot(range(1, len(rates) + 1), rates, marker=".", label=f"{r['drafter']} (tau {r['tau']:.2f})")
    ax_tau.set(ylabel="tau (tokens / verify step)", title="acceptance length, held-out prompts")
    ax_pos.set(xlabel="block position k", ylabel="P(draft k accepted)", title="acceptance per position", ylim=(0, 1))
    ax_pos.legend()
    _save(fig, paths)
    return fig


def plot_layer_errors(layers: list[dict], *paths: Path):
    """Relative output error of every Linear on the calibration inputs, GPTQ vs RTN (log scale)."""
    import matplotlib.pyplot as plt
    import numpy as np

    methods = [m for m in ("rtn", "gptq") if m in layers[0]]
    x = np.arange(len(layers))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(layers)), 3.8))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        ax.bar(x + i * width, [row[method] for row in layers], width, label=method.upper())
    ax.set_xticks(x + width * (len(methods) - 1) / 2, [row["module"].replace("self_attn.", "").replace("mlp.", "")
                                                      for row in layers], rotation=90, fontsize=7)
    ax.set(yscale="log", ylabel="||X(Wq - W)^T||^2 / ||XW^T||^2", title="per-layer output error on calibration inputs")
    ax.legend()
    _save(fig, paths)
    return fig


def _save(fig, paths) -> None:
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=120)
