"""What notebooks 06 and 07 do, as a few sentences: train a run, measure tau per checkpoint, plot.

    result = train_run("pretrain", target_dir, data_path, S.path("pretrain"), P, tokenizer, device=..., seed=...)
    table = tau_per_checkpoint(result, P, tokenizer)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eqc_utils import io
from eqc_utils.devices import resolve_device
from eqc_utils.conversation import prompt_messages, render_prompt
from eqc_utils.drafter.batched_decode import measure_acceptance_batched
from eqc_utils.drafter.data import heldout_seen_in_pretraining, split_heldout
from eqc_utils.drafter.decode import AcceptanceReport, DFlashProposer, measure_acceptance
from eqc_utils.drafter.fast_decode import UnsupportedTargetError, measure_acceptance_fast
from eqc_utils.drafter.model import load_drafter
from eqc_utils.drafter.speedup import measure_speedup
from eqc_utils.drafter.train import (TrainRun, checkpoint_meta, checkpoint_steps, load_target, read_history,
                                    train_drafter)
from eqc_utils.generation.slots import UnsupportedModelError

log = logging.getLogger(__name__)

TAU_FILE = "tau.json"
CURVE_FILE = "curve.json"
SEEN_CURVE_FILE = "seen_curve.json"


@dataclass
class RunResult:
    name: str
    target_dir: Path
    out_dir: Path
    final: Path
    heldout: list[dict]
    history: list[dict]


def stage2_params(P: dict) -> dict:
    """07's drafter settings: its fine-tune and direct runs train `finetune_steps` steps where that is set. A warm
    start needs fewer steps than pre-training, and both arms of the comparison get the same budget."""
    return P if P["finetune_steps"] is None else {**P, "max_steps": P["finetune_steps"]}


def train_run(name: str, target_dir: Path, data_path: Path, out_dir: Path, P: dict, tokenizer, *,
              device: str = "auto", seed: int = 0, init_from: Path | None = None, log=print) -> RunResult:
    """Train (or resume) one drafter run on `data_path` minus its held-out rows."""
    rows = io.read_jsonl(data_path)
    train_rows, heldout = split_heldout(rows, P["heldout_prompts"])
    run = TrainRun(name=name, target_dir=Path(target_dir), rows=train_rows, out_dir=Path(out_dir),
                   init_from=Path(init_from) if init_from else None)
    final = train_drafter(run, P, tokenizer, device=device, seed=seed, log=log)
    return RunResult(name, Path(target_dir), Path(out_dir), final, heldout, read_history(out_dir))


def check_heldout_unseen(pretrain_data: Path, finetune_data: Path, P: dict) -> None:
    """Refuse, before any fine-tuning, a stage 2 whose held-out prompts were pre-training prompts of stage 1: the
    two-stage arm would be scored on prompts it has seen and would beat the direct arm for that reason alone."""
    seen = heldout_seen_in_pretraining(full_training_rows(pretrain_data, P), io.read_jsonl(finetune_data),
                                       P["heldout_prompts"])
    if seen:
        raise ValueError(
            f"{len(seen)} of the {P['heldout_prompts']} held-out prompts of {finetune_data} (drafter.heldout_prompts) "
            f"are training prompts of the pre-training on {pretrain_data}, e.g. {', '.join(seen[:3])}: tau of the "
            f"two-stage drafter would be measured on prompts it was trained on. Make stage 2's prompts disjoint from "
            f"stage 1's (prompts.exclude_stage1_from_stage2: true) or the same set or a superset of it (with the "
            f"exclusion off, prompts.stage2_quotas at least prompts.stage1_quotas in every category), then rerun 01.")


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Chat-templated prompts (generation prompt appended) of held-out rows."""
    return [render_prompt(tokenizer, prompt_messages(r)) for r in rows]


def user_text(row: dict) -> str:
    """The last user turn of a row's prompt (for reading; prompts are sent as token ids)."""
    return next((m["content"] for m in reversed(prompt_messages(row)) if m["role"] == "user"), "")


def stop_ids(tokenizer, target_config) -> set[int]:
    ids = {tokenizer.eos_token_id, getattr(target_config, "eos_token_id", None)}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    flat = set()
    for i in ids:
        flat.update(i if isinstance(i, (list, tuple)) else [i])
    return {i for i in flat if i is not None}


