"""Greedy completions from one vLLM server started for the purpose: the shared step of every "does vLLM serve it as
the reference does" check (04's pack vs dense twin, 07/08's target with and without the drafter) and of the
vLLM benchmarks. Requests are sent one at a time (per-request latency, as the paper's latency protocol); the server
is killed by PID on exit (eqc_utils.serving.launcher)."""
from __future__ import annotations

from pathlib import Path

from eqc_utils.compare import complete_greedy
from eqc_utils.serving.launcher import VLLMServers
from eqc_utils.serving.metrics import SPEC_COUNTERS, read_counters


def serve_greedy(model_dir: Path, prompts: list[str] | list[list[int]], max_tokens: int, vllm_args: dict,
                 drafter_dir: Path | None = None, num_speculative_tokens: int | None = None,
                 log_dir: Path | None = None, device: str = "auto", margins: bool = False,
                 warmup: bool = False) -> dict:
    """Greedy completions of `prompts` (text or token ids): `runs` (compare.GreedyRun: ids, text, with `margins` the
    top-2 log-prob margins), `texts`, each request's `seconds` and `completion_tokens`; with a DFlash drafter also
    vLLM's `mean_acceptance_length` (1 + accepted / drafts over these requests) and the counter deltas. `warmup` sends
    the first prompt once, untimed and uncounted, first: a fresh server's first request also pays one-off set-up."""
    args = dict(vllm_args)
    if drafter_dir is not None:
        args["speculative-config"] = {"method": "dflash", "model": str(drafter_dir),
                                      "num_speculative_tokens": num_speculative_tokens}
    with VLLMServers(model_dir, n=1, served_name="target", extra_args=args, log_dir=log_dir,
                     device=device) as servers:
        base = servers.base_urls[0]
        if warmup and prompts:
            complete_greedy(base, prompts[0], max_tokens, margins=margins)
        before = read_counters(base).as_dict() if drafter_dir is not None else None
        runs = [complete_greedy(base, p, max_tokens, margins=margins) for p in prompts]
        result = {"runs": runs, "texts": [r.text for r in runs], "seconds": [r.seconds for r in runs],
                  "completion_tokens": [len(r.ids) for r in runs]}
        if before is not None:
            after = read_counters(base).as_dict()
            delta = {k.split(":")[1]: after[k] - before[k] for k in SPEC_COUNTERS}
            drafts = delta["spec_decode_num_drafts_total"]
            result["counters"] = delta
            result["mean_acceptance_length"] = (1 + delta["spec_decode_num_accepted_tokens_total"] / drafts
                                                if drafts else None)
    return result
