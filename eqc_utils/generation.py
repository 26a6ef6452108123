"""Answer a prompts JSONL with a chat model: the paper's data generator (docs/recipe.md §1.4–1.5).

Two backends write the same rows with the same resume semantics:
  * `vllm` (default): `vllm serve` processes started by `eqc_utils.serving.launcher`, queried by an
    async OpenAI-compatible client (`generate`), round-robin over the healthy endpoints;
  * `transformers` (`generate_hf`): a local HF model answering in-process (engines in
    `eqc_utils.generation_hf`: batched `generate`, static cache + torch.compile, or continuous batching), for
    GPU machines without vLLM.
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

import asyncio
import json
import logging
import os
import random
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple

from eqc_utils.io import describe_changes, read_jsonl, stale_name, write_jsonl

log = logging.getLogger(__name__)

ROLE_ALIASES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "assistant": "assistant"}


# ---------------------------------------------------------------- rows in, rows out
def request_messages(row: dict, where: str) -> list[dict]:
    """The messages to send for one prompt row (docs/recipe.md §1.5 step 2); ValueError names `where`."""
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list):
        raise ValueError(f"{where}: prompt row has no 'conversations' (or 'messages') list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError(f"{where}: a conversation turn is not an object: {turn!r}")
        role = ROLE_ALIASES.get(turn.get("role", turn.get("from")))
        content = turn.get("content", turn.get("value"))
        if role is None:
            raise ValueError(f"{where}: unknown role in turn {turn!r}")
        if role == "assistant" or not isinstance(content, str) or not content.strip():
            continue
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: prompt has no non-empty user turn")
    return messages


def load_prompts(path: str | Path, limit: int | None = None) -> list[tuple[dict, list[dict]]]:
    """(row, messages) pairs, first occurrence of each id kept; malformed lines raise naming the line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompts file {path} does not exist (made by stage 01_prompts)")
    rows, seen, duplicates = [], set(), 0
    for lineno, row in _rows_with_lines(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict) or not isinstance(row.get("id"), (str, int)):
            raise ValueError(f"{where}: prompt row needs an 'id' (string)")
        if row["id"] in seen:
            duplicates += 1
            continue
        seen.add(row["id"])
        rows.append((row, request_messages(row, where)))
        if limit is not None and len(rows) >= limit:
            break
    if duplicates:
        log.warning("%s: %d rows repeat an earlier id and were skipped", path, duplicates)
    return rows


def _rows_with_lines(path: Path) -> Iterable[tuple[int, dict]]:
    """Like io.read_jsonl (same error on a malformed line) but keeps the line numbers."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); fix or delete that line") from err


def reconstruct_text(content: str | None, reasoning: str | None, thinking: str, include_reasoning: bool) -> str:
    """The stored response (docs/recipe.md §1.5 step 8): re-join server-split reasoning as <think>…</think>."""
    content = (content or "").strip()
    reasoning = (reasoning or "").strip()
    if thinking == "off":
        return content
    if reasoning and include_reasoning:
        return f"<think>\n{reasoning}\n</think>\n\n{content}".strip()
    if not content:
        return reasoning
    if thinking == "on" and include_reasoning and not content.startswith("<think>"):
        return "<think>\n" + content
    return content


def sampling_params(gen: dict) -> dict:
    """Sampling settings from params' `generation` section, as recorded in every output row."""
    out = {"max_tokens": gen["max_tokens"], "temperature": gen["temperature"], "top_p": gen["top_p"]}
    if gen["top_k"] > 0:
        out["top_k"] = gen["top_k"]
    if gen["seed"] is not None:
        out["seed"] = gen["seed"]
    if gen["thinking"] != "auto":
        out["enable_thinking"] = gen["thinking"] == "on"
    return out


