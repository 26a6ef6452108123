"""FastSpeculativeDecoder.generate_on_device (greedy, fixed-shape drafter): the steps keep the anchor, the
block start and the accepted count on the device and the host reads them in groups. Its ids and statistics
must be those of the step-by-step loop and of decode.speculative_generate, wherever a stop, the budget or the
cache's end falls inside a group."""
import pytest
import torch

from eqc_utils.drafter import fast_decode
from eqc_utils.drafter.decode import DFlashProposer, greedy_generate, speculative_generate
from eqc_utils.drafter.fast_decode import FastSpeculativeDecoder, StaticDFlashProposer, StaticTarget, cache_len_for
from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for
from tests._fixtures_decode import PROMPT, STOP_CASES, CorruptedOracle
from tests._fixtures_drafter import load_causal_lm


def same_stats(fast, ref):
    assert fast.output_ids == ref.output_ids
    assert fast.acceptance_lengths == ref.acceptance_lengths
    assert fast.accepted_at == ref.accepted_at and fast.drafted_at == ref.drafted_at


def random_drafter(target, block_size):
    cfg = drafter_config_for(target.config, num_layers=1, block_size=block_size, target_layer_ids=None,
                             mask_token_id=16)
    torch.manual_seed(0)
    return DFlashDrafter(cfg)


class DeviceOracle(StaticDFlashProposer):
    """A real fixed-shape proposer (its context buffer written by draft_at) whose logits are then replaced,
    on the device, by CorruptedOracle's: the target's greedy continuation, spoiled where the absolute
    position is a multiple of `every`. Gives every acceptance count, which a random drafter never does."""

    def __init__(self, drafter, target, max_len, truth: list[int], prompt_len: int, every: int | None):
        super().__init__(drafter, target, max_len)
        self.truth, self.prompt_len, self.every = torch.tensor(truth), prompt_len, every
        self.vocab = target.config.vocab_size
        self.calls = 0

    def draft_at(self, anchor, start, context, context_at):
        super().draft_at(anchor, start, context, context_at)
        self.calls += 1
        positions = start + torch.arange(1, self.block_size)
        tokens = self.truth[(positions - self.prompt_len).clamp(max=len(self.truth) - 1)]
        if self.every is not None:
            tokens = torch.where(positions % self.every == 0, (tokens + 1) % self.vocab, tokens)
        return torch.nn.functional.one_hot(tokens, self.vocab).float()

    def host_oracle(self) -> CorruptedOracle:
        return CorruptedOracle(self.truth.tolist(), self.prompt_len, self.block_size, self.vocab, self.every)


def test_on_device_loop_is_what_the_stepwise_loop_and_the_reference_decode(chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    drafter = random_drafter(target, 6)
    ref = speculative_generate(target, DFlashProposer(drafter, target), PROMPT, 40)
    assert ref.output_ids == greedy_generate(target, PROMPT, 40).output_ids
    decoder = FastSpeculativeDecoder(target, StaticDFlashProposer(drafter, target, 128), 128)
    for _ in range(2):                           # the second prompt reuses the buffers
        same_stats(decoder.generate(PROMPT, 40), ref)
        same_stats(decoder.generate_stepwise(PROMPT, 40), ref)
    # the proposer's drafts are the same whether its context arrives trimmed or as whole blocks
    same_stats(decoder.generate(PROMPT[:7], 25), decoder.generate_stepwise(PROMPT[:7], 25))


@pytest.mark.parametrize("every", [None, 5, 3, 1])
def test_on_device_loop_reads_the_host_once_per_group_of_steps(every, chain_target_dir, monkeypatch):
    """Every acceptance count from 0 to B-1; the host reads (tolist) once per STEPS_PER_READ steps (and once
    more where the budget or the cache's end comes), not once per step."""
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 90).output_ids
    oracle = DeviceOracle(random_drafter(target, 6), target, 128, truth, len(PROMPT), every)
    decoder = FastSpeculativeDecoder(target, oracle, 128)
    reads, tolist = [0], torch.Tensor.tolist

    def counted(self):
        reads[0] += 1
        return tolist(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    fast = decoder.generate(PROMPT, 60)
    monkeypatch.undo()
    ref = speculative_generate(target, oracle.host_oracle(), PROMPT, 60)
    same_stats(fast, ref)
    assert fast.output_ids == truth[:60]
    steps = len(fast.acceptance_lengths)
    assert steps >= 10
    assert reads[0] <= -(-steps // fast_decode.STEPS_PER_READ) + 1    # measured: 3, 4, 6, 15 for 10, 13, 21, 59 steps
    assert oracle.calls - steps < fast_decode.STEPS_PER_READ      # steps queued past the end: fewer than a group


@pytest.mark.parametrize("stop_index, max_new_tokens", STOP_CASES + [(20, 60), (33, 60)])
def test_on_device_loop_stops_where_the_reference_does(stop_index, max_new_tokens, chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 90).output_ids
    stop = truth[stop_index]
    oracle = DeviceOracle(random_drafter(target, 6), target, 128, truth, len(PROMPT), every=4)
    fast = FastSpeculativeDecoder(target, oracle, 128).generate(PROMPT, max_new_tokens, stop_ids={stop})
    same_stats(fast, speculative_generate(target, oracle.host_oracle(), PROMPT, max_new_tokens, stop_ids={stop}))
    assert fast.output_ids == greedy_generate(target, PROMPT, max_new_tokens, stop_ids={stop}).output_ids


def test_queued_steps_never_pass_the_end_of_a_tight_cache(chain_target_dir):
    """A cache with room for exactly prompt + budget + one block: the host reads early instead of queueing a
    step that could write past the end (on a GPU that would be a device-side fault, not an exception)."""
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 90).output_ids
    tight = len(PROMPT) + 40 + 6
    for every in (None, 2):
        oracle = DeviceOracle(random_drafter(target, 6), target, tight, truth, len(PROMPT), every)
        session = StaticTarget(target, tight, oracle.target_layer_ids, 6)
        fast = FastSpeculativeDecoder(session, oracle).generate(PROMPT, 40)
        same_stats(fast, speculative_generate(target, oracle.host_oracle(), PROMPT, 40))
    short = StaticTarget(target, len(PROMPT) + 8, oracle.target_layer_ids, 6)
    decoder = FastSpeculativeDecoder(short, DeviceOracle(random_drafter(target, 6), target, len(PROMPT) + 8, truth,
                                                         len(PROMPT), None))
    with pytest.raises(ValueError, match="cache_len_for"):
        decoder.generate(PROMPT, 40)
    assert cache_len_for(len(PROMPT), 40, 6) >= tight


def test_plain_forward_after_the_device_loop_asks_for_a_rewind(chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    session = StaticTarget(target, 64, [0], 6)
    session.forward(torch.tensor([PROMPT]))
    session.forward_at(torch.tensor([[198] * 6]), torch.tensor(len(PROMPT)))
    with pytest.raises(RuntimeError, match="rewind"):
        session.forward(torch.tensor([[198]]))
    session.rewind(len(PROMPT) + 2)
    assert session.forward(torch.tensor([[198]]))[0].shape == (1, 1, target.config.vocab_size)