def measure_drafter(drafter_dir: Path, target, prompts: list[list[int]], stops: set[int], P: dict,
                    block_size: int | None = None, fast: bool | None = None) -> AcceptanceReport:
    """tau of a saved drafter on `prompts`. `fast` (default: on CUDA) uses the static-cache decoder, compiled on
    CUDA (fast_decode: the same acceptance, exact in fp32), where the target is attention-only; other targets
    (Qwen3.5's recurrent layers) take the reference decoder."""
    device = next(target.parameters()).device
    drafter = load_drafter(drafter_dir, device=device, dtype=next(target.parameters()).dtype)
    proposer = DFlashProposer(drafter, target, block_size)
    compile = device.type == "cuda"
    if device.type == "cuda" if fast is None else fast:
        if P["eval_slots"] > 1 and P["eval_temperature"] <= 0:
            try:
                return measure_acceptance_batched(target, proposer, prompts, P["eval_max_new_tokens"], stops,
                                                  slots=P["eval_slots"], compile=compile)
            except UnsupportedModelError:
                pass
            except RuntimeError as error:   # a compile or CUDA-graph failure of this torch: the exact batch-1 path
                log.warning("drafter.eval_slots %d: the batched decoder failed (%s); measuring tau one prompt at a "
                            "time instead", P["eval_slots"], error)
        try:
            return measure_acceptance_fast(target, proposer, prompts, P["eval_max_new_tokens"], stops,
                                           temperature=P["eval_temperature"], compile=compile)
        except UnsupportedTargetError:
            pass
    return measure_acceptance(target, proposer, prompts, P["eval_max_new_tokens"], stops,
                              temperature=P["eval_temperature"])


def tau_by_category(report: AcceptanceReport, heldout: list[dict]) -> dict[str, float] | None:
    """Held-out tau per data category (the prompt rows' `category`: chat, stem, math, code), so that a held-out set
    whose mix of categories changes (other prompt quotas) can still be compared category by category. None when
    some held-out row has no category."""
    groups = [row.get("category") for row in heldout]
    return report.tau_by_group(groups) if groups and all(groups) else None


def tau_per_checkpoint(result: RunResult, P: dict, tokenizer, device: str = "auto") -> list[dict]:
    """tau on the held-out prompts for every checkpoint of a run (the last one is the final drafter).
    Written to `<run>/tau.json`; rows: step, tau, steps, tokens, acceptance_per_position, tau_by_category,
    seconds."""
    device = resolve_device(device)
    target = load_target(result.target_dir, device, P["precision"])
    prompts = prompt_ids(tokenizer, result.heldout)
    stops = stop_ids(tokenizer, target.config)
    table = []
    for step, path in checkpoint_steps(result.out_dir):
        with torch.no_grad():
            report = measure_drafter(path, target, prompts, stops, P)
        table.append({"run": result.name, "step": step, "tau": report.tau, "steps": report.steps,
                      "tokens": report.tokens, "acceptance_per_position": report.acceptance_per_position,
                      "tau_by_category": tau_by_category(report, result.heldout),
                      "seconds": round(report.seconds, 1)})
    io.write_json(result.out_dir / TAU_FILE, table)
    return table


def tau_of_drafter(drafter_dir: Path, result: RunResult, P: dict, tokenizer, device: str = "auto") -> dict:
    """tau of any drafter against a run's target on that run's held-out prompts (e.g. the pre-trained
    drafter before fine-tuning, measured against the QAD target)."""
    target = load_target(result.target_dir, resolve_device(device), P["precision"])
    with torch.no_grad():
        report = measure_drafter(drafter_dir, target, prompt_ids(tokenizer, result.heldout),
                                 stop_ids(tokenizer, target.config), P)
    return {"tau": report.tau, "steps": report.steps, "acceptance_per_position": report.acceptance_per_position,
            "tau_by_category": tau_by_category(report, result.heldout)}