def output_row(row: dict, messages: list[dict], text: str, *, finish_reason: str, prompt_tokens: int,
               completion_tokens: int, gen_model: str, sampling: dict, sample: int = 0) -> dict:
    """The row written for sample `sample` of the prompt `row`."""
    out = {k: v for k, v in row.items() if k not in ("conversations", "messages")}
    out.update(id=sample_id(row["id"], sample), prompt_id=row["id"], sample=sample,
               conversations=messages + [{"role": "assistant", "content": text}], response=text,
               finish_reason=finish_reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
               gen_model=gen_model, sampling=sampling)
    return out


# ---------------------------------------------------------------- several samples per prompt
class Job(NamedTuple):
    """One answer to make: sample `sample` of the prompt `row`, asking `messages`."""
    row: dict
    messages: list[dict]
    sample: int

    @property
    def id(self):
        return sample_id(self.row["id"], self.sample)


def sample_id(prompt_id, sample: int):
    """Row id of sample k of a prompt: the prompt's own id for k = 0, so files made before `generation.n`
    existed (one row per prompt) are still complete for n = 1; `<prompt id>#s<k>` after."""
    return prompt_id if sample == 0 else f"{prompt_id}#s{sample}"


def prompt_id_of(row: dict):
    """The prompt an output row answers (rows made before `prompt_id` existed: their id)."""
    return row.get("prompt_id", row.get("id"))


def samples_per_prompt(gen: dict) -> int:
    """`generation.n`, checked: n ≥ 1, and n > 1 only with sampling (greedy answers would be n copies)."""
    n = gen.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"generation.n must be a positive integer, got {n!r}")
    if n > 1 and gen["temperature"] <= 0:
        raise ValueError(f"generation.n={n} with temperature {gen['temperature']} (greedy) would write {n} "
                         f"identical answers per prompt; set n: 1 or a temperature > 0")
    return n


def sample_seed(gen: dict, sample: int) -> int | None:
    """The seed sent for sample k: seed + k, so a fixed seed still gives n different answers."""
    return None if gen["seed"] is None else gen["seed"] + sample


# ---------------------------------------------------------------- resumable output files
def partial_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + ".partial.jsonl")


def failures_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + ".failures.jsonl")


def open_for_resume(out_path: Path, prompts: list[tuple[dict, list[dict]]], sampling: dict,
                    gen_model: str, limit: int | None = None, n: int = 1) -> tuple[list[Job], "RowWriter"]:
    """The answers still to make (samples 0..n-1 of the first `limit` of `prompts`, prompt by prompt), and
    a writer appending to the partial file. A finished output of an earlier run becomes the partial file
    again (a rename: nothing copied, nothing lost).

    An earlier row counts as done only if it answered the same messages with the same sampling and
    model. Rows of prompts beyond `limit`, or of samples beyond `n`, that are done stay in the output (a
    lower limit or n only stops generating more). Other rows (prompts, sampling or model changed since; a
    repeated id) are not kept: the earlier file is first renamed `<out>.stale-<YYYYmmdd-HHMMSS>` and the
    changed settings are logged, so nothing generated is ever lost. A model retrained in place under the
    same path is not detected: move the output aside to regenerate it."""
    work = partial_path(out_path)
    if out_path.exists():
        if work.exists():
            raise FileExistsError(f"both {out_path} and {work} exist; keep the one you trust and delete the other")
        os.replace(out_path, work)
    done = set()
    if work.exists():
        _drop_torn_last_line(work)
        earlier = read_jsonl(work)
        kept, reasons = _still_valid(earlier, {row["id"]: msgs for row, msgs in prompts}, sampling, gen_model)
        if len(kept) < len(earlier):
            stale = stale_name(out_path)
            shutil.copy2(work, stale)
            write_jsonl(work, kept)
            log.warning("%s: %d of %d earlier rows are not kept (%s); all earlier rows are in %s",
                        out_path, len(earlier) - len(kept), len(earlier), "; ".join(reasons), stale)
        done = {r["id"] for r in kept}
    todo = [Job(row, msgs, k) for row, msgs in prompts[:limit] for k in range(n)
            if sample_id(row["id"], k) not in done]
    return todo, RowWriter(work)


