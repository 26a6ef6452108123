"""Figures of stage 3: loss curves, tau per checkpoint, acceptance per block position."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt


def _save(fig, paths: list[Path]) -> None:
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=120)


def plot_training(histories: dict[str, list[dict]], *paths: Path):
    """Loss and block-token accuracy per optimiser step, one line per run."""
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, history in histories.items():
        steps = [h["step"] for h in history]
        ax_loss.plot(steps, [h["loss"] for h in history], label=name)
        ax_acc.plot(steps, [h["accuracy"] for h in history], label=name)
    ax_loss.set(xlabel="optimiser step", ylabel="weighted CE", title="drafter loss", yscale="log")
    ax_acc.set(xlabel="optimiser step", ylabel="argmax = label", title="draft-token accuracy")
    ax_loss.legend()
    _save(fig, list(paths))
    return fig


def plot_acceptance(tables: dict[str, list[dict]], *paths: Path):
    """Left: tau on held-out prompts per checkpoint. Right: P(draft k accepted) of each run's last checkpoint."""
    fig, (ax_tau, ax_pos) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, table in tables.items():
        ax_tau.plot([r["step"] for r in table], [r["tau"] for r in table], marker="o", label=name)
        last = table[-1]["acceptance_per_position"]
        ax_pos.plot(range(1, len(last) + 1), last, marker=".", label=f"{name} (tau {table[-1]['tau']:.2f})")
    ax_tau.set(xlabel="optimiser step", ylabel="tau (tokens / verify step)", title="acceptance length, held-out")
    ax_pos.set(xlabel="block position k", ylabel="P(draft k accepted)", title="acceptance per position", ylim=(0, 1))
    ax_tau.legend()
    ax_pos.legend()
    _save(fig, list(paths))
    return fig


def plot_learning_curve(curve: list[dict], seen: list[dict], *paths: Path):
    """Left: held-out tau against training conversations (log scale): `curve`, one run per data size (distinct
    conversations, annotated with its steps), and `seen`, the full run's checkpoints against the conversations
    trained on by then. Right: P(draft k accepted) of every point."""
    fig, (ax_tau, ax_pos) = plt.subplots(1, 2, figsize=(10, 3.5))
    if curve:
        ax_tau.plot([r["conversations"] for r in curve], [r["tau"] for r in curve], marker="o",
                    label="one run per data size")
    for r in curve:
        ax_tau.annotate(f"{r['steps']} steps", (r["conversations"], r["tau"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
    if seen:
        ax_tau.plot([r["conversations_seen"] for r in seen], [r["tau"] for r in seen], marker="s", linestyle="--",
                    label="full run, by checkpoint (conversations seen)")
    points = [(f"{r['conversations']} distinct", r) for r in curve] + [(f"{r['conversations_seen']} seen", r)
                                                                       for r in seen]
    for name, r in points:
        rates = r["acceptance_per_position"]
        ax_pos.plot(range(1, len(rates) + 1), rates, marker=".", label=f"{name} (tau {r['tau']:.2f})")
    ax_tau.set(xlabel="training conversations", ylabel="tau (tokens / verify step)", xscale="log",
               title="acceptance length vs data, held-out")
    ax_pos.set(xlabel="block position k", ylabel="P(draft k accepted)", title="acceptance per position", ylim=(0, 1))
    ax_tau.legend(fontsize=8)
    ax_pos.legend(title="conversations", fontsize=7)
    _save(fig, list(paths))
    return fig
