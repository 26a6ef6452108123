"""The batched speculative decoder (eqc_utils/drafter/batched_decode.py) against the batch-1 static-cache one:
per prompt the same token ids and the same acceptance counts in fp32, with prompts of different lengths
sharing rows (a row that finishes takes the next prompt), stop tokens and budgets."""
import pytest
import torch

from eqc_utils.drafter.batched_decode import measure_acceptance_batched, speculative_generate_batched
from eqc_utils.drafter.decode import DFlashProposer, greedy_generate
from eqc_utils.drafter.fast_decode import fast_speculative_generate, measure_acceptance_fast
from eqc_utils.drafter.model import load_drafter
from tests._fixtures_decode import PROMPT
from tests._fixtures_drafter import load_causal_lm


@pytest.fixture(scope="module")
def target_and_drafter(chain_target_dir, trained):
    result, _, _ = trained
    target = load_causal_lm(chain_target_dir)
    return target, load_drafter(result.out_dir / "drafter", dtype=torch.float32)


def _prompts():
    return [PROMPT[:6], PROMPT, PROMPT[:9], PROMPT[:4], PROMPT[2:], PROMPT[:7]]


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_batched_equals_batch_one_prompt_by_prompt(target_and_drafter, slots):
    target, drafter = target_and_drafter
    prompts = _prompts()
    stop = greedy_generate(target, PROMPT, 30).output_ids[11]   # ends the longest prompt's answer early
    batched = speculative_generate_batched(target, DFlashProposer(drafter, target), prompts, 30, {stop},
                                           slots=slots, progress=False)
    for prompt, got in zip(prompts, batched):
        want = fast_speculative_generate(target, DFlashProposer(drafter, target), prompt, 30, {stop})
        assert got.output_ids == want.output_ids
        assert got.acceptance_lengths == want.acceptance_lengths
        assert (got.accepted_at, got.drafted_at) == (want.accepted_at, want.drafted_at)
    assert max(r.tau for r in batched) > 1.5, "the trained drafter should have drafts accepted"
    assert len(batched[1].output_ids) < 30 and batched[1].output_ids[-1] == stop


def test_batched_report_equals_the_batch_one_report(target_and_drafter):
    target, drafter = target_and_drafter
    prompts = _prompts()
    fast = measure_acceptance_fast(target, DFlashProposer(drafter, target), prompts, 17, progress=False)
    batched = measure_acceptance_batched(target, DFlashProposer(drafter, target), prompts, 17, slots=3,
                                         progress=False)
    assert (batched.tau, batched.steps, batched.tokens) == (fast.tau, fast.steps, fast.tokens)
    assert batched.acceptance_per_position == fast.acceptance_per_position
    assert batched.per_prompt_tau == fast.per_prompt_tau


def test_compiled_batched_step_equals_eager(target_and_drafter):
    """The step as torch.compile traces it (one graph: draft, verify, accept) decodes as the eager step; a GPU
    replays the same compiled step from a CUDA graph."""
    target, drafter = target_and_drafter
    prompts = _prompts()[:4]
    eager = speculative_generate_batched(target, DFlashProposer(drafter, target), prompts, 20, slots=3,
                                         progress=False)
    compiled = speculative_generate_batched(target, DFlashProposer(drafter, target), prompts, 20, slots=3,
                                            compile=True, progress=False)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    assert [r.acceptance_lengths for r in compiled] == [r.acceptance_lengths for r in eager]


def test_measure_drafter_takes_the_batched_decoder_with_eval_slots(target_and_drafter, trained, monkeypatch):
    """drafter.eval_slots > 1 decodes the held-out prompts side by side: the same tau as one at a time."""
    from eqc_utils.drafter import batched_decode, runs
    from eqc_utils.drafter.runs import measure_drafter
    calls = []
    monkeypatch.setattr(runs, "measure_acceptance_batched",
                        lambda *a, **k: calls.append(k["slots"]) or batched_decode.measure_acceptance_batched(*a, **k))
    result, P, _ = trained
    target, _ = target_and_drafter
    prompts = _prompts()
    one = measure_drafter(result.out_dir / "drafter", target, prompts, set(), dict(P, eval_slots=1), fast=True)
    side_by_side = measure_drafter(result.out_dir / "drafter", target, prompts, set(), dict(P, eval_slots=4), fast=True)
    assert calls == [4], "eval_slots 1 decodes one at a time, 4 takes the batched decoder"
    assert (side_by_side.tau, side_by_side.steps, side_by_side.per_prompt_tau) == (one.tau, one.steps, one.per_prompt_tau)