def speedup_of(result: RunResult, P: dict, tokenizer, device: str = "auto") -> dict | None:
    """Wall-clock speed-up of a run's final drafter over plain greedy decoding of its target, batch 1, on the
    first `drafter.speedup_prompts` held-out prompts with `drafter.speedup_tokens` new tokens each
    (speedup.measure_speedup; compiled on CUDA). None when speedup_prompts is 0; {"skipped": why} for targets
    the static-cache decoder does not take (Qwen3.5's recurrent layers)."""
    if P["speedup_prompts"] <= 0:
        return None
    device = resolve_device(device)
    target = load_target(result.target_dir, device, P["precision"])
    drafter = load_drafter(result.final, device=device, dtype=next(target.parameters()).dtype)
    prompts = prompt_ids(tokenizer, result.heldout[:P["speedup_prompts"]])
    try:
        return measure_speedup(target, drafter, prompts, P["speedup_tokens"], stop_ids(tokenizer, target.config),
                               compile=device.startswith("cuda"), near_tie_margin=P["near_tie_margin"])
    except UnsupportedTargetError as error:
        return {"skipped": str(error)}


def learning_curve(full: RunResult, full_tau: list[dict], data_path: Path, out_root: Path, P: dict, tokenizer, *,
                   device: str = "auto", seed: int = 0, log=print) -> list[dict]:
    """tau against the number of training conversations: one more run per `drafter.curve_conversations` size
    (the first N training rows of the same file, every other setting as the full run's, trained into
    `out_root/n<N>`, resumable), each measured on the full run's held-out prompts, then the full run itself.
    Sizes not below the full run's count are skipped (and said so). The full run's point is the last row of its
    `tau_per_checkpoint` table (its final checkpoint: measured once). Rows: conversations, tau, steps (optimiser),
    acceptance_per_position; written to `out_root/curve.json`."""
    used = len(full_training_rows(data_path, P))
    table = []
    for size in sorted(set(P["curve_conversations"])):
        if size >= used:
            log(f"learning curve: {size} conversations is not fewer than the full run's {used}: skipped")
            continue
        run = train_run(f"{size} conversations", full.target_dir, data_path, Path(out_root) / f"n{size}",
                        {**P, "max_conversations": size}, tokenizer, device=device, seed=seed,
                        init_from=None, log=log)
        table.append(_curve_point(size, run, tau_of_drafter(run.final, full, P, tokenizer, device)))
    table.append({"conversations": used, "tau": full_tau[-1]["tau"], "steps": full_tau[-1]["step"],
                  "acceptance_per_position": full_tau[-1]["acceptance_per_position"]})
    io.write_json(Path(out_root) / CURVE_FILE, table)
    return table


def seen_curve(result: RunResult, tau_table: list[dict], P: dict) -> list[dict]:
    """The learning curve one run gives for free: tau of each checkpoint (measured anyway) against the conversations
    trained on by then, steps x batch_size x grad_accum x processes (past one epoch a conversation counts again).
    Rows: conversations_seen, steps, tau, acceptance_per_position; written to `<run>/seen_curve.json`."""
    meta = checkpoint_meta(result.out_dir, max(row["step"] for row in tau_table))
    per_step = P["batch_size"] * P["grad_accum"] * meta["trajectory"]["settings"]["processes"]
    table = [{"conversations_seen": row["step"] * per_step, "steps": row["step"], "tau": row["tau"],
              "acceptance_per_position": row["acceptance_per_position"]} for row in tau_table]
    io.write_json(result.out_dir / SEEN_CURVE_FILE, table)
    return table


def full_training_rows(data_path: Path, P: dict) -> list[dict]:
    """The rows a run on `data_path` trains on: the file minus its held-out rows, capped by max_conversations."""
    rows, _ = split_heldout(io.read_jsonl(data_path), P["heldout_prompts"])
    return rows[:P["max_conversations"]] if P["max_conversations"] else rows


def _curve_point(size: int, run: RunResult, report: dict) -> dict:
    return {"conversations": size, "tau": report["tau"], "steps": run.history[-1]["step"] if run.history else 0,
            "acceptance_per_position": report["acceptance_per_position"]}


