import pytest
import torch

from eqc_utils.drafter.decode import (DecodeResult, DFlashProposer, greedy_generate, measure_acceptance,
                                      pooled_report, rejection_accept, speculative_generate)
from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for
from tests._fixtures_decode import PROMPT, STOP_CASES, CorruptedOracle, expected_stats
from tests._fixtures_drafter import load_causal_lm

TARGETS = {"llama": "micro_llama_dir", "qwen35": "micro_qwen35_dir",       # random: greedy text = "\n" x N
           "chain_llama": "chain_target_dir", "chain_qwen35": "chain_qwen35_dir"}   # varied word chains


def target_of(name, request):
    return load_causal_lm(request.getfixturevalue(TARGETS[name]))


def assert_consistent(stats, block_size):
    """What holds for any run: tau = 1 + accepted / drafts, every position drafted once per step,
    draft k accepted only where draft k-1 was."""
    steps = len(stats.acceptance_lengths)
    assert stats.drafted_at == [steps] * (block_size - 1)
    assert stats.tau == pytest.approx(1 + sum(stats.accepted_at) / max(1, steps), abs=1e-12)
    assert all(a >= b for a, b in zip(stats.accepted_at, stats.accepted_at[1:]))
    assert all(1 <= length <= block_size for length in stats.acceptance_lengths)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_greedy_speculative_decoding_is_lossless(arch, request):
    target = target_of(arch, request)
    plain = greedy_generate(target, PROMPT, 40)
    truth = greedy_generate(target, PROMPT, 40 + 6).output_ids
    assert truth[:40] == plain.output_ids
    # a random drafter: almost nothing accepted
    cfg = drafter_config_for(target.config, num_layers=1, block_size=6, target_layer_ids=None, mask_token_id=16)
    torch.manual_seed(0)
    spec = speculative_generate(target, DFlashProposer(DFlashDrafter(cfg), target), PROMPT, 40)
    assert spec.output_ids == plain.output_ids
    assert_consistent(spec, 6)
    # an oracle spoiled at every 5th position: partial acceptance, rollback each time
    oracle = CorruptedOracle(truth, len(PROMPT), 6, target.config.vocab_size)
    spec = speculative_generate(target, oracle, PROMPT, 40)
    assert spec.output_ids == plain.output_ids
    lengths, accepted_at = expected_stats(oracle, 40)
    assert spec.acceptance_lengths == lengths and spec.accepted_at == accepted_at
    assert lengths == [1] + [5] * 8                 # anchors at 14, 15, 20, ...: 1 + 1 + 8 x 5 >= 40
    assert spec.tau == pytest.approx(41 / 9)
    assert_consistent(spec, 6)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_always_wrong_drafter_gives_tau_one(arch, request):
    target = target_of(arch, request)
    plain = greedy_generate(target, PROMPT, 20)
    wrong = CorruptedOracle(greedy_generate(target, PROMPT, 26).output_ids, len(PROMPT), 6,
                            target.config.vocab_size, every=1)
    spec = speculative_generate(target, wrong, PROMPT, 20)
    assert spec.output_ids == plain.output_ids
    assert spec.acceptance_lengths == [1] * 19           # one token per verification after the prefill
    assert spec.tau == 1.0 and spec.accepted_at == [0] * 5 and spec.drafted_at == [19] * 5


@pytest.mark.parametrize("max_new_tokens, steps", [(33, 8), (31, 8), (30, 8), (29, 7), (1, 0)])
def test_oracle_drafter_reaches_full_blocks_and_counts_positions(max_new_tokens, steps, chain_target_dir):
    """A perfect drafter: every step accepts the whole block; a last step cut by the budget still
    counts its whole block (vLLM's count)."""
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 40).output_ids
    oracle = CorruptedOracle(truth, len(PROMPT), 4, target.config.vocab_size, every=None)
    spec = speculative_generate(target, oracle, PROMPT, max_new_tokens)
    assert spec.output_ids == truth[:max_new_tokens]
    assert spec.acceptance_lengths == [4] * steps          # 1 prefill token + blocks of 4
    assert spec.accepted_at == spec.drafted_at == [steps] * 3
    assert spec.tau == (4.0 if steps else 0.0)


