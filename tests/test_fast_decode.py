"""The static-cache decoder (eqc_utils/drafter/fast_decode.py) against the reference decoder (decode.py):
same token ids as plain greedy decoding in fp32, and the same acceptance statistics, step for step."""
import pytest
import torch

from eqc_utils.drafter.decode import (DFlashProposer, DraftFn, TargetSession, greedy_generate, measure_acceptance,
                                      speculative_generate)
from eqc_utils.drafter.fast_decode import (FastSpeculativeDecoder, StaticDFlashProposer, StaticTarget, cache_len_for,
                                           UnsupportedTargetError, fast_greedy_generate, fast_speculative_generate,
                                           measure_acceptance_fast)
from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for
from tests._fixtures_decode import PROMPT, STOP_CASES, CorruptedOracle, expected_stats
from tests._fixtures_drafter import load_causal_lm

TARGETS = {"llama": "micro_llama_dir", "chain_llama": "chain_target_dir"}


def target_of(name, request):
    return load_causal_lm(request.getfixturevalue(TARGETS[name]))


def same_stats(fast, ref):
    assert fast.output_ids == ref.output_ids
    assert fast.acceptance_lengths == ref.acceptance_lengths
    assert fast.accepted_at == ref.accepted_at and fast.drafted_at == ref.drafted_at


class RightThenWrong(DraftFn):
    """Proposes the true continuation for the first `right` drafts of every block and a wrong token for
    the rest: every step accepts exactly `right` drafts, and the target must roll back B-1-right."""

    def __init__(self, truth: list[int], prompt_len: int, block_size: int, vocab: int, right: int):
        self.truth, self.prompt_len, self.block_size = truth, prompt_len, block_size
        self.vocab, self.right = vocab, right
        self.target_layer_ids = [0]

    def reset(self):
        pass

    def __call__(self, anchor_token, start, new_context):
        logits = torch.zeros(self.block_size - 1, self.vocab)
        for k in range(1, self.block_size):
            token = self.truth[start + k - self.prompt_len]
            logits[k - 1, token if k <= self.right else (token + 1) % self.vocab] = 1.0
        return logits


class TeacherForcedCheck(FastSpeculativeDecoder):
    """Checks every verification against a cache-free forward over prompt + verified text + block, so a
    stale key left visible after a rollback shows even where the greedy tokens would not change (the
    chain target's next token depends mostly on the last one)."""

    def __init__(self, target, proposer, prompt: list[int], truth: list[int]):
        super().__init__(target, proposer, cache_len_for(len(prompt), len(truth), proposer.block_size))
        self.model, self.prompt, self.truth, self.checked = target, prompt, truth, 0

    def verify(self, token, drafts):
        block_ids, logits, features = super().verify(token, drafts)
        start = self.target.length - block_ids.shape[1]
        seen = self.prompt + self.truth[:start - len(self.prompt)] + block_ids[0].tolist()
        want = self.model(torch.tensor([seen])).logits[0, start:].float()
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        self.checked += 1
        return block_ids, logits, features


class OraclePerPrompt(DraftFn):
    """A CorruptedOracle for each prompt in turn (the decoder resets its proposer once per prompt)."""

    def __init__(self, oracles: list[CorruptedOracle]):
        self.oracles, self.calls = oracles, -1
        self.block_size, self.target_layer_ids = oracles[0].block_size, [0]

    def reset(self):
        self.calls += 1

    def __call__(self, anchor_token, start, new_context):
        return self.oracles[self.calls % len(self.oracles)](anchor_token, start, new_context)


