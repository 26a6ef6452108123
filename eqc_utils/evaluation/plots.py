"""Figures of stage 09: quality gates, latency with speed-up, per-position acceptance, and the pipeline
overview with each stage's headline number. Each function saves to every path it is given."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

COLOURS = {"teacher": "#7f7f7f", "target": "#1f77b4", "final": "#d62728",
           "autoregressive": "#1f77b4", "speculative": "#d62728"}


def _save(fig, paths: Sequence[str | Path]) -> None:
    fig.tight_layout()
    for path in paths:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)


def _grouped_bars(ax, series: Mapping[str, Sequence], extras: Mapping[str, Sequence[dict]] | None = None) -> None:
    """One cluster of bars per group, one bar per series (its name is the legend entry and picks the colour);
    `extras[name][j]`: more `ax.bar` keywords for that bar (error bar, hatching). None values are skipped."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        for j, value in enumerate(values):
            if value is not None:
                more = extras[name][j] if extras and name in extras else {}
                ax.bar(j + offset, value, width, color=COLOURS.get(name), label=name if j == 0 else None, **more)


def plot_gates(rows: Sequence[Mapping], *paths) -> "object":
    """Grouped bars: one group per gate, one bar per server, ± one standard error; a failed gate is hatched."""
    import matplotlib.pyplot as plt

    gates = list(dict.fromkeys(r["gate"] for r in rows))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    cell = {(r["server"], r["gate"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    _grouped_bars(ax, {s: [(cell.get((s, g)) or {}).get("value") for g in gates] for s in servers},
                  {s: [_gate_bar_style(cell.get((s, g))) for g in gates] for s in servers})
    ax.set_xticks(range(len(gates)), gates)
    ax.set_ylabel("score")
    ax.set_ylim(0, 1)
    ax.set_title("quality gates (± 1 s.e.; hatched: failed)")
    ax.legend(frameon=False)
    _save(fig, paths)
    return fig


def _gate_bar_style(row: Mapping | None) -> dict:
    if row is None:
        return {}
    return {"yerr": row["stderr"] or 0, "capsize": 3, "hatch": "//" if row["passed"] is False else None}


def plot_latency(report: Mapping, *paths) -> "object":
    """Median latency per prompt-length bucket for each server, the speed-up over the baseline on top."""
    import matplotlib.pyplot as plt

    buckets = [b["name"] for b in report["buckets"]]
    servers = list(report["servers"])
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    _grouped_bars(ax, {s: [report["servers"][s][b]["median_latency_ms"] or 0 for b in buckets] for s in servers})
    for name, per_bucket in report["speedup"].items():
        for j, b in enumerate(buckets):
            ratio = per_bucket[b]["latency"]
            top = max(report["servers"][s][b]["median_latency_ms"] or 0 for s in servers)
            if ratio:
                ax.annotate(f"{ratio:.2f}×", (j, top), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(buckets)),
                  [f"{b['name']}\n{b['prompt_tokens']} → {b['max_tokens']}" for b in report["buckets"]])
    ax.set_ylabel("median latency (ms)")
    ax.set_title(f"latency per request, speed-up of {', '.join(report['speedup']) or '-'} over {report['baseline']}")
    ax.legend(frameon=False)
    ax.margins(y=0.15)
    _save(fig, paths)
    return fig


def plot_acceptance(per_dataset: Mapping[str, Mapping], *paths) -> "object":
    """P(draft k accepted) per draft position, one line per prompt set, τ in the legend."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    for name, result in per_dataset.items():
        rates = result.get("per_position") or []
        tau = result.get("tau")
        ax.plot(range(1, len(rates) + 1), rates, marker="o",
                label=f"{name} (τ = {tau:.2f})" if tau is not None else name)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance per draft position (vLLM counters)")
    ax.legend(frameon=False)
    _save(fig, paths)
    return fig


def plot_pipeline(steps: Sequence[tuple[str, str]], *paths) -> "object":
    """The pipeline as a row of boxes, `(title, headline text)` per stage, arrows between them."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    n = len(steps)
    fig, ax = plt.subplots(figsize=(max(8, 2.1 * n), 2.6))
    ax.set_xlim(0, n)
    ax.set_ylim(0, 1)
    ax.axis("off")
    for i, (title, text) in enumerate(steps):
        ax.add_patch(FancyBboxPatch((i + 0.06, 0.12), 0.88, 0.76, boxstyle="round,pad=0.02",
                                    facecolor="#eef3fb", edgecolor="#1f77b4"))
        ax.text(i + 0.5, 0.74, title, ha="center", va="center", fontsize=9, weight="bold", wrap=True)
        ax.text(i + 0.5, 0.4, text, ha="center", va="center", fontsize=8)
        if i < n - 1:
            ax.annotate("", (i + 1.06, 0.5), (i + 0.94, 0.5), arrowprops={"arrowstyle": "->"})
    _save(fig, paths)
    return fig
