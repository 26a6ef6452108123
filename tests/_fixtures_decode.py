"""Shared pieces of the decoder tests (test_drafter_decode.py, test_fast_decode.py): a chat prompt, an
oracle drafter spoiled at chosen positions, the acceptance statistics it must give, and the stop cases.
Kept apart from _fixtures_drafter.py, which conftest.py imports in every session: this one imports the
decoder."""
from __future__ import annotations

import torch

from eqc_utils.drafter.decode import DraftFn

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 30, 2, 198, 1, 4093, 198]


class CorruptedOracle(DraftFn):
    """Proposes the target's true greedy continuation but spoils every slot whose absolute position is
    a multiple of `every` (every=None: spoils nothing, a perfect drafter; every=1: spoils everything,
    a drafter that is always wrong). Give it a continuation longer than the token budget, so that slots
    beyond the budget are right too. `accepted_drafts(start)` says how many drafts the target must
    accept in the block anchored at `start`."""

    def __init__(self, continuation: list[int], prompt_len: int, block_size: int, vocab: int,
                 every: int | None = 5):
        self.truth, self.prompt_len, self.block_size, self.vocab, self.every = continuation, prompt_len, block_size, vocab, every
        self.target_layer_ids = [0]

    def spoiled(self, pos: int) -> bool:
        return self.every is not None and pos % self.every == 0

    def accepted_drafts(self, start: int) -> int:
        return next((k - 1 for k in range(1, self.block_size) if self.spoiled(start + k)), self.block_size - 1)

    def reset(self):
        pass

    def __call__(self, anchor_token, start, new_context):
        logits = torch.zeros(self.block_size - 1, self.vocab)
        for k in range(1, self.block_size):
            pos = start + k
            i = pos - self.prompt_len
            assert i < len(self.truth), "give the oracle a longer continuation"
            token = self.truth[i]
            if self.spoiled(pos):
                token = (token + 1) % self.vocab
            logits[k - 1, token] = 1.0
        return logits


def expected_stats(oracle: CorruptedOracle, max_new_tokens: int, emitted_tokens: int | None = None):
    """Acceptance lengths the oracle must produce, counted as vLLM counts them: a step whose output is
    cut (budget or stop) still counts all it accepted. `emitted_tokens`: where a stop ends the output."""
    n, start, lengths = 1, oracle.prompt_len, []
    end = min(max_new_tokens, emitted_tokens or max_new_tokens)
    while n < end:
        committed = oracle.accepted_drafts(start) + 1
        lengths.append(committed)
        n += committed
        start += committed
    accepted_at = [sum(length - 1 > k for length in lengths) for k in range(oracle.block_size - 1)]
    return lengths, accepted_at


# (index of the stop token in the greedy text, token budget); block 6 with a perfect drafter: the
# prefill emits index 0, step 1 indices 1-5 (drafts) + 6 (bonus), step 2 indices 7-12, ...
STOP_CASES = [
    (3, 30),    # draft 3 of step 1
    (9, 30),    # draft 3 of step 2
    (3, 5),     # draft 3 of step 1, and the budget also cuts step 1 (after index 4)
    (4, 5),     # the stop is the last token the budget allows
    (3, 3),     # the budget ends before the stop: plain decoding never reaches it
    (6, 30),    # the bonus token of step 1
    (0, 30),    # the prefill token
]
