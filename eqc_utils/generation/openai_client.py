"""The vLLM backend's client: an async OpenAI-compatible client over one or more `vllm serve` endpoints,
round-robin over the healthy ones, retries with backoff, failures logged per request."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Callable

from eqc_utils.generation.rows import (GenerationStats, Job, RowRecorder, failures_path, finish_output,
                                       load_prompts, open_for_resume, reconstruct_text, sample_seed,
                                       samples_per_prompt, sampling_params)

log = logging.getLogger(__name__)


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
        # the exponent is capped: a dead server collects thousands of strikes and 2.0 ** 1024 overflows
        pause = min(self.backoff * 2.0 ** min(self.strikes[url] - 1, 60), self.max_backoff)
        self.down_until[url] = time.monotonic() + pause

    def worked(self, url: str) -> None:
        self.strikes[url] = 0
        self.down_until[url] = 0.0


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
                         served_name: str = "teacher", gen_model: str | None = None,
                         check_servers: Callable[[], None] | None = None) -> GenerationStats:
    """Answer every (prompt, sample) not yet in `out_path` through the OpenAI-compatible `base_urls`: one
    request per sample (vLLM's prefix cache shares the prompt's work between them). `check_servers`, called
    after each refused connection, may raise to end the run (e.g. `VLLMServers.check_running` once every
    server process has exited); the rows answered so far stay in the partial file for a resume."""
    import openai
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    n = samples_per_prompt(gen)
    prompts = load_prompts(prompts_path)
    sampling = sampling_params(gen)
    gen_model = gen_model or served_name
    todo, writer = open_for_resume(out_path, prompts, sampling, gen_model, gen["limit"], n)
    stats = GenerationStats(already_done=len(prompts[:gen["limit"]]) * n - len(todo), backend="vllm")
    recorder = RowRecorder(stats, writer, gen, sampling, gen_model)
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
                    if check_servers is not None:
                        check_servers()
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
            recorder.add(job, text, choice.finish_reason or "stop",
                         getattr(resp.usage, "prompt_tokens", 0), getattr(resp.usage, "completion_tokens", 0))
            return
        stats.failures += 1
        failures.write(job.id, last_error, url)

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
        workers = [asyncio.ensure_future(worker()) for _ in range(max(1, min(gen["concurrency"], len(todo))))]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for task in workers:   # one worker's error ends the run: stop the others before closing the files
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
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
             served_name: str = "teacher", gen_model: str | None = None,
             check_servers: Callable[[], None] | None = None) -> GenerationStats:
    """Blocking `generate_async`; works inside Jupyter (whose event loop is already running) by
    running the client loop in a helper thread, cancelled cleanly on Ctrl-C."""
    coro = generate_async(prompts_path, out_path, base_urls, gen, served_name=served_name, gen_model=gen_model,
                          check_servers=check_servers)
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
