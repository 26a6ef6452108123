"""Notebooks 06 and 07 executed with papermill on a micro profile: a chain micro target stands in for
the teacher and for the QAD twin, its own greedy texts for the teacher and QAD data."""
import json
import shutil

import pytest

from eqc_utils import assets, io
from eqc_utils.drafter.data import split_heldout
from eqc_utils.drafter.decode import greedy_generate
from eqc_utils.drafter.runs import prompt_ids, stop_ids
from eqc_utils.params import load_params
from eqc_utils.paths import REPO_ROOT
from tests._fixtures_drafter import load_causal_lm, notebook_runs


@pytest.mark.slow
def test_notebooks_06_and_07_train_measure_and_compare(chain_target_dir, corpus, tmp_path, monkeypatch):
    import papermill as pm

    path, rows = corpus
    runs = notebook_runs(tmp_path, monkeypatch, path, chain_target_dir)
    (runs / "02_teacher_data").mkdir(parents=True)
    shutil.copy(path, runs / "02_teacher_data" / "teacher.jsonl")
    overrides = {"assets.teacher": str(chain_target_dir), "drafter.num_layers": 1, "drafter.max_steps": 3,
                 "drafter.finetune_steps": 4,                  # 07 trains its own number of steps
                 "drafter.save_every": 2, "drafter.log_every": 1, "drafter.heldout_prompts": 1,
                 "drafter.eval_max_new_tokens": 12, "drafter.vllm_check": False, "device": "cpu",
                 "drafter.curve_conversations": [2, 100], "drafter.comparison_seeds": 2}
    for name in ("06_drafter_pretrain", "07_drafter_finetune"):
        pm.execute_notebook(str(REPO_ROOT / "notebooks" / f"{name}.ipynb"), str(tmp_path / f"{name}.ipynb"),
                            parameters={"profile": "tiny", "overrides": overrides}, kernel_name="python3",
                            cwd=str(REPO_ROOT), progress_bar=False)
    nb06, nb07 = runs / "06_drafter_pretrain", runs / "07_drafter_finetune"
    block = json.loads((nb06 / "pretrain" / "drafter" / "config.json").read_text())["block_size"]
    assert block == 8                                   # the tiny profile's block size

    # what plain decoding emits on the held-out prompt (the chain target stands in for both targets),
    # with the notebooks' tokenizer (`assets.tokenizer: teacher`, the teacher folder's own)
    _, heldout = split_heldout(rows, 1)
    target = load_causal_lm(chain_target_dir)
    tokenizer = assets.load_tokenizer("teacher", str(chain_target_dir))
    prompts = prompt_ids(tokenizer, heldout)
    plain_tokens = sum(len(greedy_generate(target, ids, 12, stop_ids(tokenizer, target.config)).output_ids)
                       for ids in prompts)

    def check_tau_table(table, name, steps=(2, 3)):
        assert [row["step"] for row in table] == list(steps), name  # save_every 2, max_steps 3 (07: finetune_steps 4)
        for row in table:
            rates = row["acceptance_per_position"]
            assert len(rates) == block - 1 and all(a >= b for a, b in zip(rates, rates[1:])), (name, row)
            # tau = 1 + accepted / drafts; every verification step drafts all block - 1 positions
            assert row["tau"] == pytest.approx(1 + sum(rates), abs=1e-9), (name, row)
            # one held-out prompt: its category's pooled tau is the whole tau
            assert row["tau_by_category"] == {heldout[0]["category"]: pytest.approx(row["tau"])}, (name, row)
            assert all(r * row["steps"] == pytest.approx(round(r * row["steps"])) for r in rates), (name, row)
            # the decoder emits what plain decoding emits; each step commits its accepted drafts + 1,
            # the last one of a prompt overshooting the budget (or a stop) by at most block - 1
            assert row["tokens"] == plain_tokens, (name, row)
            committed = row["tau"] * row["steps"]
            assert committed == pytest.approx(round(committed)), (name, row)
            new_tokens = row["tokens"] - len(prompts)               # the prefill emits one per prompt
            assert new_tokens <= round(committed) <= new_tokens + len(prompts) * (block - 1), (name, row)

    tau = io.read_json(nb06 / "pretrain" / "tau.json")
    check_tau_table(tau, "06 pretrain")
    # the learning curve: a run on the first 2 training conversations, 100 (more than there are) skipped, and the
    # full run, whose point repeats its last tau measurement (same drafter, prompts and target)
    curve = io.read_json(nb06 / "curve" / "curve.json")
    assert [p["conversations"] for p in curve] == [2, len(rows) - 1] and [p["steps"] for p in curve] == [2, 3]
    assert curve[-1]["tau"] == pytest.approx(tau[-1]["tau"], abs=1e-9)
    assert (tmp_path / "figures" / "tiny" / "drafter_learning_curve.png").exists()
    # the one-run curve: every checkpoint's tau against the conversations trained on by then
    seen = io.read_json(nb06 / "pretrain" / "seen_curve.json")
    per_step = load_params("tiny")["drafter"]["batch_size"] * load_params("tiny")["drafter"]["grad_accum"]
    assert [(p["steps"], p["conversations_seen"]) for p in seen] == [(2, 2 * per_step), (3, 3 * per_step)]
    assert [p["tau"] for p in seen] == [row["tau"] for row in tau]
    metrics06 = json.loads((nb06 / "metrics.json").read_text())
    assert metrics06["curve_tau"] == {str(p["conversations"]): pytest.approx(p["tau"]) for p in curve}
    assert metrics06["seen_tau"] == {str(p["conversations_seen"]): pytest.approx(p["tau"]) for p in seen}
    assert metrics06["tau_pretrain"] == pytest.approx(tau[-1]["tau"], abs=1e-6)
    assert metrics06["accept_pos1"] == pytest.approx(tau[-1]["acceptance_per_position"][0], abs=1e-6)
    assert metrics06["steps"] == 3 and metrics06["heldout_prompts"] == 1
    assert metrics06["tau_by_category"] == {heldout[0]["category"]: pytest.approx(tau[-1]["tau"], abs=1e-6)}

    tables = {name: io.read_json(nb07 / name / "tau.json")
              for name in ("finetune", "direct", "finetune_seed1", "direct_seed1")}
    for name, table in tables.items():
        check_tau_table(table, f"07 {name}", steps=(2, 4))
    summary = io.read_json(nb07 / "tau_summary.json")
    assert [row["drafter"] for row in summary] == ["pretrained only", "two-stage", "direct", "two-stage (seed 1)",
                                                   "direct (seed 1)"]
    by_name = {row["drafter"]: row for row in summary}
    metrics07 = json.loads((nb07 / "metrics.json").read_text())
    for label, run, key in (("two-stage", "finetune", "tau_two_stage"), ("direct", "direct", "tau_direct")):
        assert by_name[label]["tau"] == pytest.approx(tables[run][-1]["tau"], abs=1e-9)
        assert by_name[label]["step"] == tables[run][-1]["step"] == 4
        assert metrics07[key] == pytest.approx(tables[run][-1]["tau"], abs=1e-6)
    assert metrics07["tau_two_stage_by_category"] == {heldout[0]["category"]: pytest.approx(metrics07["tau_two_stage"])}
    # 07's "pretrained only" is 06's final drafter on the same held-out prompt against the same weights
    # (the QAD twin here is a copy of the teacher): it must repeat 06's last measurement
    assert by_name["pretrained only"]["tau"] == pytest.approx(tau[-1]["tau"], abs=1e-9)
    assert metrics07["tau_pretrained_only"] == pytest.approx(tau[-1]["tau"], abs=1e-6)
    assert metrics07["vllm_tau"] is None and metrics07["reference_tau"] is None     # vllm_check off
    # the second seed: both arms again, compared against their spread
    two = [tables[n][-1]["tau"] for n in ("finetune", "finetune_seed1")]
    direct = [tables[n][-1]["tau"] for n in ("direct", "direct_seed1")]
    assert metrics07["tau_two_stage_seeds"] == pytest.approx(two) and metrics07["tau_direct_seeds"] == pytest.approx(direct)
    assert metrics07["two_stage_beats_direct_beyond_spread"] == (min(two) > max(direct))
    assert (tmp_path / "figures" / "tiny" / "drafter_two_stage_vs_direct.png").exists()
    assert json.loads((nb07 / "finetune" / "drafter" / "config.json").read_text())[
        "architectures"] == ["DFlashDraftModel"]


def test_compare_arms_needs_two_seeds_per_arm_for_a_verdict():
    from eqc_utils.drafter.runs import compare_arms
    one = {"two-stage": [{"tau": 2.0}], "direct": [{"tau": 1.5}]}
    assert compare_arms(one)["two_stage_beats_direct_beyond_spread"] is None
    two = {**one, "two-stage (seed 1)": [{"tau": 1.6}], "direct (seed 1)": [{"tau": 1.4}]}
    assert compare_arms(two) == {"tau_two_stage_seeds": [2.0, 1.6], "tau_direct_seeds": [1.5, 1.4],
                                 "two_stage_beats_direct_beyond_spread": True}
    overlap = {**two, "direct (seed 1)": [{"tau": 1.7}]}
    assert compare_arms(overlap)["two_stage_beats_direct_beyond_spread"] is False
