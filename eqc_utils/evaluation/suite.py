"""Stage 09: the served models, what each is asked, and how their answers are judged.

Three servers, started one after another behind the eqc proxy (only one model loaded at a time):

    teacher   the BF16 teacher, served through the target's config with the teacher's weights: the
              reference of the relative quality gates (tiny/small)
    target    the packed QAD target alone (`eval.serve_target`): gates, and the latency baseline
    final     the shipped stack, W4 target + W4 DFlash drafter (`eval.serve_final`): gates, latency
              and acceptance (vLLM's /metrics counters)

Each server's results go to `servers/<name>.json` with a key made of its serve config, the `eval`
settings and a fingerprint of the model folders; a re-run of the stage reuses a result whose key
still matches (an interrupted run resumes at the server it stopped in).

    plan = suite.serve_plan(E, teacher_dir)
    results = {name: suite.run_server(name, spec, E, out_dir, latency_prompts, tokenizer) for name, spec in plan.items()}
    verdicts = suite.judge(results, E)
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

from eqc_utils import io
from eqc_utils.evaluation import acceptance, gates, latency

SERVERS = ("teacher", "target", "final")


def serve_plan(E: Mapping, teacher_dir: str | Path | None) -> dict[str, dict]:
    """{server name: {"config", "overrides", "gates", "latency", "acceptance"}} in the order they run."""
    common = dict(E["serve_overrides"])
    plan = {}
    if E["teacher_gates"] and E["gates"]:
        if teacher_dir is None:
            raise ValueError("eval.teacher_gates is on but no teacher folder was given")
        plan["teacher"] = {"config": E["serve_target"],
                           "overrides": {**common, "model": str(teacher_dir), "served_model_name": "teacher",
                                         "quant": None, "speculative_config": None,
                                         "vllm_args.dtype": E["teacher_dtype"]},
                           "gates": True, "latency": False, "acceptance": False}
    plan["target"] = {"config": E["serve_target"], "overrides": common, "gates": bool(E["gates"]),
                      "latency": True, "acceptance": False}
    plan["final"] = {"config": E["serve_final"], "overrides": common, "gates": bool(E["gates"]),
                     "latency": True, "acceptance": True}
    return plan


def folder_fingerprint(path: str | Path | None) -> list:
    """(name, size, mtime) of every file of a model folder: a rebuilt model gets a new fingerprint."""
    if not path or not Path(path).is_dir():
        return [str(path)]
    return sorted((p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in Path(path).rglob("*") if p.is_file())


def result_key(spec: Mapping, E: Mapping) -> str:
    from eqc_utils.serving.config import load_serve_config
    config = load_serve_config(spec["config"], spec["overrides"])
    drafter = (config["speculative_config"] or {}).get("model")
    blob = {"config": config.values, "spec": spec, "eval": E,
            "model": folder_fingerprint(config.model), "drafter": folder_fingerprint(drafter)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_server(name: str, spec: Mapping, E: Mapping, out_dir: str | Path, latency_prompts: Mapping,
               tokenizer=None) -> dict:
    """Start one server, run what the plan asks of it, stop it; the result is saved and returned.
    A saved result with the same key is returned without starting anything."""
    from eqc_utils.serving.proxy import ProxyProcess

    out_dir = Path(out_dir)
    result_path = out_dir / "servers" / f"{name}.json"
    key = result_key(spec, E)
    if result_path.exists():
        saved = io.read_json(result_path)
        if saved.get("key") == key:
            print(f"{name}: results of an identical earlier run reused ({result_path})")
            return saved
    result = {"name": name, "key": key, "config": str(spec["config"]), "overrides": dict(spec["overrides"])}
    with ProxyProcess(spec["config"], overrides=spec["overrides"], log_path=out_dir / "logs" / f"proxy_{name}.log",
                      ready_timeout=E["startup_timeout"]) as proxy:
        if spec["gates"]:
            result["gates"] = _gates(proxy.url, name, E, out_dir)
        if spec["latency"]:
            result["latency"] = latency.measure_server(proxy.url, latency_prompts)
        if spec["acceptance"]:
            result["acceptance"] = _acceptance(proxy.url, E, tokenizer)
    io.write_json(result_path, result)
    return result


def run_side_by_side(plan: Mapping[str, Mapping], E: Mapping, out_dir: str | Path, latency_prompts: Mapping,
                     tokenizer=None) -> dict[str, dict]:
    """Target and final stack served at the same time (`eval.latency_side_by_side`): gates on each in
    turn, then latency request by request in alternation (`latency.measure_alternating`), so that both
    see the same background load; acceptance on the final stack. Saved per server as `run_server`
    saves, and reused while both keys match."""
    from contextlib import ExitStack
    from eqc_utils.serving.proxy import ProxyProcess

    out_dir = Path(out_dir)
    names = ("target", "final")
    keys = {name: result_key(plan[name], {**E, "side_by_side": True}) for name in names}
    saved = {name: out_dir / "servers" / f"{name}.json" for name in names}
    if all(saved[n].exists() and io.read_json(saved[n]).get("key") == keys[n] for n in names):
        print("target, final: results of an identical earlier run reused")
        return {name: io.read_json(saved[name]) for name in names}
    results = {name: {"name": name, "key": keys[name], "config": str(plan[name]["config"]),
                      "overrides": dict(plan[name]["overrides"]), "side_by_side": True} for name in names}
    with ExitStack() as stack:
        proxies = {name: stack.enter_context(ProxyProcess(
            plan[name]["config"], overrides=plan[name]["overrides"], log_path=out_dir / "logs" / f"proxy_{name}.log",
            ready_timeout=E["startup_timeout"])) for name in names}
        for name in names:
            if plan[name]["gates"]:
                results[name]["gates"] = _gates(proxies[name].url, name, E, out_dir)
        timings = latency.measure_alternating({n: proxies[n].url for n in names}, latency_prompts)
        for name in names:
            results[name]["latency"] = timings[name]
        results["final"]["acceptance"] = _acceptance(proxies["final"].url, E, tokenizer)
    for name in names:
        io.write_json(saved[name], results[name])
    return results


def _gates(url: str, name: str, E: Mapping, out_dir: Path) -> dict:
    return gates.run_gates(url, tasks=E["gates"], limit=E["gate_limit"], out_dir=out_dir / "gates" / name,
                           source=E["gate_source"], mmlu_pro_file=E["mmlu_pro_file"], max_gen_toks=E["max_gen_toks"],
                           num_concurrent=E["num_concurrent"], seed=E["gate_seed"])


def _acceptance(url: str, E: Mapping, tokenizer) -> dict:
    return acceptance.mean_acceptance_length(url, datasets=E["acceptance_datasets"], n_prompts=E["acceptance_prompts"],
                                             max_tokens=E["acceptance_max_tokens"], tokenizer=tokenizer,
                                             context_tokens=E["acceptance_context_tokens"])


def run_reference(E: Mapping, out_dir: str | Path, *, teacher_dir: str | Path | None, target_dir: str | Path,
                  drafter_dir: str | Path, tokenizer, latency_prompts: Mapping, stops: set[int], device: str,
                  precision: str) -> dict[str, dict]:
    """Everything `run_server` measures, without vLLM (`eval.backend: reference`, see
    eqc_utils.evaluation.reference): {"teacher": {"gates"}, "target": {"gates", "latency"},
    "final": {"latency", "acceptance"}}; saved to `servers/reference.json`."""
    from eqc_utils.drafter.train import load_target
    from eqc_utils.evaluation import reference

    dtype = "bfloat16" if device.startswith("cuda") and precision == "bf16" else "float32"
    results: dict[str, dict] = {"target": {"backend": reference.BACKEND}, "final": {"backend": reference.BACKEND}}
    if E["gates"]:
        if E["teacher_gates"] and teacher_dir is not None:
            results["teacher"] = {"gates": reference.gates_hf(teacher_dir, "teacher", E, out_dir, device, dtype)}
        results["target"]["gates"] = reference.gates_hf(target_dir, "target", E, out_dir, device, dtype)
    target = load_target(Path(target_dir), device, precision)
    compile_ = device.startswith("cuda")
    timings = reference.latency(target, drafter_dir, latency_prompts, compile_)
    results["target"]["latency"], results["final"]["latency"] = timings["autoregressive"], timings["speculative"]
    results["final"]["acceptance"] = reference.acceptance(target, drafter_dir, tokenizer, E, stops, compile_)
    io.write_json(Path(out_dir) / "servers" / "reference.json", results)
    return results


def latency_buckets(E: Mapping) -> tuple:
    return latency.buckets(E["latency_prompt_tokens"], E["latency_max_tokens"])


# ---------------------------------------------------------------- judging

def paired_agreement(dir_a: str | Path, dir_b: str | Path) -> dict:
    """Per gate: the share of questions two servers answered with the identical text (lm-eval's
    sample logs). Greedy speculative decoding reproduces its target, so the final stack against the
    target should agree on (nearly) every answer; a divergence can only come from near-ties that the
    verification kernels round differently."""
    out = {}
    for gate_dir in sorted(Path(dir_a, "lm_eval").glob("*")):
        answers = [_answers(gate_dir), _answers(Path(dir_b, "lm_eval", gate_dir.name))]
        shared = sorted(set(answers[0]) & set(answers[1]))
        same = sum(answers[0][k] == answers[1][k] for k in shared)
        out[gate_dir.name] = {"identical": same, "compared": len(shared),
                              "share": same / len(shared) if shared else None}
    return out


def _answers(gate_dir: Path) -> dict:
    answers = {}
    for path in sorted(gate_dir.rglob("samples_*.jsonl")):
        for row in io.read_jsonl(path):
            task = path.stem[len("samples_"):].rsplit("_", 1)[0]     # samples_<task>_<date>.jsonl
            answers[(task, row["doc_id"])] = json.dumps(row.get("resps"))
    return answers


def judge(results: Mapping[str, Mapping], E: Mapping, out_dir: str | Path | None = None) -> dict:
    """The gate verdicts of stage 09:

    * `paper` thresholds (`eval.thresholds: paper`): target and final stack against the paper's values;
    * `relative`: target ≥ `teacher_ratio` × teacher, final stack within `final_tolerance` of the
      target, each widened by `stderr_z` standard errors of the difference (tiny/small score a few
      dozen questions, where one answer moves a score by several points).
    """
    verdicts = {}
    target, final = results["target"].get("gates"), results["final"].get("gates")
    if target is None:
        return verdicts
    if E["thresholds"] == "paper":
        verdicts["target"] = gates.judge_gates(target, thresholds=gates.PAPER_THRESHOLDS)
        if final is not None:
            verdicts["final"] = gates.judge_gates(final, thresholds=gates.PAPER_THRESHOLDS)
    else:
        teacher = results.get("teacher", {}).get("gates")
        if teacher is not None:
            verdicts["target"] = gates.judge_gates(target, reference=teacher, ratio=E["teacher_ratio"],
                                                   stderr_z=E["stderr_z"])
        if final is not None:
            verdicts["final"] = gates.judge_gates(final, reference=target, tolerance=E["final_tolerance"],
                                                  stderr_z=E["stderr_z"])
    if out_dir is not None and final is not None:
        verdicts["final_vs_target_answers"] = paired_agreement(Path(out_dir) / "gates" / "final",
                                                               Path(out_dir) / "gates" / "target")
    return verdicts


def gate_table(results: Mapping[str, Mapping], verdicts: Mapping) -> list[dict]:
    """One row per (server, gate): value, stderr, n, the rule and whether it passed."""
    rows = []
    for name in SERVERS:
        scored = (verdicts.get(name) or results.get(name, {}).get("gates") or {}).get("gates", {})
        for gate, entry in scored.items():
            rows.append({"server": name, "gate": gate, "value": entry.get("value"), "stderr": entry.get("stderr"),
                         "n": entry.get("n"), "rule": entry.get("rule"), "passed": entry.get("passed")})
    return rows


def latency_table(report: Mapping) -> list[dict]:
    """Per bucket: median latency / TTFT / tokens per second of each server and the speed-up."""
    rows = []
    for bucket in report["buckets"]:
        row = {"bucket": bucket["name"], "prompt_tokens": bucket["prompt_tokens"], "new_tokens": bucket["max_tokens"]}
        for name, per_bucket in report["servers"].items():
            summary = per_bucket[bucket["name"]]
            row[f"{name} ms"] = summary.get("median_latency_ms")
            row[f"{name} ttft ms"] = summary.get("median_ttft_ms")
            row[f"{name} tok/s"] = summary.get("median_tokens_per_s")
        for name, per_bucket in report["speedup"].items():
            row[f"speedup ({name})"] = per_bucket[bucket["name"]]["latency"]
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the whole pipeline at a glance

# (stage, box title, [(metrics key, label, format)]): the numbers the overview figure shows
OVERVIEW = (
    ("01_prompts", "01 prompts", [("stage1_prompts", "stage 1", "{:.0f}"), ("stage2_prompts", "stage 2", "{:.0f}")]),
    ("02_teacher_data", "02 teacher data", [("rows", "rows", "{:.0f}"), ("tokens_per_s", "tok/s", "{:.0f}")]),
    ("03_qad_target", "03 QAD target", [("ptq_kl", "PTQ KL", "{:.3f}"), ("qad_kl", "QAD KL", "{:.3f}")]),
    ("04_pack_target", "04 W4A16 pack", [("vllm_identical", "vLLM = twin", "{}")]),
    ("05_qad_data", "05 QAD data", [("rows", "rows", "{:.0f}")]),
    ("06_drafter_pretrain", "06 drafter pretrain", [("tau_pretrain", "τ", "{:.2f}")]),
    ("07_drafter_finetune", "07 drafter finetune", [("tau_two_stage", "τ 2-stage", "{:.2f}"),
                                                    ("tau_direct", "τ direct", "{:.2f}")]),
    ("08_drafter_quant", "08 W4 drafter", [("tau_w4_gptq", "τ W4", "{:.2f}"), ("drafter_mb_w4", "MB", "{:.1f}")]),
    ("09_eval", "09 served stack", [("gates_passed", "gates", "{}"), ("speedup_overall", "speed-up", "{:.2f}×"),
                                    ("vllm_mean_tau", "τ", "{:.2f}")]),
)


def overview_steps(stage_metrics: Mapping[str, Mapping]) -> list[tuple[str, str]]:
    """(title, lines of headline numbers) per stage that has metrics, for `plots.plot_pipeline`."""
    steps = []
    for stage, title, fields in OVERVIEW:
        metrics = stage_metrics.get(stage)
        if metrics is None:
            continue
        lines = [f"{label} {_shown(metrics[key], fmt)}" for key, label, fmt in fields if metrics.get(key) is not None]
        steps.append((title, "\n".join(lines)))
    return steps


def _shown(value, fmt: str) -> str:
    if isinstance(value, bool):
        return "passed" if value else "FAILED"
    return fmt.format(value)
