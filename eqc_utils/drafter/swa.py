"""Sliding-window attention for the drafter (the paper's third idea, second half): the drafter's view of
the target context limited to its last W positions, so that a draft step costs O(W) instead of
O(context) on long prompts, at a small cost in acceptance.

The rule lives in `mask.py` (`visible`, `window_by_positions`) and the model applies it from its config
(`DrafterConfig.sliding_window`), in training, in the reference decoder and in the checkpoint vLLM loads.
Here: setting a window on a loaded drafter, long-context prompts, and the sweep that measures tau and
the drafter's own time per step against the window.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from eqc_utils.conversation import render_prompt, training_messages
from eqc_utils.drafter.decode import DFlashProposer, measure_acceptance
from eqc_utils.drafter.mask import check_window
from eqc_utils.drafter.model import DFlashDrafter, load_drafter

AS_SAVED = "as saved"      # measure(window=AS_SAVED): the window written in the drafter's config


def set_window(drafter: DFlashDrafter, window: int | None) -> DFlashDrafter:
    """Give a drafter a window (None = full attention); it applies from the next forward on."""
    check_window(window, drafter.config.block_size)
    drafter.config.sliding_window = window
    return drafter


class TimedProposer(DFlashProposer):
    """DFlashProposer that also clocks the drafter's share of each step (embedding, drafter, head)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_seconds: list[float] = []

    def __call__(self, anchor_token, start, new_context):
        sync = torch.cuda.synchronize if new_context.is_cuda else (lambda: None)
        sync()
        started = time.perf_counter()
        logits = super().__call__(anchor_token, start, new_context)
        sync()
        self.step_seconds.append(time.perf_counter() - started)
        return logits

    @property
    def median_ms(self) -> float:
        """Median drafter time per step (the first steps pay one-off costs, a busy machine adds outliers)."""
        return 1000 * statistics.median(self.step_seconds) if self.step_seconds else float("nan")


def measure(drafter_dir: Path, target, prompts: list[list[int]], stops: set[int], P: dict,
            window=AS_SAVED) -> dict:
    """tau of a drafter folder (BF16 or a W4 pack) with the reference decoder, and the drafter's time
    per step (median ms). `window`: AS_SAVED, None (full attention) or a number of positions."""
    device, dtype = next(target.parameters()).device, next(target.parameters()).dtype
    drafter = load_drafter(drafter_dir, device=device, dtype=dtype)
    if window != AS_SAVED:
        set_window(drafter, window)
    proposer = TimedProposer(drafter, target)
    with torch.no_grad():
        report = measure_acceptance(target, proposer, prompts, P["eval_max_new_tokens"], stops,
                                    temperature=P["eval_temperature"], progress=False)
    return {"tau": report.tau, "steps": report.steps, "tokens": report.tokens,
            "acceptance_per_position": report.acceptance_per_position, "per_prompt_tau": report.per_prompt_tau,
            "window": drafter.config.sliding_window, "draft_ms_per_step": proposer.median_ms,
            "seconds": round(report.seconds, 2)}


def long_prompts(history_rows: list[dict], final_rows: list[dict], tokenizer, n: int, max_tokens: int,
                 system: str = "You are a helpful assistant.") -> list[list[int]]:
    """`n` long-context prompts: earlier conversations (user + assistant turns of `history_rows`) as a
    multi-turn history, then the user turn of a held-out row as the question, chat-templated with the
    generation prompt; as many history turns as fit in `max_tokens`."""
    def render(messages):
        return render_prompt(tokenizer, messages)

    def turns(row):
        messages = [m for m in training_messages(row) if m["role"] in ("user", "assistant")]
        return messages[-2:] if len(messages) >= 2 and messages[-1]["role"] == "assistant" else []

    prompts = []
    for i in range(n):
        question = next(m for m in reversed(training_messages(final_rows[i % len(final_rows)])) if m["role"] == "user")
        history: list[dict] = []
        misses = 0
        for j in range(len(history_rows)):
            candidate = turns(history_rows[(i * 7 + j) % len(history_rows)])
            if not candidate:
                continue
            if len(render([{"role": "system", "content": system}, *history, *candidate, question])) <= max_tokens:
                history += candidate
                misses = 0
            elif (misses := misses + 1) >= 32:     # nothing short enough left to fill the rest
                break
        ids = render([{"role": "system", "content": system}, *history, question])
        if len(ids) > max_tokens:
            raise ValueError(f"a held-out question alone takes {len(ids)} tokens, more than the long-prompt length "
                             f"{max_tokens} (drafter_quant.long_prompt_tokens): raise it")
        prompts.append(ids)
    return prompts


def window_sweep(drafter_dir: Path, target, prompts: list[list[int]], stops: set[int], P: dict,
                 windows: list[int | None]) -> list[dict]:
    """tau and drafter ms/step of one drafter for each window (None = full attention), same prompts."""
    rows = []
    for window in windows:
        result = measure(drafter_dir, target, prompts, stops, P, window=window)
        rows.append({"window": window, **{k: result[k] for k in ("tau", "draft_ms_per_step", "steps", "tokens",
                                                                  "per_prompt_tau")}})
    return rows


def plot_window_sweep(rows: list[dict], prompt_tokens: float, *paths: Path):
    """tau and drafter time per step against the window, full attention drawn as a horizontal line."""
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_ms) = plt.subplots(1, 2, figsize=(10, 3.5))
    windowed = [r for r in rows if r["window"] is not None]
    full = next((r for r in rows if r["window"] is None), None)
    xs = [r["window"] for r in windowed]
    ax_tau.plot(xs, [r["tau"] for r in windowed], marker="o", label="sliding window")
    ax_ms.plot(xs, [r["draft_ms_per_step"] for r in windowed], marker="o", label="sliding window")
    if full is not None:
        ax_tau.axhline(full["tau"], color="gray", linestyle="--", label="full attention")
        ax_ms.axhline(full["draft_ms_per_step"], color="gray", linestyle="--", label="full attention")
    for ax in (ax_tau, ax_ms):
        ax.set_xscale("log", base=2)
        ax.legend()
    ax_tau.set(xlabel="window W (context positions)", ylabel="tau", title=f"acceptance, prompts ~{prompt_tokens:.0f} tokens")
    ax_ms.set(xlabel="window W (context positions)", ylabel="ms per draft step", title="drafter time per step")
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=120)
    return fig