def test_static_cache_rollback_is_moving_the_length(chain_target_dir):
    """Verify 6 tokens, keep 3: the next step must see exactly prompt + 3 tokens. The rejected keys stay in
    the cache (rollback erases nothing): the causal mask hides them until they are overwritten. The
    features must be the layer outputs capture_layers hooks, including the last layer's (pre-norm)."""
    target = load_causal_lm(chain_target_dir)
    layers = [0, target.config.num_hidden_layers - 1]
    block, nxt = torch.tensor([[523, 1107, 90, 4410, 77, 3021]]), torch.tensor([[845, 1200]])
    fresh = TargetSession(target, layers)
    fresh.forward(torch.tensor([PROMPT]))
    fresh.forward(block[:, :3])
    want_logits, want_features = fresh.forward(nxt)

    static = StaticTarget(target, 64, layers, block_size=6)
    static.forward(torch.tensor([PROMPT]))
    static.forward(block)
    keys = static.cache.layers[0].keys
    rejected = keys[:, :, len(PROMPT) + 3:len(PROMPT) + 6].clone()
    static.rewind(len(PROMPT) + 3)
    assert torch.equal(keys[:, :, len(PROMPT) + 3:len(PROMPT) + 6], rejected)       # still there
    assert [int(layer.cumulative_length) for layer in static.cache.layers] == [len(PROMPT) + 3] * len(layers)
    logits, features = static.forward(nxt)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(features, want_features, atol=1e-5, rtol=1e-5)
    assert not torch.equal(keys[:, :, len(PROMPT) + 3:len(PROMPT) + 5], rejected[:, :, :2])   # overwritten
    assert torch.equal(keys[:, :, len(PROMPT) + 5], rejected[:, :, 2])                    # still masked
    # the check has teeth: moving only our own length, not the cache's, leaves the rejected tokens in view
    stale = StaticTarget(target, 64, layers, block_size=6)
    stale.forward(torch.tensor([PROMPT]))
    stale.forward(block)
    stale.length = len(PROMPT) + 3
    stale_logits, _ = stale.forward(nxt)
    assert (stale_logits - want_logits).abs().max() > 1e-2