def extra_seed_runs(target_dir: Path, data_path: Path, init_from: Path, folder, P: dict, tokenizer, *,
                    device: str = "auto", seed: int = 0, log=print) -> dict[str, RunResult]:
    """The two-stage (warm start from `init_from`) and direct runs again with seeds seed+1 ... seed+k-1
    (k = drafter.comparison_seeds), so that the two arms can be compared against their seed-to-seed spread.
    `folder(name)` gives each run's folder (finetune_seed<S>, direct_seed<S>). Keys: "two-stage (seed S)",
    "direct (seed S)"."""
    if P["comparison_seeds"] < 1:
        raise ValueError(f"drafter.comparison_seeds = {P['comparison_seeds']}: give at least 1 (the profile seed)")
    results = {}
    for extra in range(seed + 1, seed + P["comparison_seeds"]):
        results[f"two-stage (seed {extra})"] = train_run(f"finetune_seed{extra}", target_dir, data_path,
                                                         folder(f"finetune_seed{extra}"), P, tokenizer, device=device,
                                                         seed=extra, init_from=init_from, log=log)
        if P["run_direct"]:
            results[f"direct (seed {extra})"] = train_run(f"direct_seed{extra}", target_dir, data_path,
                                                          folder(f"direct_seed{extra}"), P, tokenizer, device=device,
                                                          seed=extra, log=log)
    return results


def compare_arms(tables: dict[str, list[dict]]) -> dict:
    """Final tau of every run of each arm ("two-stage", "direct"; a label's arm is its text before " (seed"),
    and whether two-stage beats direct beyond the seed spread: its worst run above direct's best (None unless
    both arms have at least two seeds)."""
    arms: dict[str, list[float]] = {}
    for label, table in tables.items():
        arms.setdefault(label.split(" (seed")[0], []).append(table[-1]["tau"])
    two, direct = arms.get("two-stage", []), arms.get("direct", [])
    return {"tau_two_stage_seeds": two, "tau_direct_seeds": direct,
            "two_stage_beats_direct_beyond_spread": (min(two) > max(direct)) if min(len(two), len(direct)) >= 2
            else None}


def vllm_agreement(served_target: Path, result: RunResult, P: dict, tokenizer, log_dir: Path | None = None,
                   device: str = "auto") -> dict:
    """vLLM (target `served_target` + the run's final drafter) vs the reference decoder (the run's
    target, same drafter) on the first `vllm_prompts` held-out prompts with the same token budget.
    Speculative outputs must equal plain vLLM decoding up to near-ties (`passed`, `tally`, `summary`:
    see `drafter.serve_check.vllm_dflash_check`); adds `reference_tau` and `relative_gap`."""
    from eqc_utils.drafter.serve_check import vllm_dflash_check

    rows = result.heldout[:P["vllm_prompts"]]
    prompts = prompt_ids(tokenizer, rows)
    block = json_block_size(result.final)
    check = vllm_dflash_check(served_target, result.final, prompts, P["eval_max_new_tokens"], block,
                              P["vllm_args"], near_tie_margin=P["near_tie_margin"], log_dir=log_dir, device=device,
                              labels=[user_text(r)[:300] for r in rows])
    target = load_target(result.target_dir, resolve_device(device), P["precision"])
    with torch.no_grad():
        reference = measure_drafter(result.final, target, prompts, stop_ids(tokenizer, target.config), P)
    check["reference_tau"] = reference.tau
    if check["vllm_tau"]:
        check["relative_gap"] = (check["vllm_tau"] - reference.tau) / reference.tau
    return check


def json_block_size(drafter_dir: Path) -> int:
    return int(io.read_json(Path(drafter_dir) / "config.json")["block_size"])


def main(argv=None) -> None:
    """One process of a data-parallel drafter run, as a cluster job starts it:

        accelerate launch --num_processes 8 -m eqc_utils.drafter.runs --profile paper --name pretrain \\
            --target TARGET --data teacher.jsonl --out runs/paper/06_drafter_pretrain/pretrain
    """
    import argparse
    import json

    from transformers import AutoTokenizer

    from eqc_utils.params import load_params

    ap = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--overrides", default="{}", help="JSON mapping of dotted params keys to values")
    ap.add_argument("--name", required=True, help="pretrain, finetune or direct")
    ap.add_argument("--target", required=True, help="folder of the frozen target")
    ap.add_argument("--data", required=True, help="training conversations (JSONL)")
    ap.add_argument("--out", required=True, help="run folder (checkpoints/, drafter/, history.jsonl)")
    ap.add_argument("--init-from", default=None, help="warm start from this drafter folder")
    args = ap.parse_args(argv)
    params = load_params(args.profile, json.loads(args.overrides))
    train_run(args.name, Path(args.target), Path(args.data), Path(args.out), params["drafter"],
              AutoTokenizer.from_pretrained(args.target), device=params["device"], seed=params["seed"],
              init_from=args.init_from)


if __name__ == "__main__":
    main()