@pytest.mark.parametrize("arch", ["chain_llama", "chain_qwen35"])
@pytest.mark.parametrize("stop_index, max_new_tokens", STOP_CASES)
def test_stop_token_among_accepted_drafts_ends_generation(arch, stop_index, max_new_tokens, request):
    target = target_of(arch, request)
    truth = greedy_generate(target, PROMPT, 40).output_ids
    stop = truth[stop_index]
    assert truth.index(stop) == stop_index and len(set(truth[:stop_index + 8])) == stop_index + 8
    plain = greedy_generate(target, PROMPT, max_new_tokens, stop_ids={stop}).output_ids
    assert plain == truth[:min(stop_index + 1, max_new_tokens)]
    oracle = CorruptedOracle(truth, len(PROMPT), 6, target.config.vocab_size, every=None)
    spec = speculative_generate(target, oracle, PROMPT, max_new_tokens, stop_ids={stop})
    assert spec.output_ids == plain                     # up to and including the stop, nothing after
    # the step that reached the stop counts all six positions it accepted, like vLLM's scheduler
    steps = -(-(len(plain) - 1) // 6)
    assert spec.acceptance_lengths == [6] * steps
    assert spec.accepted_at == spec.drafted_at == [steps] * 5


def test_measure_acceptance_pools_steps_and_honours_stops(chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 40).output_ids
    oracle = CorruptedOracle(truth, len(PROMPT), 6, target.config.vocab_size, every=4)
    stop = truth[9]             # steps commit 2, 4, 4 tokens: index 9 is draft 3 of the third step
    one = speculative_generate(target, oracle, PROMPT, 30, stop_ids={stop})
    assert one.output_ids == truth[:10]
    lengths, accepted_at = expected_stats(oracle, 30, emitted_tokens=10)
    assert lengths == [2, 4, 4]
    assert one.acceptance_lengths == lengths and one.accepted_at == accepted_at
    report = measure_acceptance(target, oracle, [PROMPT, PROMPT], 30, stop_ids={stop}, progress=False)
    assert report.tokens == 20 and report.steps == 2 * len(lengths)
    assert report.tau == pytest.approx(sum(lengths) / len(lengths)) == pytest.approx(one.tau)
    assert report.tau == pytest.approx(1 + sum(report.acceptance_per_position))
    assert report.acceptance_per_position == pytest.approx([a / len(lengths) for a in accepted_at])
    assert report.per_prompt_tau == pytest.approx([one.tau, one.tau])
    assert report.per_prompt_steps == [len(lengths), len(lengths)]


def test_tau_by_group_pools_each_group_like_the_whole_report():
    """Per-category tau is the pooled tau of that category's prompts alone (not a mean of per-prompt taus: a
    prompt with many steps weighs more), and the groups together give the overall tau."""
    runs = [DecodeResult([0] * 9, [3, 3, 3]), DecodeResult([0] * 2, [1, 1]), DecodeResult([0] * 5, [4, 1]),
            DecodeResult([0] * 4, [2, 1, 1])]
    groups = ["math", "chat", "math", "chat"]
    report = pooled_report(runs, 0.0)
    by_group = report.tau_by_group(groups)
    assert list(by_group) == ["chat", "math"]
    for name, tau in by_group.items():
        alone = pooled_report([r for r, g in zip(runs, groups) if g == name], 0.0)
        assert tau == pytest.approx(alone.tau)
    assert by_group["math"] == pytest.approx(14 / 5) != pytest.approx((3 + 2.5) / 2)
    total_steps = {g: sum(len(r.acceptance_lengths) for r, h in zip(runs, groups) if h == g) for g in by_group}
    assert sum(by_group[g] * total_steps[g] for g in by_group) / report.steps == pytest.approx(report.tau)
    with pytest.raises(ValueError, match="3 groups for 4 prompts"):
        report.tau_by_group(groups[:3])


def test_rejection_sampling_keeps_the_target_distribution():
    """First emitted token of a speculative step ~ target distribution, whatever the draft distribution."""
    g = torch.Generator().manual_seed(0)
    target_probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    draft_probs = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1]])
    counts = torch.zeros(4)
    n = 6000
    for _ in range(n):
        drafts = torch.multinomial(draft_probs, 1, generator=g)[:, 0]
        accepted, nxt = rejection_accept(drafts, draft_probs, target_probs, g)
        first = drafts[0].item() if accepted >= 1 else nxt
        counts[first] += 1
    torch.testing.assert_close(counts / n, target_probs[0], atol=0.025, rtol=0)
    assert counts[3] == 0                               # a token the target rules out is never emitted


def test_sampled_speculative_decoding_runs_and_measures(micro_qwen35_dir):
    target = load_causal_lm(micro_qwen35_dir)
    cfg = drafter_config_for(target.config, num_layers=1, block_size=4, target_layer_ids=None, mask_token_id=16)
    torch.manual_seed(0)
    report = measure_acceptance(target, DFlashProposer(DFlashDrafter(cfg), target), [PROMPT, PROMPT[:6]], 12,
                                temperature=0.8, progress=False)
    assert report.tokens == 24
    rates = report.acceptance_per_position
    assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:]))
    # pooled tau = 1 + accepted / drafts, and every step drafted every position: tau = 1 + sum of the rates
    assert report.tau == pytest.approx(1 + sum(rates))
    # each prompt emits 12 tokens: 1 from the prefill, the rest from verification steps that commit
    # 1..4 tokens each (the last one may overshoot the budget by at most 3)
    assert 22 <= report.tau * report.steps <= 22 + 2 * 3
    assert report.tau * report.steps == pytest.approx(round(report.tau * report.steps))


def test_recurrent_state_rollback_matches_a_fresh_run(micro_qwen35_dir):
    """After verifying 6 tokens and keeping 3, the Qwen3.5 target's state (attention KV + Gated DeltaNet
    recurrent/conv states) must be what it would be had it only ever seen those 3 tokens."""
    from eqc_utils.drafter.decode import TargetSession
    target = load_causal_lm(micro_qwen35_dir)
    block = torch.tensor([[523, 1107, 90, 4410, 77, 3021]])
    nxt = torch.tensor([[845]])

    fresh = TargetSession(target, [0, 3])
    fresh.forward(torch.tensor([PROMPT]))
    fresh.forward(block[:, :3])
    want_logits, want_features = fresh.forward(nxt)

    def rolled_back(restore_states: bool):
        session = TargetSession(target, [0, 3])
        session.forward(torch.tensor([PROMPT]))
        assert session.has_recurrent_state
        snapshot = session.snapshot()
        session.forward(block)
        if restore_states:
            session.rewind(len(PROMPT), snapshot)
            session.forward(block[:, :3])
        else:                       # what a plain KV-cache crop would do
            session.rewind(len(PROMPT) + 3, None)
        return session.forward(nxt)

    logits, features = rolled_back(True)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(features, want_features, atol=1e-5, rtol=1e-4)
    # the check has teeth: cropping alone leaves the recurrent state 3 tokens ahead
    _, stale_features = rolled_back(False)
    assert (stale_features - want_features).abs().max() > 1e-3