def _answers(r: dict):
    """The prompt id an earlier row answers, or None when its id, prompt_id and sample disagree."""
    pid, k = prompt_id_of(r), r.get("sample", 0)
    if not isinstance(pid, (str, int)) or not isinstance(k, int) or k < 0 or r.get("id") != sample_id(pid, k):
        return None
    return pid


def _still_valid(earlier: list[dict], wanted: dict, sampling: dict, gen_model: str) -> tuple[list[dict], list[str]]:
    """The earlier rows that still answer a current prompt (`wanted`: prompt id -> messages) with the current
    settings (first row per id), and why the others are not kept, naming the settings that changed."""
    kept, seen = [], set()
    other_sampling, other_models = {}, {}
    gone = changed_messages = repeated = 0
    for r in earlier:
        rid, pid = r.get("id"), _answers(r)
        if pid is None or pid not in wanted:
            gone += 1
        elif rid in seen:
            repeated += 1
        elif (r.get("conversations") or [])[:-1] != wanted[pid]:
            changed_messages += 1
        elif r.get("sampling") != sampling:
            key = json.dumps(r.get("sampling"), sort_keys=True)
            other_sampling[key] = other_sampling.get(key, 0) + 1
        elif r.get("gen_model") != gen_model:
            other_models[str(r.get("gen_model"))] = other_models.get(str(r.get("gen_model")), 0) + 1
        else:
            kept.append(r)
            seen.add(rid)
    reasons = []
    for key, n in other_sampling.items():
        old = json.loads(key)
        what = describe_changes(old, sampling) if isinstance(old, dict) else f"sampling: {key} -> ..."
        reasons.append(f"{n} made with other sampling settings ({what})")
    for model, n in other_models.items():
        reasons.append(f"{n} made by another model (gen_model: {model} -> {gen_model})")
    if changed_messages:
        reasons.append(f"{changed_messages} answered prompts whose messages have changed since")
    if gone:
        reasons.append(f"{gone} answered ids that are not in the prompts file")
    if repeated:
        reasons.append(f"{repeated} repeated an id answered earlier in the file (the first answer is kept)")
    return kept, reasons


def _drop_torn_last_line(path: Path) -> None:
    """A killed writer can leave a last line without its newline: cut it (its request is redone)."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        log.warning("%s: dropping an unfinished last line (%d bytes) left by an interrupted run", path, len(data) - cut)
        with open(path, "r+b") as f:
            f.truncate(cut)


class RowWriter:
    """Append JSON rows, one flush per row: a killed run loses only the requests in flight."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def finish_output(out_path: Path) -> int:
    """Rename the partial file to the final name; returns the number of rows."""
    work = partial_path(out_path)
    if not work.exists():
        work.write_text("")
    os.replace(work, out_path)
    return sum(1 for line in open(out_path, encoding="utf-8") if line.strip())


@dataclass
class GenerationStats:
    rows: int = 0                 # rows in the finished output (earlier runs included)
    new_rows: int = 0             # rows written by this run
    already_done: int = 0         # (prompt, sample) pairs an earlier run answered
    failures: int = 0             # requests given up on (see the failures file)
    truncated: int = 0            # new rows that hit max_tokens (kept or dropped)
    dropped_truncated: int = 0    # truncated rows not saved (keep_truncated off)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0     # completion tokens of this run per wall second
    endpoint_errors: dict = field(default_factory=dict)   # base URL -> connection errors seen
    backend: str = ""
    engine: str = ""              # transformers backend: generate, static or continuous

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- the async OpenAI client
class Endpoints:
    """Round-robin over base URLs, skipping those that refused a connection recently: a dead server
    is retried only after a cool-down that doubles with each new failure."""

    def __init__(self, base_urls: list[str], backoff: float, max_backoff: float):
        if not base_urls:
            raise ValueError("generation needs at least one base URL")
        self.urls = list(base_urls)
        self.backoff, self.max_backoff = backoff, max_backoff
        self.down_until = {u: 0.0 for u in self.urls}
        self.strikes = {u: 0 for u in self.urls}
        self.errors = {u: 0 for u in self.urls}
        self.turn = 0

    def pick(self, avoid: str | None = None) -> str:
        now = time.monotonic()
        for _ in range(len(self.urls)):
            url = self.urls[self.turn % len(self.urls)]
            self.turn += 1
            if self.down_until[url] <= now and url != avoid:
                return url
        up = [u for u in self.urls if self.down_until[u] <= now]
        return up[0] if up else min(self.urls, key=self.down_until.get)

    def any_up(self, besides: str) -> bool:
        now = time.monotonic()
        return any(self.down_until[u] <= now for u in self.urls if u != besides)

    def failed(self, url: str) -> None:
        self.errors[url] += 1
        self.strikes[url] += 1
        pause = min(self.backoff * 2 ** (self.strikes[url] - 1), self.max_backoff)
        self.down_until[url] = time.monotonic() + pause

    def worked(self, url: str) -> None:
        self.strikes[url] = 0
        self.down_until[url] = 0.0


