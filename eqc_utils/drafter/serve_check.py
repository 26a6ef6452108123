"""Does vLLM serve the target with our drafter (`--speculative-config {"method": "dflash", ...}`), losslessly,
with the acceptance the reference decoder measures?

Two servers in turn, through the project's launcher (killed by PID on exit): the target alone and
the target + drafter. Same token-id prompts, greedy. Outputs are compared by token ids with plain
decoding as the reference (`eqc_utils.compare`): verification of a whole block and single-token steps
round differently, so a divergence where plain decoding was nearly tied (top-1 minus top-2 log-prob
at most `near_tie_margin` nats at the first differing token) is accepted as numerics; any other is a
mismatch. vLLM's mean acceptance length comes from its Prometheus counters, 1 + accepted / drafts,
read before and after the prompts (the server is idle otherwise), as in the reference's MAL protocol
(docs/recipe.md §5.3).
"""
from __future__ import annotations

from pathlib import Path

from eqc_utils.compare import compare_runs
from eqc_utils.serving.greedy import serve_greedy


def vllm_dflash_check(target_dir: Path, drafter_dir: Path, prompts: list[list[int]], max_tokens: int,
                      block_size: int, vllm_args: dict, near_tie_margin: float = 0.05, log_dir: Path | None = None,
                      device: str = "auto", labels: list[str] | None = None) -> dict:
    """Plain vs speculative greedy outputs on vLLM (plain is the reference), and vLLM's mean acceptance
    length. Returns `compare.compare_runs`'s summary (`passed`, `tally`, `summary`, counts, per-prompt
    `examples` with `plain` and `speculative` texts; `labels` name the prompts there) plus `vllm_tau`
    and `counters`."""
    plain = serve_greedy(target_dir, prompts, max_tokens, vllm_args, log_dir=log_dir, device=device, margins=True)
    spec = serve_greedy(target_dir, prompts, max_tokens, vllm_args, drafter_dir, block_size - 1, log_dir, device)
    result = compare_runs(prompts, plain["runs"], spec["runs"], near_tie_margin, names=("plain", "speculative"),
                          labels=labels)
    result.update(vllm_tau=spec["mean_acceptance_length"], counters=spec["counters"])
    return result
