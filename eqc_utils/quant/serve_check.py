"""Does vLLM serve the pack as the dense twin? Greedy completions of both, compared token for token.

The compressed-tensors pack runs vLLM's W4A16 kernel; the dense twin holds the same dequantised
weights as plain bf16 tensors. The same greedy outputs on a set of prompts mean the pack is read as
written (codes, scales, group layout, ignore list). The two kernels round differently, so a
divergence where the twin itself was nearly tied is accepted as numerics (`eqc_utils.compare`: the
twin's top-1 minus top-2 log-prob at the first differing token is at most `near_tie_margin` nats);
any other divergence fails the check. Servers are started one at a time through the project's
launcher (which kills them by PID on exit).
"""
from __future__ import annotations

from pathlib import Path

from eqc_utils.compare import GreedyRun, compare_runs
from eqc_utils.serving.greedy import serve_greedy


def greedy_runs(model_dir: Path, prompts: list[str] | list[list[int]], max_tokens: int, vllm_args: dict, *,
                margins: bool = False, log_dir: Path | None = None, device: str = "auto") -> list[GreedyRun]:
    """Greedy completions (token ids, text; with `margins` also the top-2 log-prob margins) of
    `prompts` from one vLLM server for `model_dir`, requests sent one at a time."""
    return serve_greedy(model_dir, prompts, max_tokens, vllm_args, log_dir=log_dir, device=device,
                        margins=margins)["runs"]


def pack_serves_like_twin(ct_dir: Path, dense_dir: Path, prompts: list[str], max_tokens: int,
                          vllm_args: dict, near_tie_margin: float = 0.05, log_dir: Path | None = None,
                          device: str = "auto", twin_runs: list[GreedyRun] | None = None) -> dict:
    """vLLM's greedy outputs of the pack vs the dense twin's (the reference). Returns
    `compare.compare_runs`'s summary: `passed`, `tally` ("6/6 (1 near-tie)"), `summary` (one line),
    counts, and per-prompt `examples` (prompt, verdict, position, margin, `pack` and `dense` texts).
    `twin_runs`: the twin's runs (with margins) from an earlier call, to check several packs against
    one twin without serving it again."""
    packed = greedy_runs(ct_dir, prompts, max_tokens, vllm_args, log_dir=log_dir, device=device)
    dense = twin_runs if twin_runs is not None else greedy_runs(dense_dir, prompts, max_tokens, vllm_args,
                                                                margins=True, log_dir=log_dir, device=device)
    return compare_runs(prompts, dense, packed, near_tie_margin, names=("dense", "pack"))
