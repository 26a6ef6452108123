"""The engines of the data generator's transformers backend: a local HF model answers the prompts in-process,
for GPU machines without vLLM. `generate_hf` runs them with the same input, output rows, samples per prompt,
resume and partial-file rules as the vLLM backend (`eqc_utils.generation.rows`).

Four engines (`generation.hf_engine`; measurements: docs/generation.md), three from transformers itself:
  * `generate`: stock `generate` with a dynamic cache on batches of `hf_batch_size` sequences, longest
    prompts first, left-padded. The plain fallback. With `hf_refill` < 1 a batch's call ends once that
    share of its answers has ended, and the rest continue beside new sequences.
  * `static`: the same batches with a static KV cache (per batch: longest prompt rounded up to a power of
    two, plus max_tokens), so that transformers compiles the decoding step with torch.compile and CUDA
    graphs on a GPU; the first batch of each new shape pays the compile. Fastest on one H200.
  * `continuous`: transformers' continuous-batching manager (paged KV cache): a finished sequence frees its
    place for the next one at once; `hf_batch_size` caps the sequences decoded together. Fast only with
    flash attention installed.
  * `slots` (eqc_utils.generation.slots): continuous batching inside one fixed compiled shape: `hf_batch_size`
    slots share a static KV cache, each at its own position, and a finished answer's slot takes the next
    prompt; attention-only Llama/Qwen2/Qwen3 decoders. The small profile's choice on a GPU.
Each (prompt, sample) is its own sequence; samples of one prompt sit next to each other. Greedy outputs of
every engine equal each prompt's unbatched `generate` (tests/test_generation.py, fp32).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from eqc_utils.conversation import render_prompt
from eqc_utils.devices import resolve_device
from eqc_utils.generation.slots import run_slots
from eqc_utils.generation.rows import (GenerationStats, RowRecorder, RowWriter, finish_output, load_prompts,
                                       open_for_resume, reconstruct_text, samples_per_prompt, sampling_params)

log = logging.getLogger(__name__)

ENGINES = ("generate", "static", "continuous", "slots")


@dataclass
class Sequence:
    """One answer to make (a `rows.Job`) with its prompt's token ids."""
    job: object
    ids: list[int]


def answer(lm, tokenizer, jobs: list, gen: dict, emit, desc: str) -> None:
    """Answer `jobs` (each with .messages) with the engine `gen["hf_engine"]`, calling `emit(sequence, new
    token ids)` as answers end (None for one the continuous batcher failed), under a progress bar."""
    import torch
    from tqdm.auto import tqdm
    engine = gen.get("hf_engine", "generate")
    if engine not in ENGINES:
        raise ValueError(f"generation.hf_engine must be one of {ENGINES}, got {engine!r}")
    if not 0 < gen.get("hf_refill", 1.0) <= 1:
        raise ValueError(f"generation.hf_refill must be in (0, 1], got {gen['hf_refill']!r}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = eos_token_ids(lm, tokenizer)
    if gen["seed"] is not None:
        torch.manual_seed(gen["seed"])
    sequences = [Sequence(job, render_prompt(tokenizer, job.messages, gen["thinking"])) for job in jobs]
    bar = tqdm(total=len(sequences), desc=desc, unit="row", dynamic_ncols=True)
    started, tokens = time.monotonic(), [0]

    def emit_and_show(seq: Sequence, new_ids: list[int] | None) -> None:
        emit(seq, new_ids)
        tokens[0] += len(new_ids or [])
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens[0] / max(1e-9, time.monotonic() - started):.0f}", refresh=False)

    try:
        run_engine(lm, sequences, gen, pad_id, eos_ids, emit_and_show)
    finally:
        bar.close()


def run_engine(lm, sequences: list[Sequence], gen: dict, pad_id: int, eos_ids: set, emit) -> None:
    """Answer `sequences` with the engine `gen["hf_engine"]`, calling `emit(sequence, new ids)` per answer."""
    engine = gen.get("hf_engine", "generate")
    if engine == "continuous":
        run_continuous(lm, sequences, gen, pad_id, eos_ids, emit)
    elif engine == "slots":
        run_slots(lm, sequences, gen, eos_ids, emit)
    else:
        run_batches(lm, sequences, gen, pad_id, eos_ids, emit, static_cache=engine == "static")