class PermanentError(Exception):
    """A 4xx answer other than 429: retrying the same request cannot help."""


async def _ask(client, served_name: str, messages: list[dict], gen: dict, seed: int | None):
    extra_body = {}
    if gen["top_k"] > 0:
        extra_body["top_k"] = gen["top_k"]
    if gen["thinking"] != "auto":
        extra_body["chat_template_kwargs"] = {"enable_thinking": gen["thinking"] == "on"}
    kwargs = {} if seed is None else {"seed": seed}
    return await client.chat.completions.create(
        model=served_name, messages=messages, max_tokens=gen["max_tokens"], temperature=gen["temperature"],
        top_p=gen["top_p"], extra_body=extra_body or None, timeout=gen["timeout"], **kwargs)


def _classify(err: Exception) -> str:
    """'connection' (endpoint unreachable), 'retry' (timeout, 429, 5xx) or 'permanent' (other 4xx)."""
    import openai
    if isinstance(err, openai.APITimeoutError):
        return "retry"
    if isinstance(err, openai.APIConnectionError):
        return "connection"
    if isinstance(err, openai.APIStatusError):
        code = err.status_code
        return "retry" if code == 429 or code >= 500 else "permanent"
    return "permanent"


async def generate_async(prompts_path: str | Path, out_path: str | Path, base_urls: list[str], gen: dict, *,
                         served_name: str = "teacher", gen_model: str | None = None) -> GenerationStats:
    """Answer every (prompt, sample) not yet in `out_path` through the OpenAI-compatible `base_urls`: one
    request per sample (vLLM's prefix cache shares the prompt's work between them)."""
    import openai
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    n = samples_per_prompt(gen)
    prompts = load_prompts(prompts_path)
    sampling = sampling_params(gen)
    gen_model = gen_model or served_name
    todo, writer = open_for_resume(out_path, prompts, sampling, gen_model, gen["limit"], n)
    stats = GenerationStats(already_done=len(prompts[:gen["limit"]]) * n - len(todo), backend="vllm")
    endpoints = Endpoints(base_urls, gen["backoff"], gen["max_backoff"])
    clients = {u: openai.AsyncOpenAI(base_url=u, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"), max_retries=0)
               for u in base_urls}
    failures = FailureLog(failures_path(out_path))
    queue: asyncio.Queue = asyncio.Queue()
    for job in todo:
        queue.put_nowait(job)
    bar = tqdm(total=len(todo), desc=f"generate {out_path.name}", unit="row", dynamic_ncols=True)
    started = time.monotonic()

    async def answer(job: Job) -> None:
        url, last_error = None, ""
        for attempt in range(gen["max_retries"] + 1):
            url = endpoints.pick(avoid=url)
            try:
                resp = await _ask(clients[url], served_name, job.messages, gen, sample_seed(gen, job.sample))
            except Exception as err:  # noqa: BLE001 - classified below, unknown ones are permanent
                kind, last_error = _classify(err), f"{type(err).__name__}: {err}"
                if kind == "permanent":
                    break
                if kind == "connection":
                    endpoints.failed(url)
                    if endpoints.any_up(besides=url):
                        continue  # another server can take it now
                if attempt < gen["max_retries"]:
                    delay = min(gen["backoff"] * 2 ** attempt, gen["max_backoff"]) + random.uniform(0, gen["backoff"])
                    await asyncio.sleep(delay)
                continue
            endpoints.worked(url)
            choice = resp.choices[0]
            msg = choice.message
            extras = getattr(msg, "model_extra", None) or {}
            reasoning = getattr(msg, "reasoning_content", None) or getattr(msg, "reasoning", None) \
                or extras.get("reasoning_content") or extras.get("reasoning")
            text = reconstruct_text(msg.content, reasoning, gen["thinking"], gen["include_reasoning"])
            if not text:
                last_error = "empty response"
                continue
            record(job, text, choice.finish_reason or "stop",
                   getattr(resp.usage, "prompt_tokens", 0), getattr(resp.usage, "completion_tokens", 0))
            return
        stats.failures += 1
        failures.write(job.id, last_error, url)

    def record(job: Job, text, finish_reason, prompt_tokens, completion_tokens) -> None:
        stats.prompt_tokens += prompt_tokens
        stats.completion_tokens += completion_tokens
        if finish_reason == "length":
            stats.truncated += 1
            if not gen["keep_truncated"]:
                stats.dropped_truncated += 1
                return
        writer.write(output_row(job.row, job.messages, text, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
                                completion_tokens=completion_tokens, gen_model=gen_model, sampling=sampling,
                                sample=job.sample))
        stats.new_rows += 1

    async def worker() -> None:
        while True:
            try:
                job = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await answer(job)
            bar.update(1)
            bar.set_postfix(tok_s=f"{stats.completion_tokens / max(1e-9, time.monotonic() - started):.0f}",
                            failed=stats.failures, refresh=False)

    try:
        await _warn_unreachable(clients, endpoints)
        await asyncio.gather(*(worker() for _ in range(max(1, min(gen["concurrency"], len(todo))))))
    finally:
        bar.close()
        writer.close()
        failures.close()
        for client in clients.values():
            await client.close()
    stats.seconds = time.monotonic() - started
    stats.tokens_per_s = stats.completion_tokens / max(stats.seconds, 1e-9)
    stats.endpoint_errors = dict(endpoints.errors)
    stats.rows = finish_output(out_path)
    return stats


async def _warn_unreachable(clients: dict, endpoints: Endpoints) -> None:
    """List models on each endpoint first (docs/recipe.md §1.5 step 4): warn, and rest a dead one."""
    import openai
    for url, client in clients.items():
        try:
            await client.models.list(timeout=10)
        except openai.APIConnectionError as err:
            endpoints.failed(url)
            log.warning("endpoint %s is not reachable (%s); its share goes to the others", url, err)
        except openai.APIError as err:
            log.warning("endpoint %s: listing models failed (%s)", url, err)


class FailureLog:
    """`<out>.failures.jsonl`: one row per request given up on in the latest run."""

    def __init__(self, path: Path):
        self.path = path
        self.file = None
        path.unlink(missing_ok=True)

    def write(self, row_id, error: str, endpoint: str | None) -> None:
        if self.file is None:
            self.file = open(self.path, "a", encoding="utf-8")
        self.file.write(json.dumps({"id": row_id, "error": error, "endpoint": endpoint,
                                    "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def generate(prompts_path: str | Path, out_path: str | Path, base_urls: list[str], gen: dict, *,
             served_name: str = "teacher", gen_model: str | None = None) -> GenerationStats:
    """Blocking `generate_async`; works inside Jupyter (whose event loop is already running) by
    running the client loop in a helper thread, cancelled cleanly on Ctrl-C."""
    coro = generate_async(prompts_path, out_path, base_urls, gen, served_name=served_name, gen_model=gen_model)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    return _run_in_thread(coro)


def _run_in_thread(coro):
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    result: dict = {}

    def target():
        try:
            result["value"] = loop.run_until_complete(task)
        except BaseException as err:  # noqa: BLE001 - handed back to the caller's thread
            result["error"] = err
        finally:
            loop.close()

    thread = threading.Thread(target=target, name="eqc-generate", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    except BaseException:
        loop.call_soon_threadsafe(task.cancel)
        thread.join()
        raise
    if "error" in result:
        raise result["error"]
    return result["value"]


# ---------------------------------------------------------------- the transformers backend
def generate_hf(model: str | Path, prompts_path: str | Path, out_path: str | Path, gen: dict, *,
                device: str = "auto") -> GenerationStats:
    """Answer every (prompt, sample) not yet in `out_path` with a local HF model in-process, with the engine
    `gen["hf_engine"]` of `eqc_utils.generation_hf`; same rows and resume as the vLLM backend."""
    from eqc_utils import generation_hf

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
            lm, tokenizer = generation_hf.load_model(model, device)
            rows = TokenRows(stats, writer, gen, sampling, str(model), tokenizer,
                             generation_hf.eos_token_ids(lm, tokenizer))
            generation_hf.answer(lm, tokenizer, todo, gen, rows.add,
                                 f"generate {out_path.name} (transformers {engine})")
    finally:
        writer.close()
    stats.seconds = time.monotonic() - started
    stats.tokens_per_s = stats.completion_tokens / max(stats.seconds, 1e-9)
    stats.rows = finish_output(out_path)
    return stats


class TokenRows:
    """Turns an answer's new token ids into its output row: decoded, counted in the stats, written unless
    dropped (truncated with keep_truncated off; empty, which counts as a failure a re-run retries)."""

    def __init__(self, stats: GenerationStats, writer: RowWriter, gen: dict, sampling: dict, gen_model: str,
                 tokenizer, eos_ids: set[int]):
        self.stats, self.writer, self.gen = stats, writer, gen
        self.sampling, self.gen_model, self.tokenizer, self.eos_ids = sampling, gen_model, tokenizer, eos_ids

    def add(self, seq, new_ids: list[int] | None) -> None:
        """`seq`: a generation_hf.Sequence (its Job and prompt token ids); None: the engine failed it."""
        if new_ids is None:
            self.stats.failures += 1
            return
        finished = bool(new_ids) and new_ids[-1] in self.eos_ids
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        text = reconstruct_text(text, None, self.gen["thinking"], self.gen["include_reasoning"])
        job = seq.job
        self._record(output_row(job.row, job.messages, text, finish_reason="stop" if finished else "length",
                                prompt_tokens=len(seq.ids), completion_tokens=len(new_ids), gen_model=self.gen_model,
                                sampling=self.sampling, sample=job.sample))

    def _record(self, row: dict) -> None:
        stats = self.stats
        stats.prompt_tokens += row["prompt_tokens"]
        stats.completion_tokens += row["completion_tokens"]
        if row["finish_reason"] == "length":
            stats.truncated += 1
            if not self.gen["keep_truncated"]:
                stats.dropped_truncated += 1
                return
        if row["response"]:
            self.writer.write(row)
            stats.new_rows += 1
        else:
            stats.failures += 1  # empty answers are not saved (a re-run asks again), as with vLLM


# ---------------------------------------------------------------- end to end
def generate_with_model(model: str | Path, prompts_path: str | Path, out_path: str | Path, gen: dict, *,
                        device: str = "auto", log_dir: str | Path | None = None,
                        served_name: str = "teacher") -> GenerationStats:
    """Serve `model` (a local HF folder or hub id) and answer `prompts_path` into `out_path`, with
    the backend chosen by `gen["backend"]`. Resumes what an earlier run left."""
    if gen["backend"] == "transformers":
        return generate_hf(model, prompts_path, out_path, gen, device=device)
    from eqc_utils.serving.launcher import VLLMServers
    with VLLMServers(model, n=gen["n_servers"], served_name=served_name, extra_args=gen["vllm_args"],
                     startup_timeout=gen["startup_timeout"], log_dir=log_dir, device=device) as servers:
        return generate(prompts_path, out_path, servers.base_urls, gen, served_name=served_name, gen_model=str(model))
