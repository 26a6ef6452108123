import pytest
import torch

from eqc_utils.drafter.decode import (DFlashProposer, DraftFn, greedy_generate, measure_acceptance,
                                      rejection_accept, speculative_generate)
from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for
from tests._fixtures_drafter import load_causal_lm, micro_llama_dir, micro_qwen35_dir  # noqa: F401

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 30, 2, 198, 1, 4093, 198]


class CorruptedOracle(DraftFn):
    """Proposes the target's true greedy continuation but spoils every slot whose absolute position is
    a multiple of `every`: acceptance then stops at varying points inside the block, exercising partial
    acceptance and (for recurrent targets) the state rollback."""

    def __init__(self, continuation: list[int], prompt_len: int, block_size: int, vocab: int, every: int = 5):
        self.truth, self.prompt_len, self.block_size, self.vocab, self.every = continuation, prompt_len, block_size, vocab, every
        self.target_layer_ids = [0]

    def __call__(self, anchor_token, start, new_context):
        logits = torch.zeros(self.block_size - 1, self.vocab)
        for k in range(1, self.block_size):
            pos = start + k
            i = pos - self.prompt_len
            token = self.truth[i] if i < len(self.truth) else 0
            if pos % self.every == 0:
                token = (token + 1) % self.vocab
            logits[k - 1, token] = 1.0
        return logits


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_greedy_speculative_decoding_is_lossless(arch, request):
    target = load_causal_lm(request.getfixturevalue(f"micro_{arch}_dir"))
    plain = greedy_generate(target, PROMPT, 40)
    # a random drafter: almost nothing accepted
    cfg = drafter_config_for(target.config, num_layers=1, block_size=6, target_layer_ids=None, mask_token_id=16)
    torch.manual_seed(0)
    spec = speculative_generate(target, DFlashProposer(DFlashDrafter(cfg), target), PROMPT, 40)
    assert spec.output_ids == plain.output_ids
    # an oracle spoiled at every 5th position: partial acceptance of every length, rollback each time
    oracle = CorruptedOracle(plain.output_ids, len(PROMPT), 6, target.config.vocab_size)
    spec = speculative_generate(target, oracle, PROMPT, 40)
    assert spec.output_ids == plain.output_ids
    assert len(set(spec.acceptance_lengths[:-1])) > 1 and max(spec.acceptance_lengths) > 1
    assert 1 < spec.tau < 6


def test_oracle_drafter_reaches_full_blocks_and_counts_positions(micro_llama_dir):
    target = load_causal_lm(micro_llama_dir)
    plain = greedy_generate(target, PROMPT, 33)
    oracle = CorruptedOracle(plain.output_ids, len(PROMPT), 4, target.config.vocab_size, every=10 ** 9)
    spec = speculative_generate(target, oracle, PROMPT, 33)
    assert spec.output_ids == plain.output_ids
    assert spec.acceptance_lengths == [4] * 8            # 1 prefill token + 8 full blocks of 4 = 33
    assert spec.tau == 4.0 and spec.accepted_at == spec.drafted_at == [8, 8, 8]


def test_stop_token_ends_generation(micro_llama_dir):
    target = load_causal_lm(micro_llama_dir)
    plain = greedy_generate(target, PROMPT, 30)
    stop = plain.output_ids[7]
    oracle = CorruptedOracle(plain.output_ids, len(PROMPT), 6, target.config.vocab_size, every=10 ** 9)
    spec = speculative_generate(target, oracle, PROMPT, 30, stop_ids={stop})
    first = plain.output_ids.index(stop)
    assert spec.output_ids == plain.output_ids[:first + 1]


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
    assert report.tokens == 24 and 1.0 <= report.tau <= 4.0
    assert len(report.acceptance_per_position) == 3


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
