"""Does vLLM serve the target with our drafter (`--speculative-config {"method": "dflash", ...}`), losslessly,
with the acceptance the reference decoder measures?

Two servers in turn, through the project's launcher (killed by PID on exit): the target alone and
the target + drafter. Same token-id prompts, greedy. Outputs are compared by token ids with plain
decoding as the reference (`eqc_utils.compare`): verification of a whole block and single-token steps
round differently, so a divergence where plain decoding was nearly tied (top-1 minus top-2 log-prob
below `near_tie_margin` nats at the first differing token) is accepted as numerics; any other is a
mismatch. vLLM's mean acceptance length comes from its Prometheus counters, 1 + accepted / drafts,
read before and after the prompts (the server is idle otherwise), as in the reference's MAL protocol
(docs/recipe.md §5.3).
"""
from __future__ import annotations

import urllib.request
from pathlib import Path

from eqc_utils.compare import compare_runs, complete_greedy

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def spec_counters(base_url: str) -> dict[str, float]:
    """Sums of vLLM's speculative-decoding counters over all label sets (0 when absent)."""
    from eqc_utils.serving.metrics import read_counters
    return read_counters(base_url).as_dict()


def serve_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, vllm_args: dict,
                 drafter_dir: Path | None = None, num_speculative_tokens: int | None = None,
                 log_dir: Path | None = None, device: str = "auto", margins: bool = False) -> dict:
    """Greedy completions of token-id prompts, sent one at a time: `runs` (compare.GreedyRun: ids,
    text, with `margins` the top-2 log-prob margins), `texts`, each request's `seconds` and
    `completion_tokens`; with a drafter also vLLM's `mean_acceptance_length` and the counter deltas."""
    from eqc_utils.serving.launcher import VLLMServers

    args = dict(vllm_args)
    if drafter_dir is not None:
        args["speculative-config"] = {"method": "dflash", "model": str(drafter_dir),
                                      "num_speculative_tokens": num_speculative_tokens}
    with VLLMServers(model_dir, n=1, served_name="target", extra_args=args, log_dir=log_dir,
                     device=device) as servers:
        base = servers.base_urls[0]
        before = spec_counters(base) if drafter_dir is not None else None
        # one request at a time: per-request latency, as the paper's latency protocol
        runs = [complete_greedy(base, ids, max_tokens, margins=margins) for ids in prompts]
        result = {"runs": runs, "texts": [r.text for r in runs], "seconds": [r.seconds for r in runs],
                  "completion_tokens": [len(r.ids) for r in runs]}
        if before is not None:
            after = spec_counters(base)
            delta = {k.split(":")[1]: after[k] - before[k] for k in SPEC_COUNTERS}
            drafts = delta["spec_decode_num_drafts_total"]
            result["counters"] = delta
            result["mean_acceptance_length"] = (1 + delta["spec_decode_num_accepted_tokens_total"] / drafts
                                                if drafts else None)
    return result


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
