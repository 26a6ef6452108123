"""The transformers backend of the data generator: batched `generate` of a local HF model, for GPU
machines without vLLM. Same input, output rows, resume and partial-file rules as
`eqc_utils.generation` (read its docstring for the schema)."""
from __future__ import annotations

import time
from pathlib import Path

from eqc_utils.devices import resolve_device
from eqc_utils.generation import (GenerationStats, finish_output, load_prompts, open_for_resume, output_row,
                                  reconstruct_text, sampling_params)


def render_prompt(tokenizer, messages: list[dict], thinking: str) -> list[int]:
    """Token ids of the chat-template rendering (string first, then tokenised without special
    tokens, as the reference does), with the thinking switch when it is on/off."""
    kwargs = {} if thinking == "auto" else {"enable_thinking": thinking == "on"}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_hf(model: str | Path, prompts_path: str | Path, out_path: str | Path, gen: dict, *,
                device: str = "auto") -> GenerationStats:
    """Answer every prompt not yet in `out_path`, `gen["hf_batch_size"]` prompts per generate call
    (grouped by length to waste little padding)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_path = Path(out_path)
    device = resolve_device(device)
    prompts = load_prompts(prompts_path)
    sampling = sampling_params(gen)
    todo, writer = open_for_resume(out_path, prompts, sampling, str(model), gen["limit"])
    stats = GenerationStats(already_done=len(prompts[:gen["limit"]]) - len(todo), backend="transformers")
    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos_ids = _eos_ids(lm, tokenizer)
        if gen["seed"] is not None:
            torch.manual_seed(gen["seed"])
        encoded = sorted(((row, msgs, render_prompt(tokenizer, msgs, gen["thinking"])) for row, msgs in todo),
                         key=lambda item: len(item[2]))
        bar = tqdm(total=len(encoded), desc=f"generate {out_path.name} (transformers)", unit="row", dynamic_ncols=True)
        for start in range(0, len(encoded), gen["hf_batch_size"]):
            batch = encoded[start:start + gen["hf_batch_size"]]
            for (row, msgs, ids), new_ids in zip(batch, _generate_batch(lm, [b[2] for b in batch], gen, pad_id,
                                                                       eos_ids, device)):
                finished = bool(new_ids) and new_ids[-1] in eos_ids
                text = tokenizer.decode(new_ids, skip_special_tokens=True)
                text = reconstruct_text(text, None, gen["thinking"], gen["include_reasoning"])
                _record(stats, writer, gen, output_row(
                    row, msgs, text, finish_reason="stop" if finished else "length", prompt_tokens=len(ids),
                    completion_tokens=len(new_ids), gen_model=str(model), sampling=sampling))
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{stats.completion_tokens / max(1e-9, time.monotonic() - started):.0f}",
                            refresh=False)
        bar.close()
    finally:
        writer.close()
    stats.seconds = time.monotonic() - started
    stats.tokens_per_s = stats.completion_tokens / max(stats.seconds, 1e-9)
    stats.rows = finish_output(out_path)
    return stats


def _eos_ids(lm, tokenizer) -> set[int]:
    eos = lm.generation_config.eos_token_id if lm.generation_config.eos_token_id is not None else tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def _generate_batch(lm, batch_ids: list[list[int]], gen: dict, pad_id: int, eos_ids: set, device: str) -> list[list[int]]:
    """New tokens per prompt, cut after the first end-of-sequence token (kept, as vLLM counts it)."""
    import torch
    width = max(len(ids) for ids in batch_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch_ids], device=device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids], device=device)
    sample = gen["temperature"] > 0
    kwargs = dict(do_sample=sample, max_new_tokens=gen["max_tokens"], pad_token_id=pad_id, eos_token_id=sorted(eos_ids))
    if sample:
        kwargs.update(temperature=gen["temperature"], top_p=gen["top_p"], top_k=gen["top_k"] if gen["top_k"] > 0 else None)
    with torch.inference_mode():
        out = lm.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
    results = []
    for seq in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(seq) if t in eos_ids), len(seq))
        results.append(seq[:cut])
    return results


def _record(stats: GenerationStats, writer, gen: dict, row: dict) -> None:
    stats.prompt_tokens += row["prompt_tokens"]
    stats.completion_tokens += row["completion_tokens"]
    if row["finish_reason"] == "length":
        stats.truncated += 1
        if not gen["keep_truncated"]:
            stats.dropped_truncated += 1
            return
    if row["response"]:
        writer.write(row)
        stats.new_rows += 1
    else:
        stats.failures += 1  # empty answers are not saved (a re-run asks again), as with vLLM
