"""QAD training data: teacher conversations rendered with the chat template and packed into
fixed-length chunks (METHOD.md §2.5).

Rows are split into train/validation at the source-row level before tokenising; each conversation
is rendered with the tokenizer's chat template (to a string, then tokenised without special
tokens), followed by one separator (the EOS token); the stream is cut into chunks of exactly
`max_seq_len` and the last partial chunk is right-padded. As in the reference there is no
per-document attention mask. Every chunk comes with per-token loss weights: 0 on the right
padding (marked by position, so a pad id equal to the separator cannot mask separators), and 0 on
system/user tokens too when `mask_prompt` is on.
"""
from __future__ import annotations

import random

import torch

ROLES = {"system", "user", "assistant"}


class TeacherDataError(ValueError):
    """A teacher-data row cannot be used for distillation."""


def check_row(row: dict, where: str) -> list[dict]:
    conv = row.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise TeacherDataError(f"{where}: 'conversations' must be a non-empty list of messages")
    for msg in conv:
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or not isinstance(msg.get("content"), str):
            raise TeacherDataError(f"{where}: every message needs a role in {sorted(ROLES)} and string content")
    if conv[-1]["role"] != "assistant":
        raise TeacherDataError(f"{where}: the last message must be the teacher's assistant answer")
    return conv


def render_tokens(conv: list[dict], tokenizer) -> tuple[list[int], int]:
    """Token ids of a whole conversation and where the assistant answer starts."""
    text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
    prompt = tokenizer.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if text.startswith(prompt) else 0
    return ids, prompt_len


def split_rows(rows: list, val_ratio: float, seed: int) -> tuple[list, list]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(round(len(rows) * val_ratio))) if val_ratio > 0 and len(rows) > 1 else 0
    return [rows[i] for i in order[n_val:]], [rows[i] for i in order[:n_val]]


def pack_documents(docs: list[tuple[list[int], int]], max_seq_len: int, sep_id: int, pad_id: int,
                   mask_prompt: bool) -> dict:
    """Concatenate documents (+ separator) and cut into [N, max_seq_len] ids and loss weights."""
    ids: list[int] = []
    weights: list[float] = []
    for tokens, prompt_len in docs:
        ids += tokens + [sep_id]
        keep_from = prompt_len if mask_prompt else 0
        weights += [0.0] * keep_from + [1.0] * (len(tokens) - keep_from) + [1.0]
    n_chunks = -(-len(ids) // max_seq_len) if ids else 0
    pad = n_chunks * max_seq_len - len(ids)
    ids += [pad_id] * pad
    weights += [0.0] * pad
    return {"input_ids": torch.tensor(ids, dtype=torch.long).reshape(n_chunks, max_seq_len),
            "weights": torch.tensor(weights, dtype=torch.float32).reshape(n_chunks, max_seq_len)}


def build_packs(rows: list[dict], tokenizer, max_seq_len: int, val_ratio: float, seed: int,
                mask_prompt: bool, source: str = "teacher data") -> dict:
    """{"train": {input_ids, weights}, "val": {...}, "meta": {...}} from teacher rows."""
    convs = [check_row(row, f"{source} row {i + 1} (id {row.get('id')})") for i, row in enumerate(rows)]
    train_rows, val_rows = split_rows(convs, val_ratio, seed)
    sep_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sep_id
    packs, meta = {}, {"max_seq_len": max_seq_len, "val_ratio": val_ratio, "shuffle_seed": seed,
                       "sep_id": sep_id, "pad_id": pad_id, "mask_prompt": mask_prompt, "n_source_rows": len(rows)}
    for split, split_rows_ in (("train", train_rows), ("val", val_rows)):
        docs = [render_tokens(conv, tokenizer) for conv in split_rows_]
        random.Random(seed).shuffle(docs)
        packs[split] = pack_documents(docs, max_seq_len, sep_id, pad_id, mask_prompt)
        meta[split] = {"rows": len(docs), "chunks": int(packs[split]["input_ids"].shape[0]),
                       "tokens": int(sum(len(d[0]) + 1 for d in docs))}
    if meta["train"]["chunks"] == 0:
        raise TeacherDataError(f"{source}: no training chunks (only {len(rows)} rows); generate more teacher data")
    packs["meta"] = meta
    return packs