def load_model(model: str | Path, device: str = "auto"):
    """(model, tokenizer): bf16 on a GPU, fp32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = resolve_device(device)
    tokenizer = AutoTokenizer.from_pretrained(model)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    return lm, tokenizer


def eos_token_ids(lm, tokenizer) -> set[int]:
    eos = lm.generation_config.eos_token_id if lm.generation_config.eos_token_id is not None else tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def cut_after_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """New tokens up to the first end-of-sequence token, kept (vLLM counts it too)."""
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return tokens[:cut]


def sampling_kwargs(gen: dict) -> dict:
    """`generate` settings for params' sampling: greedy at temperature 0, else T / top_p / top_k."""
    if gen["temperature"] <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": gen["temperature"], "top_p": gen["top_p"],
            "top_k": gen["top_k"] if gen["top_k"] > 0 else None}


def batch_sampling_kwargs(gen: dict) -> dict:
    """`sampling_kwargs` for the batch engines: temperature, top-k and top-p run as one `TopKTopP` processor."""
    from transformers import LogitsProcessorList
    kwargs = sampling_kwargs(gen)
    if kwargs["do_sample"] and gen["top_k"] > 0 and gen["top_p"] < 1.0:
        # transformers puts processors passed in before its own warpers: the temperature must come with them
        fused = TopKTopP(gen["temperature"], gen["top_k"], gen["top_p"])
        kwargs.update(temperature=1.0, top_k=0, top_p=1.0, logits_processor=LogitsProcessorList([fused]))
    return kwargs


class TopKTopP:
    """transformers' Temperature, TopK and TopP warpers in one step that sorts only the k best scores.

    TopP sorts the whole vocabulary, although after TopK all but k scores are -inf: at batch 1024 with SmolLM2's
    49K-token vocabulary that sort was 3.3 ms of a 22.8 ms decoding step on one H200 (docs/generation.md). The
    same tokens survive (a token stays when the probability mass of the better tokens is below top_p, the best one
    always), with the same scores, so sampling draws what the three warpers would; only a tie at the k-th score
    differs (TopK keeps every tied token, this keeps k)."""

    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids, scores):
        import torch
        values, index = (scores / self.temperature).topk(min(self.top_k, scores.shape[-1]), dim=-1)  # best first
        probs = values.softmax(-1)
        keep = probs.cumsum(-1) - probs < self.top_p
        keep[..., 0] = True
        kept = values.masked_fill(~keep, float("-inf"))
        return torch.full_like(scores, float("-inf")).scatter_(-1, index, kept)


# ---------------------------------------------------------------- engines generate and static
@dataclass
class Answering:
    """A sequence in a batch and the answer tokens it has so far (from earlier rounds)."""
    seq: Sequence
    tokens: list[int]


def run_batches(lm, sequences: list[Sequence], gen: dict, pad_id: int, eos_ids: set, emit, *,
                static_cache: bool) -> None:
    """`hf_batch_size` sequences decoded together in rounds of `generate`. Engine generate: a round ends once
    `hf_refill` of its sequences have finished (or all of them, at 1.0); finished ones are emitted, the others
    stay in the batch with their answer so far as part of their prompt, and new sequences take the free
    places. Without that, a batch idles until its longest answer ends: with the small profile's answers
    (median ~206 tokens, ~27% at the 384 cap) about 40% of the decoding work goes to finished sequences.
    Engine static always runs each batch to its end: refilled rounds each bring a new batch size and cache
    length, which the compiled decoding step has to record again (one H200 run of static with refill 0.3
    gave 4.2K tok/s; docs/generation.md).

    New sequences are taken longest prompt first: the first batch is the largest, so a batch size that does
    not fit in memory fails at once rather than hours in; the sort is stable, so a prompt's samples stay
    together and a batch holds prompts of similar length."""
    queue = deque(sorted(sequences, key=lambda s: -len(s.ids)))
    share = 1.0 if static_cache else gen.get("hf_refill", 1.0)
    batch: list[Answering] = []
    while queue or batch:
        while queue and len(batch) < gen["hf_batch_size"]:
            batch.append(Answering(queue.popleft(), []))
        budgets = [gen["max_tokens"] - len(a.tokens) for a in batch]
        inputs = [a.seq.ids + a.tokens for a in batch]
        cache_len = static_cache_len(inputs, max(budgets)) if static_cache else None
        round_started = time.monotonic()
        news = generate_round(lm, inputs, budgets, gen, pad_id, eos_ids, share, cache_len)
        # per-round shape and time: where a stage's time goes (compiles of new shapes, idle finished places)
        log.info("round: %d sequences, width %d, cache %s, %d steps, %d new tokens, %.1f s", len(batch),
                 max(len(ids) for ids in inputs), cache_len, max(map(len, news)), sum(map(len, news)),
                 time.monotonic() - round_started)
        unfinished = []
        for answering, new_ids in zip(batch, news):
            answering.tokens += new_ids
            if (new_ids and new_ids[-1] in eos_ids) or len(answering.tokens) >= gen["max_tokens"]:
                emit(answering.seq, answering.tokens)
            else:
                unfinished.append(answering)
        batch = unfinished


