"""The batch-1 speed-up measurement (eqc_utils/drafter/speedup.py) and 07's use of it (runs.speedup_of):
speculative and plain decoding of the same prompts, the speculative output judged against plain, tau as the
acceptance measurement counts it."""
import dataclasses
import math

import torch

from eqc_utils.drafter.decode import DFlashProposer
from eqc_utils.drafter.fast_decode import measure_acceptance_fast
from eqc_utils.drafter.model import load_drafter
from eqc_utils.drafter.runs import prompt_ids, speedup_of
from eqc_utils.drafter.speedup import measure_speedup
from tests._fixtures_decode import PROMPT
from tests._fixtures_drafter import load_causal_lm


def test_speedup_rows_tau_and_lossless_verdict(chain_target_dir, trained):
    result, _, _ = trained
    target = load_causal_lm(chain_target_dir)
    drafter = load_drafter(result.out_dir / "drafter", dtype=torch.float32)
    prompts = [PROMPT[:6], PROMPT, PROMPT[2:]]
    report = measure_speedup(target, drafter, prompts, 24, progress=False)
    assert [r["prompt_tokens"] for r in report["prompts"]] == [6, len(PROMPT), len(PROMPT) - 2]
    assert all(r["tokens"] == 24 for r in report["prompts"])
    # fp32 on the CPU: speculative decoding gives plain decoding's ids exactly
    assert report["lossless"]["all_identical"] and report["lossless"]["tally"] == "3/3"
    want = measure_acceptance_fast(target, DFlashProposer(drafter, target), prompts, 24, progress=False)
    assert sorted(r["tau"] for r in report["prompts"]) == sorted(want.per_prompt_tau)
    assert report["tau"] > 1.5, "the trained drafter should have drafts accepted"
    plain = sorted(r["plain_ms_per_token"] for r in report["prompts"])[1]
    spec = sorted(r["spec_ms_per_token"] for r in report["prompts"])[1]
    assert math.isclose(report["speedup"], plain / spec) and report["speedup"] > 0
    assert report["compiled"] is False and report["dtype"] == "float32"


def test_speedup_of_follows_the_parameters(chain_target_dir, chain_qwen35_dir, tokenizer, trained):
    result, P, _ = trained
    assert speedup_of(result, dict(P, speedup_prompts=0, speedup_tokens=16), tokenizer, device="cpu") is None
    report = speedup_of(result, dict(P, speedup_prompts=1, speedup_tokens=16), tokenizer, device="cpu")
    assert len(report["prompts"]) == 1
    assert report["prompts"][0]["prompt_tokens"] == len(prompt_ids(tokenizer, result.heldout[:1])[0])
    assert report["lossless"]["passed"]
    # Qwen3.5's recurrent layers: the static-cache decoder does not take them, and 07 goes on without a number
    hybrid = dataclasses.replace(result, target_dir=chain_qwen35_dir)
    skipped = speedup_of(hybrid, dict(P, speedup_prompts=1, speedup_tokens=16), tokenizer, device="cpu")
    assert set(skipped) == {"skipped"} and skipped["skipped"]
