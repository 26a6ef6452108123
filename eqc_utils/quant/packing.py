"""QAD training data: teacher conversations rendered with the chat template and packed into
fixed-length chunks (docs/recipe.md §2.5).

Rows are split into train/validation at the source-row level before tokenising; each conversation
is rendered with the tokenizer's chat template (to a string, then tokenised without special
tokens: the prompt with its generation prompt, then the rest, as at inference), followed by one
separator (the EOS token); the stream is cut into chunks of exactly `max_seq_len` and the last
partial chunk is right-padded. As in the reference there is no per-document attention mask.

Every chunk comes with per-token loss weights. The KL at position i compares the two models'
predictions of token i+1 (logits are not shifted, see `kl.py`), so a weight is about the *next*
token. Without `mask_prompt` (the reference) every position of the stream has weight 1 and the right
padding 0 (marked by position, so a pad id equal to the separator cannot mask separators). With
`mask_prompt`, position i has weight 1 iff token i+1 of the stream is a response token: a token of
the final assistant turn after the generation prompt, or the separator that ends it. Positions
whose next token is a system/user/generation-prompt token, or padding, have weight 0.
"""
from __future__ import annotations

import random

import torch

from eqc_utils.conversation import (ConversationError, encode_prompt_and_answer, prompt_and_answer_text,
                                    render_with_answer, training_messages)
from eqc_utils.generation.rows import prompt_id_of

class TeacherDataError(ValueError):
    """A teacher-data row cannot be used for distillation."""


def check_row(row: dict, where: str) -> list[dict]:
    try:
        return training_messages(row, where)
    except ConversationError as error:
        raise TeacherDataError(str(error)) from error


def render_tokens(conv: list[dict], tokenizer) -> tuple[list[int], int]:
    """Token ids of a whole conversation and where the assistant answer starts (`conversation.render_with_answer`)."""
    try:
        return render_with_answer(tokenizer, conv)
    except ConversationError as error:
        raise TeacherDataError(str(error)) from error


def split_rows(rows: list, val_ratio: float, seed: int, keys: list | None = None) -> tuple[list, list]:
    """(train, val). With `keys` (the prompt each row answers), the split is by prompt: every sample of
    a prompt lands on the same side, so validation never scores answers to prompts seen in training.
    With one row per key this is the row split it always was (same seed, same rows)."""
    keys = list(range(len(rows))) if keys is None else keys
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    members = list(groups.values())
    order = list(range(len(members)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(round(len(members) * val_ratio))) if val_ratio > 0 and len(members) > 1 else 0
    def rows_of(chosen):
        return [rows[i] for g in chosen for i in members[g]]
    return rows_of(order[n_val:]), rows_of(order[:n_val])


def pack_documents(docs: list[tuple[list[int], int]], max_seq_len: int, sep_id: int, pad_id: int,
                   mask_prompt: bool) -> dict:
    """Concatenate documents (+ separator) and cut into [N, max_seq_len] ids and loss weights.

    `docs` are (token ids, prompt length) pairs. With `mask_prompt`, weight i is 1 iff token i+1 of the
    whole stream (across chunk boundaries) is a response token or a separator; see the module docstring.
    """
    ids: list[int] = []
    is_response: list[bool] = []
    for tokens, prompt_len in docs:
        if not 0 <= prompt_len <= len(tokens):
            raise TeacherDataError(f"prompt length {prompt_len} is outside a document of {len(tokens)} tokens")
        ids += tokens + [sep_id]
        is_response += [False] * prompt_len + [True] * (len(tokens) - prompt_len) + [True]
    if mask_prompt:
        weights = [1.0 if nxt else 0.0 for nxt in is_response[1:]] + ([0.0] if ids else [])
    else:
        weights = [1.0] * len(ids)
    n_chunks = -(-len(ids) // max_seq_len) if ids else 0
    pad = n_chunks * max_seq_len - len(ids)
    ids += [pad_id] * pad
    weights += [0.0] * pad
    return {"input_ids": torch.tensor(ids, dtype=torch.long).reshape(n_chunks, max_seq_len),
            "weights": torch.tensor(weights, dtype=torch.float32).reshape(n_chunks, max_seq_len)}


def _render_all(labelled: list[tuple[str, list[dict]]], tokenizer) -> list[tuple[list[int], int]]:
    """(token ids, answer start) of each (where, conversation); a conversation the template cannot split is an
    error that names its row."""
    parts = []
    for where, conv in labelled:
        try:
            parts.append(prompt_and_answer_text(tokenizer, conv))
        except ConversationError as error:
            raise TeacherDataError(f"{where}: {error}") from error
    return encode_prompt_and_answer(tokenizer, parts)


def build_packs(rows: list[dict], tokenizer, max_seq_len: int, val_ratio: float, seed: int,
                mask_prompt: bool, source: str = "teacher data") -> dict:
    """{"train": {input_ids, weights}, "val": {...}, "meta": {...}} from teacher rows."""
    wheres = [f"{source} row {i + 1} (id {row.get('id')})" for i, row in enumerate(rows)]
    convs = [(where, check_row(row, where)) for where, row in zip(wheres, rows)]
    train_rows, val_rows = split_rows(convs, val_ratio, seed, keys=[prompt_id_of(row) for row in rows])
    sep_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sep_id
    packs, meta = {}, {"max_seq_len": max_seq_len, "val_ratio": val_ratio, "shuffle_seed": seed,
                       "sep_id": sep_id, "pad_id": pad_id, "mask_prompt": mask_prompt, "n_source_rows": len(rows)}
    for split, split_rows_ in (("train", train_rows), ("val", val_rows)):
        docs = _render_all(split_rows_, tokenizer)
        random.Random(seed).shuffle(docs)
        packs[split] = pack_documents(docs, max_seq_len, sep_id, pad_id, mask_prompt)
        meta[split] = {"rows": len(docs), "chunks": int(packs[split]["input_ids"].shape[0]),
                       "tokens": int(sum(len(d[0]) + 1 for d in docs))}
    if meta["train"]["chunks"] == 0:
        raise TeacherDataError(f"{source}: no training chunks (only {len(rows)} rows); generate more teacher data")
    packs["meta"] = meta
    return packs