@pytest.mark.parametrize("arch", list(TARGETS))
def test_fast_greedy_is_bit_identical_to_reference_greedy(arch, request):
    target = target_of(arch, request)
    plain = greedy_generate(target, PROMPT, 48).output_ids
    assert fast_greedy_generate(target, PROMPT, 48).output_ids == plain
    # one StaticTarget reused for prompts of several lengths (stale keys of a longer prompt are masked)
    session = StaticTarget(target, cache_len_for(len(PROMPT), 48))
    for ids in (PROMPT, PROMPT[:5], PROMPT[:9]):
        assert fast_greedy_generate(session, ids, 48).output_ids == greedy_generate(target, ids, 48).output_ids
    stop = plain[len(plain) // 2] if arch == "chain_llama" else 198
    assert (fast_greedy_generate(target, PROMPT, 48, stop_ids={stop}).output_ids
            == greedy_generate(target, PROMPT, 48, stop_ids={stop}).output_ids == plain[:plain.index(stop) + 1])


@pytest.mark.parametrize("stop_at", [0, 6, 7, 8, 9, 16, 18])
def test_greedy_reads_tokens_in_groups_but_stops_where_a_token_by_token_loop_does(stop_at, chain_target_dir):
    """greedy_loop reads the chosen tokens every STOP_CHECK_EVERY steps: the output must still end at the first stop
    id and at max_new_tokens exactly, checked against argmax over full recomputation (no cache at all)."""
    from eqc_utils.drafter.decode import STOP_CHECK_EVERY
    assert STOP_CHECK_EVERY == 8   # the stop positions above straddle the group boundaries
    target = load_causal_lm(chain_target_dir)
    ids, oracle = list(PROMPT), []
    with torch.no_grad():
        for _ in range(24):
            oracle.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(oracle[-1])
    for budget in (0, 1, 7, 8, 9, 24):
        assert greedy_generate(target, PROMPT, budget).output_ids == oracle[:budget]
        assert fast_greedy_generate(target, PROMPT, budget).output_ids == oracle[:budget]
    stop = oracle[stop_at]
    want = oracle[:oracle.index(stop) + 1]           # the stop id may occur before stop_at
    assert greedy_generate(target, PROMPT, 24, stop_ids={stop}).output_ids == want
    assert fast_greedy_generate(target, PROMPT, 24, stop_ids={stop}).output_ids == want


@pytest.mark.parametrize("arch", list(TARGETS))
def test_fast_speculative_is_lossless_and_counts_like_decode(arch, request):
    target = target_of(arch, request)
    plain = greedy_generate(target, PROMPT, 40)
    truth = greedy_generate(target, PROMPT, 46).output_ids
    # an oracle spoiled at every 5th position: partial acceptance and a rollback at each step
    oracle = CorruptedOracle(truth, len(PROMPT), 6, target.config.vocab_size)
    fast = fast_speculative_generate(target, oracle, PROMPT, 40)
    same_stats(fast, speculative_generate(target, oracle, PROMPT, 40))
    assert fast.output_ids == plain.output_ids
    assert fast.acceptance_lengths == [1] + [5] * 8 and fast.tau == pytest.approx(41 / 9)
    assert fast.accepted_at == expected_stats(oracle, 40)[1] == [8, 8, 8, 8, 0]
    # a random DFlash drafter, through the eager DraftCache proposer and the fixed-shape one
    cfg = drafter_config_for(target.config, num_layers=1, block_size=6, target_layer_ids=None, mask_token_id=16)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    ref = speculative_generate(target, DFlashProposer(drafter, target), PROMPT, 40)
    assert ref.output_ids == plain.output_ids
    same_stats(fast_speculative_generate(target, DFlashProposer(drafter, target), PROMPT, 40), ref)
    static = StaticDFlashProposer(drafter, target, cache_len_for(len(PROMPT), 40, 6))
    same_stats(fast_speculative_generate(target, static, PROMPT, 40), ref)


def test_always_wrong_drafter_gives_tau_one(chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 26).output_ids
    wrong = CorruptedOracle(truth, len(PROMPT), 6, target.config.vocab_size, every=1)
    fast = fast_speculative_generate(target, wrong, PROMPT, 20)
    assert fast.output_ids == truth[:20]
    assert fast.acceptance_lengths == [1] * 19
    assert fast.tau == 1.0 and fast.accepted_at == [0] * 5 and fast.drafted_at == [19] * 5


@pytest.mark.parametrize("right", [0, 1, 2, 3, 4])
def test_rollback_after_k_right_drafts(right, chain_target_dir):
    """Block 5: each step accepts exactly `right` of the 4 drafts, so the target rolls back the
    4 - right rejected ones (none at right = 4: a full block)."""
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 40 + 6).output_ids
    drafter = RightThenWrong(truth, len(PROMPT), 5, target.config.vocab_size, right)
    checked = TeacherForcedCheck(target, drafter, PROMPT, truth)
    fast = checked.generate(PROMPT, 40)
    assert fast.output_ids == truth[:40]
    steps = -(-39 // (right + 1))
    assert checked.checked == steps
    assert fast.acceptance_lengths == [right + 1] * steps
    assert fast.accepted_at == [steps if k < right else 0 for k in range(4)]
    same_stats(fast, speculative_generate(target, drafter, PROMPT, 40))


@pytest.mark.parametrize("max_new_tokens, steps", [(33, 8), (31, 8), (30, 8), (29, 7), (1, 0)])
def test_budget_cuts_the_last_block(max_new_tokens, steps, chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 40).output_ids
    oracle = CorruptedOracle(truth, len(PROMPT), 4, target.config.vocab_size, every=None)
    fast = fast_speculative_generate(target, oracle, PROMPT, max_new_tokens)
    assert fast.output_ids == truth[:max_new_tokens]
    assert fast.acceptance_lengths == [4] * steps
    assert fast.accepted_at == fast.drafted_at == [steps] * 3


@pytest.mark.parametrize("stop_index, max_new_tokens", STOP_CASES)
def test_stop_token_among_accepted_drafts_ends_generation(stop_index, max_new_tokens, chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 40).output_ids
    stop = truth[stop_index]
    plain = greedy_generate(target, PROMPT, max_new_tokens, stop_ids={stop}).output_ids
    assert plain == truth[:min(stop_index + 1, max_new_tokens)]
    oracle = CorruptedOracle(truth, len(PROMPT), 6, target.config.vocab_size, every=None)
    fast = fast_speculative_generate(target, oracle, PROMPT, max_new_tokens, stop_ids={stop})
    assert fast.output_ids == plain
    steps = -(-(len(plain) - 1) // 6)
    assert fast.acceptance_lengths == [6] * steps and fast.accepted_at == [steps] * 5
    same_stats(fast, speculative_generate(target, oracle, PROMPT, max_new_tokens, stop_ids={stop}))


def test_measure_acceptance_fast_matches_reference(chain_target_dir):
    """Prompts of different lengths through one cache (sized for the longest, reset in between)."""
    target = load_causal_lm(chain_target_dir)
    prompts = [PROMPT[:6], PROMPT, PROMPT[:9]]
    truths = [greedy_generate(target, p, 40).output_ids for p in prompts]
    stop = truths[1][9]
    oracles = lambda: OraclePerPrompt([CorruptedOracle(t, len(p), 6, target.config.vocab_size, every=4)  # noqa: E731
                                       for t, p in zip(truths, prompts)])
    fast = measure_acceptance_fast(target, oracles(), prompts, 30, stop_ids={stop}, progress=False)
    ref = measure_acceptance(target, oracles(), prompts, 30, stop_ids={stop}, progress=False)
    assert (fast.tau, fast.steps, fast.tokens) == (ref.tau, ref.steps, ref.tokens)
    assert fast.acceptance_per_position == ref.acceptance_per_position
    assert fast.per_prompt_tau == ref.per_prompt_tau
    # the middle prompt, alone: steps commit 2, 4, 4 tokens and the stop is draft 3 of the third step
    lengths, accepted_at = expected_stats(CorruptedOracle(truths[1], len(PROMPT), 6, 1, every=4), 30, emitted_tokens=10)
    assert lengths == [2, 4, 4] and fast.per_prompt_tau[1] == pytest.approx(10 / 3)
    assert fast.tokens == sum(min(30, t.index(stop) + 1) if stop in t else 30 for t in truths)


def test_sampling_matches_reference_with_the_same_seed(chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    cfg = drafter_config_for(target.config, num_layers=1, block_size=4, target_layer_ids=None, mask_token_id=16)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    runs = []
    for generate in (speculative_generate, fast_speculative_generate):
        g = torch.Generator().manual_seed(3)
        runs.append(generate(target, DFlashProposer(drafter, target), PROMPT, 24, temperature=0.7, generator=g))
    same_stats(runs[1], runs[0])
    assert len(runs[0].output_ids) == 24
    report = measure_acceptance_fast(target, DFlashProposer(drafter, target), [PROMPT, PROMPT[:6]], 12,
                                     temperature=0.7, progress=False)
    assert report.tokens == 24 and report.tau == pytest.approx(1 + sum(report.acceptance_per_position))


@pytest.mark.parametrize("window", [None, 8])
def test_static_drafter_drafts_like_the_draft_cache(window, chain_target_dir):
    """The fixed-shape proposer (whole context re-projected, positions >= start masked) gives the logits of
    DFlashProposer (DraftCache, context appended step by step), with and without a sliding window."""
    target = load_causal_lm(chain_target_dir)
    cfg = drafter_config_for(target.config, num_layers=2, block_size=4, target_layer_ids=[0, 1], mask_token_id=16)
    cfg.sliding_window = window
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    features = torch.randn(1, 40, 2 * target.config.hidden_size)
    cached, static = DFlashProposer(drafter, target), StaticDFlashProposer(drafter, target, 48)
    start = 0
    for committed, anchor in [(len(PROMPT), 198), (1, 523), (4, 90), (2, 77), (3, 845)]:
        new = features[:, start:start + committed]
        start += committed
        want, got = cached(anchor, start, new), static(anchor, start, new)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="context"):
        static(1, start + 2, features[:, start:start + 1])


def test_recurrent_target_is_refused_with_a_pointer(micro_qwen35_dir):
    target = load_causal_lm(micro_qwen35_dir)
    message = r"qwen3_5_text.*recurrent.*decode\.speculative_generate"
    with pytest.raises(UnsupportedTargetError, match=message):
        StaticTarget(target, 64)
    with pytest.raises(UnsupportedTargetError, match=message):
        fast_greedy_generate(target, PROMPT, 4)
    oracle = CorruptedOracle([0] * 20, len(PROMPT), 4, target.config.vocab_size)
    with pytest.raises(UnsupportedTargetError, match=message):
        measure_acceptance_fast(target, oracle, [PROMPT], 4, progress=False)


def test_cache_too_small_and_mismatched_sessions_are_errors(chain_target_dir):
    target = load_causal_lm(chain_target_dir)
    assert cache_len_for(14, 40, 6) == 128 and cache_len_for(100, 22, 6) == 128 and cache_len_for(100, 23, 6) == 256
    session = StaticTarget(target, 16, [0], block_size=4)
    with pytest.raises(ValueError, match="max_cache_len=16"):
        fast_greedy_generate(session, PROMPT, 8)
    oracle = CorruptedOracle([0] * 20, len(PROMPT), 6, target.config.vocab_size)
    with pytest.raises(ValueError, match="block_size"):
        FastSpeculativeDecoder(session, oracle)


@pytest.mark.slow
def test_compiled_graphs_match_reference(chain_target_dir):
    """compile=True on CPU (inductor; CUDA graphs only on a GPU): the target's 1-token step and B-token
    verify and the drafter's block pass, each one graph without breaks, give the reference's ids and
    statistics. About 35 s on an idle 2-core CPU (2 minutes under load), mostly inductor's C++ builds."""
    target = load_causal_lm(chain_target_dir)
    truth = greedy_generate(target, PROMPT, 46).output_ids
    cfg = drafter_config_for(target.config, num_layers=1, block_size=6, target_layer_ids=[0], mask_token_id=16)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    ref = speculative_generate(target, DFlashProposer(drafter, target), PROMPT, 40)
    decoder = FastSpeculativeDecoder(target, DFlashProposer(drafter, target), 128, compile=True)
    assert isinstance(decoder.proposer, StaticDFlashProposer) and decoder.proposer.compiled is not None
    for _ in range(2):
        same_stats(decoder.generate(PROMPT, 40), ref)
    session = decoder.target                    # the same cache and graphs for plain decoding ...
    assert fast_greedy_generate(session, PROMPT, 40).output_ids == truth[:40]
    oracle = CorruptedOracle(truth, len(PROMPT), 6, target.config.vocab_size)
    fast = FastSpeculativeDecoder(session, oracle).generate(PROMPT, 40)     # ... and for another drafter
    same_stats(fast, speculative_generate(target, oracle, PROMPT, 40))
    assert fast.acceptance_lengths == [1] + [5] * 8
    session.forward(torch.tensor([[198]]))
    for n in (1, 6):
        ids, pos = torch.full((1, n), 198), torch.arange(session.length, session.length + n)[None]
        assert torch._dynamo.explain(session._forward)(ids, pos).graph_break_count == 0
    explained = torch._dynamo.explain(decoder.proposer._block_pass)(torch.tensor([198]), torch.tensor(20))
    assert explained.graph_break_count == 0


def _chain_llama(device):
    """A micro Llama whose greedy text follows a fixed permutation of 300 tokens (no tokenizer needed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        words = torch.arange(100, 400)
        rows = torch.randn(len(words), 128)
        rows = 3 * rows / rows.norm(dim=1, keepdim=True)
        model.get_input_embeddings().weight[words] = rows
        model.lm_head.weight.mul_(0.1)
        model.lm_head.weight[words] = rows[torch.randperm(len(words))]
    return model.to(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_cuda_graphs_match_reference_on_gpu():
    target = _chain_llama("cuda")
    prompt = [101, 250, 399, 120]
    truth = greedy_generate(target, prompt, 70).output_ids
    session = StaticTarget(target, 128, compile=True)
    for _ in range(2):                      # the second run replays the recorded graphs
        assert fast_greedy_generate(session, prompt, 64).output_ids == truth[:64]
    cuda_oracle = _OnDevice(CorruptedOracle(truth, len(prompt), 6, 1024))
    decoder = FastSpeculativeDecoder(target, cuda_oracle, 128, compile=True)
    for _ in range(2):
        fast = decoder.generate(prompt, 64)
        same_stats(fast, speculative_generate(target, cuda_oracle, prompt, 64))
        assert fast.output_ids == truth[:64]
    cfg = drafter_config_for(target.config, num_layers=1, block_size=6, target_layer_ids=None, mask_token_id=16)
    drafter = DFlashDrafter(cfg).cuda()
    ref = speculative_generate(target, DFlashProposer(drafter, target), prompt, 64)
    decoder = FastSpeculativeDecoder(target, DFlashProposer(drafter, target), 128, compile=True)
    for _ in range(2):
        assert decoder.generate(prompt, 64).output_ids == ref.output_ids == truth[:64]


class _OnDevice(DraftFn):
    """A CPU oracle's logits moved to the target's device."""

    def __init__(self, oracle):
        self.oracle, self.block_size, self.target_layer_ids = oracle, oracle.block_size, oracle.target_layer_ids

    def reset(self):
        self.oracle.reset()

    def __call__(self, anchor_token, start, new_context):
        return self.oracle(anchor_token, start, new_context).to(new_context.device)