def static_cache_len(batch_ids: list[list[int]], new_tokens: int) -> int:
    """Static cache length of one round: its longest input rounded up to a power of two (at least 128), plus
    the new tokens. Each decoding step attends over the whole static cache, so one size fitted to the longest
    input of a run would slow the many short batches; powers of two keep the compiled shapes few."""
    width = max(len(ids) for ids in batch_ids)
    return max(128, 1 << (width - 1).bit_length()) + new_tokens


def generate_round(lm, batch_ids: list[list[int]], budgets: list[int], gen: dict, pad_id: int, eos_ids: set,
                   share: float = 1.0, static_cache_len: int | None = None) -> list[list[int]]:
    """New tokens of each left-padded input, at most its budget, cut after an end-of-sequence token; the call
    returns early once `share` of the inputs have finished (static cache of `static_cache_len` if given)."""
    import torch
    from transformers import StoppingCriteriaList
    device = lm.device
    width = max(len(ids) for ids in batch_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch_ids], device=device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids], device=device)
    kwargs = dict(max_new_tokens=max(budgets), pad_token_id=pad_id, eos_token_id=sorted(eos_ids),
                  **batch_sampling_kwargs(gen))
    if share < 1.0:
        kwargs["stopping_criteria"] = StoppingCriteriaList([ShareFinished(width, budgets, eos_ids, share, device)])
    if static_cache_len is not None:
        # one specialised graph per cache size: with the default (dynamic None) the second size a process sees
        # recompiles the step with symbolic shapes; a stage's later rounds ran ~2.3x slower per step than a process
        # that only saw one size (docs/generation.md, which says what is and is not yet measured)
        from transformers import CompileConfig
        kwargs.update(cache_implementation="static", max_cache_len=static_cache_len,
                      compile_config=CompileConfig(dynamic=False))
    with torch.inference_mode():
        out = lm.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
    return [cut_after_eos(seq[:budget], eos_ids) for seq, budget in zip(out[:, width:].tolist(), budgets)]


class ShareFinished:
    """A `generate` stopping criterion: stops the whole call once `share` of its rows have an end-of-sequence
    token or have used their own budget (their places are then better given to new sequences)."""

    def __init__(self, start: int, budgets: list[int], eos_ids: set, share: float, device):
        import torch
        self.start, self.share = start, share
        self.budgets = torch.tensor(budgets, device=device)
        self.eos = torch.tensor(sorted(eos_ids), device=device)

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        new = input_ids[:, self.start:]
        done = torch.isin(new, self.eos).any(dim=1) | (new.shape[1] >= self.budgets)
        stop = bool(done.float().mean() >= self.share)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


