"""Conversations -> token ids + assistant loss mask for drafter training (docs/recipe.md §3.3), and batches.

A row is one generated conversation (`conversations`: system, user, assistant). It is rendered with
the tokenizer's own chat template; the loss covers the final assistant turn (everything after the
generation prompt, end-of-turn token included). Rows with fewer than `min_loss_tokens` loss tokens
after truncation to `max_length` are dropped (too short to place a block).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from eqc_utils.conversation import encode_prompt_and_answer, prompt_and_answer_text, training_messages
from eqc_utils.generation.rows import prompt_id_of


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]


TOKENIZE_CHUNK = 2048   # rows rendered, then tokenised in one call (progress is shown per chunk)


def build_examples(rows: list[dict], tokenizer, max_length: int, min_loss_tokens: int, where: str = "") -> list[Example]:
    examples = []
    with tqdm(total=len(rows), desc="tokenize", leave=False) as progress:
        for start in range(0, len(rows), TOKENIZE_CHUNK):
            chunk = rows[start:start + TOKENIZE_CHUNK]
            parts = [prompt_and_answer_text(tokenizer, training_messages(row, where)) for row in chunk]
            for ids, prompt_len in encode_prompt_and_answer(tokenizer, parts):
                example = Example(ids[:max_length], ([0] * prompt_len + [1] * (len(ids) - prompt_len))[:max_length])
                if sum(example.loss_mask) >= min_loss_tokens:
                    examples.append(example)
            progress.update(len(chunk))
    if not examples:
        raise ValueError(f"{where}: no conversation has >= {min_loss_tokens} assistant tokens within "
                         f"{max_length} tokens; check the data file or lower drafter.block_size")
    return examples


def collate(examples: list[Example], device, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch (pad id 0, attention and loss mask 0 on padding), as wide as its longest example or
    `pad_to` (a fixed width: one shape for a compiled drafter)."""
    width = max([len(e.input_ids) for e in examples] + [pad_to or 0])
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        attention[i, :n] = 1
        loss[i, :n] = torch.tensor(e.loss_mask)
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "loss_mask": loss.to(device)}


def epoch_batches(num_examples: int, batch_size: int, seed: int, epoch: int, rank: int = 0,
                  world: int = 1, lengths: list[int] | None = None, length_grouping: int = 0) -> list[list[int]]:
    """This rank's batches (example indices) of one epoch: shuffled with (seed, epoch), last partial
    batch dropped, dealt round-robin across ranks. Deterministic, so a resumed run skips exactly
    the batches it already trained on.

    `length_grouping` > 0 (needs `lengths`): the shuffled order is cut into windows of that many
    batches, each window is sorted by length before it is cut into batches, and the batches are
    shuffled again. A batch then holds examples of similar length, so padding it to its longest
    example wastes little, while which examples meet in a window stays random (transformers'
    `group_by_length` idea). Same batches per epoch, every example at most once."""
    order = list(range(num_examples))
    rng = random.Random(seed * 1_000_003 + epoch)
    rng.shuffle(order)
    usable = num_examples - num_examples % batch_size
    if length_grouping > 0:
        if lengths is None or len(lengths) != num_examples:
            raise ValueError("epoch_batches: length_grouping needs the length of every example")
        window = length_grouping * batch_size
        order = [i for start in range(0, usable, window)
                 for i in sorted(order[start:min(start + window, usable)], key=lambda i: (-lengths[i], i))]
    batches = [order[i:i + batch_size] for i in range(0, usable, batch_size)]
    if length_grouping > 0:
        rng.shuffle(batches)
    batches = batches[:len(batches) - len(batches) % world]   # every rank takes the same number of steps
    return batches[rank::world]


def padded_width(longest: int, pad_multiple: int | None, max_length: int) -> int:
    """Width a compiled drafter's batch is padded to: the next multiple of `pad_multiple` at or above its
    longest example, at most `max_length` (None: always `max_length`, a single shape). Each width is one
    compiled graph, so the multiple bounds how many graphs there are: ceil(max_length / pad_multiple)."""
    if pad_multiple is None:
        return max_length
    return min(max_length, -(-longest // pad_multiple) * pad_multiple)


def split_heldout(rows: list[dict], heldout: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): the `heldout` prompts with the smallest md5 of their prompt id are
    kept out of training and serve as the prompts on which acceptance is measured, one row each; the
    other samples of those prompts (generation.n > 1) are dropped from training too. Chosen by id, not
    by file position: the generators write rows in completion order (vLLM) or prompt-length order
    (transformers), so "the last rows" would be a biased sample, e.g. the longest prompts."""
    prompts = {}
    for i, row in enumerate(rows):
        prompts.setdefault(str(prompt_id_of(row) if prompt_id_of(row) is not None else i), []).append(i)
    if heldout >= len(prompts):
        raise ValueError(f"drafter.heldout_prompts={heldout} leaves no training data out of {len(prompts)} prompts")
    chosen = sorted(prompts, key=lambda key: hashlib.md5(key.encode()).hexdigest())[:heldout]
    out = {i for key in chosen for i in prompts[key]}
    first = {prompts[key][0] for key in chosen}
    return ([row for i, row in enumerate(rows) if i not in out],
            [row for i, row in enumerate(rows) if i in first])


def heldout_seen_in_pretraining(pretrained_rows: list[dict], finetune_rows: list[dict], heldout: int) -> list[str]:
    """Prompt ids that a fine-tuning run on `finetune_rows` holds out but that a pre-training run trained on
    (`pretrained_rows`: the rows it trained on). Empty when stage 2's prompts are disjoint from stage 1's, the same
    set or a superset of it (a held-out prompt of the larger set that is in the smaller one has a smaller md5 rank
    there, so it is held out there too); a strict subset or a partial overlap can leave some, and then the two-stage
    arm would be scored on prompts its pre-training saw."""
    pretrained_on = {str(prompt_id_of(r)) for r in pretrained_rows if prompt_id_of(r) is not None}
    measured_on = {str(prompt_id_of(r)) for r in split_heldout(finetune_rows, heldout)[1]
                   if prompt_id_of(r) is not None}
    return sorted(measured_on & pretrained_on)
