"""Answer a prompts JSONL with a chat model: the paper's data generator (docs/recipe.md §1.4–1.5).

Two backends write the same rows with the same resume semantics:
  * `vllm` (default): `vllm serve` processes started by `eqc_utils.serving.launcher`, queried by an
    async OpenAI-compatible client (`generate`, in `openai_client`), round-robin over the healthy endpoints;
  * `transformers` (`generate_hf`, in `hf`): a local HF model answering in-process (engines: batched
    `generate`, static cache + torch.compile, or continuous batching), for GPU machines without vLLM.
`generate_with_model(model, prompts, out, gen_params)` does either end to end; 02_teacher_data
passes the teacher, 05_qad_data the packed QAD model.

Input: the prompt JSONL of `eqc_utils.prompts` — `id`, `category`, `conversations` (or `messages`;
`role/content` or `from/value`), `reasoning`, `source`. Assistant turns are dropped, empty turns
skipped, at least one user turn required.

Output: one JSON object per line, the prompt row's own keys kept, plus
  id                 the prompt's id for its first sample, `<prompt id>#s<k>` for sample k ≥ 1
                     (`generation.n` samples per prompt; files made with n = 1 stay valid as they are)
  prompt_id, sample  the prompt's id and k: every sample of a prompt shares `prompt_id`, so a split by
                     prompt keeps them on one side (`prompt_id_of(row)` also reads rows made before these keys)
  conversations      sent messages + {"role": "assistant", "content": text}
  response           text (the assistant content, reasoning re-joined as `<think>…</think>` when the
                     server split it off and `include_reasoning` is on)
  finish_reason      "stop" or "length" (truncated rows are kept only with `keep_truncated`)
  prompt_tokens, completion_tokens   as counted by the server (or tokenizer)
  gen_model          the model that answered (path or name)
  sampling           the sampling parameters sent
Rows are appended and flushed one by one to `<out>.partial.jsonl`; the finished file is renamed to
`<out>` only when a run ends, so a later stage never reads a half-written file. A re-run skips the
(prompt, sample) pairs already answered with the same messages, sampling and model; rows made otherwise (or
repeating an id) are regenerated, after the earlier file is kept as `<out>.stale-<YYYYmmdd-HHMMSS>` and the
changed settings are logged. Lowering `limit` or `n` keeps the rows already made. Requests that still
fail after all retries go to `<out stem>.failures.jsonl` with the error (that file describes the latest
run; a re-run retries them).
"""
from __future__ import annotations

from pathlib import Path

from eqc_utils.generation.hf import generate_hf
from eqc_utils.generation.openai_client import generate, generate_async
from eqc_utils.generation.rows import (GenerationStats, Job, RowRecorder, finish_output, load_prompts, output_row,
                                       partial_path, prompt_id_of, reconstruct_text, request_messages, sample_id,
                                       samples_per_prompt, sampling_params, stage2_settings)

__all__ = ["GenerationStats", "Job", "RowRecorder", "finish_output", "generate", "generate_async", "generate_hf",
           "generate_with_model", "load_prompts", "output_row", "partial_path", "prompt_id_of", "reconstruct_text",
           "request_messages", "sample_id", "samples_per_prompt", "sampling_params", "stage2_settings"]


def generate_with_model(model: str | Path, prompts_path: str | Path, out_path: str | Path, gen: dict, *,
                        device: str = "auto", log_dir: str | Path | None = None,
                        served_name: str = "teacher") -> GenerationStats:
    """Serve `model` (a local HF folder or hub id) and answer `prompts_path` into `out_path`, with
    the backend chosen by `gen["backend"]`. Resumes what an earlier run left."""
    if gen["backend"] == "transformers":
        return generate_hf(model, prompts_path, out_path, gen, device=device)
    from eqc_utils.serving.launcher import VLLMServers
    with VLLMServers(model, n=gen["n_servers"], served_name=served_name, extra_args=gen["vllm_args"],
                     startup_timeout=gen["startup_timeout"], log_dir=log_dir, device=device,
                     seeded_requests=gen["seed"] is not None) as servers:
        return generate(prompts_path, out_path, servers.base_urls, gen, served_name=served_name, gen_model=str(model),
                        check_servers=servers.check_running)
