"""QAD data packing: loss weights score the prediction of the next token, the answer is located
exactly, and a chat template that hides it is a clear error."""
import re

import pytest
import torch

from _fixtures_quant import teacher_rows
from eqc_utils import assets
from eqc_utils.quant.packing import TeacherDataError, build_packs, pack_documents, render_tokens

P1, P2, A1, A2, Q1, B1, SEP, PAD = 11, 12, 21, 22, 31, 41, 2, 0


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(assets.teacher_dir())


def test_masked_weights_mark_positions_whose_next_token_is_a_response_token():
    # Two documents: prompt [P1 P2] + answer [A1 A2], and prompt [Q1] + answer [B1]. Stream (+ separators,
    # then padding to 2 x 5):  P1 P2 A1 A2 SEP | Q1 B1 SEP PAD PAD
    docs = [([P1, P2, A1, A2], 2), ([Q1, B1], 1)]
    packed = pack_documents(docs, max_seq_len=5, sep_id=SEP, pad_id=PAD, mask_prompt=True)
    assert packed["input_ids"].tolist() == [[P1, P2, A1, A2, SEP], [Q1, B1, SEP, PAD, PAD]]
    # Position i scores the prediction of token i+1:
    #   P1->P2 0, P2->A1 1, A1->A2 1, A2->SEP 1, SEP->Q1 0 (across the chunk boundary: the next prompt),
    #   Q1->B1 1, B1->SEP 1, SEP->PAD 0, padding 0.
    assert packed["weights"].tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    # Without the mask (the reference): every real position counts, padding does not, even when the pad id
    # is the separator's.
    plain = pack_documents(docs, max_seq_len=5, sep_id=SEP, pad_id=SEP, mask_prompt=False)
    assert plain["weights"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # A chunk that ends on the last prompt token still scores the first answer token of the next chunk.
    edge = pack_documents([([P1, P2, A1], 2)], max_seq_len=2, sep_id=SEP, pad_id=PAD, mask_prompt=True)
    assert edge["weights"].tolist() == [[0, 1], [1, 0]]
    with pytest.raises(TeacherDataError, match="prompt length 3 is outside a document of 2 tokens"):
        pack_documents([([P1, A1], 3)], max_seq_len=4, sep_id=SEP, pad_id=PAD, mask_prompt=True)


def test_render_tokens_starts_the_answer_where_generation_starts(tokenizer):
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"},
            {"role": "assistant", "content": "\n\nParis."}]
    ids, prompt_len = render_tokens(conv, tokenizer)
    prompt = tokenizer.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
    # The prompt ends in "\n" and the answer starts with "\n\n": tokenising the whole text would merge them
    # into one token that straddles the boundary; the prompt must be exactly what generation started from.
    assert ids[:prompt_len] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[prompt_len:]) == "\n\nParis.<|im_end|>\n"
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conv, tokenize=False)


def test_conversations_encoded_together_are_encoded_as_each_alone(tokenizer):
    """Drafter and QAD data tokenise all prompts in one tokenizer call and all answers in another: each
    conversation must get exactly the ids it gets alone (no padding, no merging across rows)."""
    from eqc_utils.conversation import encode_prompt_and_answer, prompt_and_answer_text
    answers = ["\n\nParis.", " leading space", "tabs\tand ünïcödé ✓", "", "x" * 700, "1. a\n2. b\n\n```py\nx = 1\n```"]
    convs = [[{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": a}]
             for i, a in enumerate(answers)]
    parts = [prompt_and_answer_text(tokenizer, conv) for conv in convs]
    together = encode_prompt_and_answer(tokenizer, parts)
    for (prompt, answer), (ids, prompt_len) in zip(parts, together):
        alone = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert (ids, prompt_len) == (alone + tokenizer(answer, add_special_tokens=False)["input_ids"], len(alone))
    assert len(together) == len(convs) and encode_prompt_and_answer(tokenizer, []) == []


def test_template_that_renders_the_prompt_differently_is_a_clear_error(tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    # The generation prompt opens an empty think block that the rendered conversation does not contain.
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}"
                         "{% endif %}")
    conv = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    with pytest.raises(TeacherDataError, match=r"renders the prompt .* differently .*first difference at character "
                                               r"\d+: prompt '<think>.*cannot be located"):
        render_tokens(conv, tok)
    rows = [{"id": f"r{i}", "conversations": conv} for i in range(3)]
    with pytest.raises(TeacherDataError, match=r"^teacher data row \d \(id r\d\): the chat template renders"):
        build_packs(rows, tok, max_seq_len=16, val_ratio=0.0, seed=0, mask_prompt=True)


def test_masked_packs_score_exactly_the_answers(tokenizer):
    rows = teacher_rows(12)
    packs = build_packs(rows, tokenizer, max_seq_len=64, val_ratio=0.25, seed=3, mask_prompt=True)
    eos = tokenizer.eos_token
    for split in ("train", "val"):
        ids = packs[split]["input_ids"].reshape(-1)
        weights = packs[split]["weights"].reshape(-1)
        n_real = packs["meta"][split]["tokens"]
        assert weights[n_real - 1:].eq(0).all(), "the last separator and the padding predict nothing"
        scored = tokenizer.decode(ids[1:][weights[:-1] == 1])
        # The answers, in stream order, each followed by its end-of-turn and the separator.
        stream = tokenizer.decode(ids[:n_real])
        answers = re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>\n", stream, flags=re.S)
        assert len(answers) == packs["meta"][split]["rows"]
        assert scored == "".join(f"{a}{eos}\n{eos}" for a in answers)
    plain = build_packs(rows, tokenizer, max_seq_len=64, val_ratio=0.25, seed=3, mask_prompt=False)
    assert torch.equal(plain["train"]["input_ids"], packs["train"]["input_ids"])
    n_real = plain["meta"]["train"]["tokens"]
    assert plain["train"]["weights"].reshape(-1)[:n_real].eq(1).all()
    assert plain["train"]["weights"].reshape(-1)[n_real:].eq(0).all()


def test_validation_split_is_by_prompt():
    from eqc_utils.quant.packing import split_rows
    rows = list(range(12))
    keys = [f"p{i // 3}" for i in rows]                 # 4 prompts x 3 samples
    train, val = split_rows(rows, 0.25, seed=0, keys=keys)
    assert len(val) == 3 and len({keys[i] for i in val}) == 1
    assert not {keys[i] for i in val} & {keys[i] for i in train} and sorted(train + val) == rows
    # one row per prompt: the row split as before (same seed, same validation rows)
    assert split_rows(rows, 0.25, seed=0) == split_rows(rows, 0.25, seed=0, keys=[f"k{i}" for i in rows])
    import random
    order = list(range(12))
    random.Random(0).shuffle(order)
    assert split_rows(rows, 0.25, seed=0)[1] == order[:3]