# ---------------------------------------------------------------- engine continuous
def run_continuous(lm, sequences: list[Sequence], gen: dict, pad_id: int, eos_ids: set, emit) -> None:
    """All sequences go to transformers' continuous-batching manager; rows are written as answers finish.
    A sequence the manager fails is logged and left for the next run (as a failed request is with vLLM)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = GenerationConfig(max_new_tokens=gen["max_tokens"], eos_token_id=sorted(eos_ids), pad_token_id=pad_id,
                              **sampling_kwargs(gen))
    longest = max(len(s.ids) for s in sequences)
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=gen["hf_batch_size"], seed=gen["seed"],
                                         num_blocks=_cpu_cache_blocks(lm, len(sequences), longest, gen))
    hints = WorkloadHints(max_prompt_length=longest, max_generated_length=gen["max_tokens"],
                          num_requests=len(sequences))
    pending = {str(i): seq for i, seq in enumerate(sequences)}
    with lm.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                workload_hints=hints) as manager:
        for request_id, seq in pending.items():
            manager.add_request(seq.ids, request_id=request_id, max_new_tokens=gen["max_tokens"])
        while pending:
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"the continuous-batching loop stopped with {len(pending)} sequences "
                                       "unanswered (set generation.hf_engine: generate to use plain batches)")
                continue
            if not result.is_finished() or result.request_id not in pending:
                continue
            seq = pending.pop(result.request_id)
            if result.error is not None:
                log.warning("%s: continuous batching failed this sequence (%s); a re-run retries it",
                            seq.job.id, result.error)
                emit(seq, None)
            else:
                emit(seq, cut_after_eos(list(result.generated_tokens), eos_ids))


def _cpu_cache_blocks(lm, count: int, longest_prompt: int, gen: dict) -> int | None:
    """KV-cache pages for `hf_batch_size` sequences of the longest length, on CPU. On a GPU, None lets
    transformers size the cache from free memory; on CPU that sizing takes most of the RAM (a 23 GB machine
    ran out of memory), so it is given just what one batch needs."""
    if lm.device.type == "cuda":
        return None
    from transformers import ContinuousBatchingConfig
    page = ContinuousBatchingConfig.page_size
    pages_per_sequence = -(-(longest_prompt + gen["max_tokens"]) // page) + 1
    return min(count, gen["hf_batch_size"]) * pages_per_sequence


# ---------------------------------------------------------------- the backend, end to end
def generate_hf(model: str | Path, prompts_path: str | Path, out_path: str | Path, gen: dict, *,
                device: str = "auto") -> GenerationStats:
    """Answer every (prompt, sample) not yet in `out_path` with a local HF model in-process, with the engine
    `gen["hf_engine"]`; same rows and resume as the vLLM backend."""
    out_path = Path(out_path)
    n = samples_per_prompt(gen)
    prompts = load_prompts(prompts_path)
    sampling = sampling_params(gen)
    todo, writer = open_for_resume(out_path, prompts, sampling, str(model), gen["limit"], n)
    engine = gen.get("hf_engine", "generate")
    stats = GenerationStats(already_done=len(prompts[:gen["limit"]]) * n - len(todo), backend="transformers",
                            engine=engine)
    started = time.monotonic()
    try:
        if todo:  # nothing to load when an earlier run answered everything
            lm, tokenizer = load_model(model, device)
            rows = TokenRows(stats, writer, gen, sampling, str(model), tokenizer,
                             eos_token_ids(lm, tokenizer))
            answer(lm, tokenizer, todo, gen, rows.add,
                                 f"generate {out_path.name} (transformers {engine})")
    finally:
        writer.close()
    stats.seconds = time.monotonic() - started
    stats.tokens_per_s = stats.completion_tokens / max(stats.seconds, 1e-9)
    stats.rows = finish_output(out_path)
    return stats


class TokenRows:
    """Turns an answer's new token ids into its output row (decoded; recorded by `RowRecorder`, as the vLLM
    backend's answers are)."""

    def __init__(self, stats: GenerationStats, writer: RowWriter, gen: dict, sampling: dict, gen_model: str,
                 tokenizer, eos_ids: set[int]):
        self.stats, self.gen, self.tokenizer, self.eos_ids = stats, gen, tokenizer, eos_ids
        self.recorder = RowRecorder(stats, writer, gen, sampling, gen_model)

    def add(self, seq, new_ids: list[int] | None) -> None:
        """`seq`: a `Sequence` (its Job and prompt token ids); None: the engine failed it."""
        if new_ids is None:
            self.stats.failures += 1
            return
        finished = bool(new_ids) and new_ids[-1] in self.eos_ids
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        text = reconstruct_text(text, None, self.gen["thinking"], self.gen["include_reasoning"])
        self.recorder.add(seq.job, text, "stop" if finished else "length", len(seq.ids), len(new_ids))
