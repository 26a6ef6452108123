"""Shared pieces of the quant tests: micro models, a teacher-data fixture, small params."""
from __future__ import annotations

import copy
from pathlib import Path

from eqc_utils import assets
from _micro_models import micro_llama, micro_qwen35
from eqc_utils.params import load_params

ANSWERS = ["Sure. Here is a short answer.", "The capital of France is Paris.", "Let me think step by step: 2 + 2 = 4.",
           "I would start by reading the documentation.", "Python lists are mutable; tuples are not."]


def teacher_rows(n: int = 24) -> list[dict]:
    """Teacher-style rows (system, user, assistant) built from packaged prompts: a stand-in for 02's output."""
    prompts = assets.alpaca_eval_prompts()[:n]
    rows = []
    for i, p in enumerate(prompts):
        user = p.get("instruction") or p.get("prompt") or str(p)
        rows.append({"id": f"t{i}", "conversations": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": user[:400]},
            {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)] * (1 + i % 3)}]})
    return rows


def micro_params(**qad_overrides) -> dict:
    """Tiny params resized for micro models (2 layers: 14 quantised Linears)."""
    params = copy.deepcopy(load_params("tiny"))
    params["quant"].update(calib_samples=2, calib_seq_len=32, min_quantized_modules=14)
    params["qad"].update(max_seq_len=64, max_steps=4, eval_every=2, eval_chunks=2, save_every=2, log_every=1,
                         gate_chunks=1, gate_seq_len=64, kl_chunk_tokens=24, warmup_ratio=0.0, lr=1e-3,
                         keep_last_ckpts=0)
    params["qad"].update(qad_overrides)
    return params


def micro_models(root: Path) -> dict[str, Path]:
    return {"llama": micro_llama(root / "micro_llama"),
            "qwen35": micro_qwen35(root / "micro_qwen35")}
