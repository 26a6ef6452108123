#!/usr/bin/env python
"""Drafter recipe settings side by side: what each does to learning, at the same data, seed and step count.

Each arm is one drafter run whose settings differ from the profile's only where the arm says (same seed, data,
held-out prompts). Per arm: training loss by step and the run's wall time; at the end, on every conversation of the
held-out prompts, the teacher-forced block loss and draft-token accuracy (the training objective on unseen answers:
far less noisy than tau on a few prompts), and held-out tau with acceptance per block position.

    # 2-core CPU, SmolLM2 teacher, tiny's drafter shape (2 layers, block 8), teacher answers from notebook 02;
    # default arms: plain shuffled batches vs length-grouped ones (drafter.length_grouping)
    python benchmarks/bench_drafter_recipe.py --data runs/tiny/02_teacher_data/teacher.jsonl --steps 600
    # one GPU, small's shape, compiled with per-batch widths in the grouped arm:
    python benchmarks/bench_drafter_recipe.py --profile small --data runs/small/02_teacher_data/teacher.jsonl \\
        --steps 600 --device cuda --arms "base:" "grouped:length_grouping=8;pad_multiple=256"
    # other arms: NAME:KEY=VALUE;KEY=VALUE (drafter keys), e.g. --arms "base:" "fast:lr=3e-3"

Writes benchmarks/results/drafter_recipe_<device>.json (machine, versions, date, arguments, results).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from eqc_utils import assets, io  # noqa: E402
from eqc_utils.devices import resolve_device  # noqa: E402
from eqc_utils.drafter.data import build_examples, collate, split_heldout  # noqa: E402
from eqc_utils.drafter.model import load_drafter  # noqa: E402
from eqc_utils.drafter.runs import tau_of_drafter, tau_per_checkpoint, train_run  # noqa: E402
from eqc_utils.drafter.train import drafter_step, load_target  # noqa: E402
from eqc_utils.generation.rows import prompt_id_of  # noqa: E402
from eqc_utils.params import load_params, parse_override  # noqa: E402


@torch.no_grad()
def heldout_objective(drafter_dir: Path, target_dir: Path, data: Path, P: dict, tokenizer, device: str) -> dict:
    """Teacher-forced block loss and accuracy against the answers' tokens on every conversation of the held-out
    prompts (fixed anchors), whatever labels the arm trained on, and agreement with the target's greedy token there
    (what greedy verification accepts)."""
    rows = io.read_jsonl(data)
    _, heldout = split_heldout(rows, P["heldout_prompts"])
    chosen = {prompt_id_of(r) for r in heldout}
    examples = build_examples([r for r in rows if prompt_id_of(r) in chosen], tokenizer, P["max_length"],
                              2 * P["block_size"])
    target = load_target(target_dir, device, "fp32")
    drafter = load_drafter(drafter_dir, device).eval()
    loss = correct = agree = scored = 0.0
    for start in range(0, len(examples), 4):
        batch = collate(examples[start:start + 4], device)
        step_loss, stats = drafter_step(drafter, target, batch, {**P, "fused_loss": False, "labels": "data"},
                                        torch.Generator().manual_seed(start))
        _, greedy = drafter_step(drafter, target, batch, {**P, "fused_loss": False, "labels": "target_greedy"},
                                 torch.Generator().manual_seed(start))
        if stats["scored"]:
            loss += float(step_loss) * stats["scored"]
            correct += float(stats["accuracy"]) * stats["scored"]
            agree += float(greedy["accuracy"]) * stats["scored"]
            scored += stats["scored"]
    return {"conversations": len(examples), "loss": round(loss / scored, 4), "accuracy": round(correct / scored, 4),
            "greedy_agreement": round(agree / scored, 4)}


def parse_arm(text: str) -> tuple[str, dict]:
    name, _, settings = text.partition(":")
    changes = {}
    for item in filter(None, settings.split(";")):
        key, value = parse_override(f"drafter.{item}")
        if isinstance(value, str):      # YAML reads 1e-3 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        changes[key.split(".", 1)[1]] = value
    return name, changes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", help="whose drafter settings to use (params/<profile>.yaml)")
    ap.add_argument("--data", type=Path, required=True, help="teacher conversations (notebook 02's teacher.jsonl)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=16, help="held-out prompts (all their answers are evaluated)")
    ap.add_argument("--arms", nargs="+", default=["base:", "grouped:length_grouping=8"],
                    help="NAME:KEY=VALUE;... drafter settings per arm")
    ap.add_argument("--work", type=Path, default=Path("runs/_bench_drafter_recipe"),
                    help="scratch folder for the runs (resumable; delete to start over)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tau-every", type=int, default=0,
                    help="also save a checkpoint every this many steps and measure held-out tau on each (tau vs steps)")
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"--data {args.data}: no such file; run notebook 02 first (python run_all.py --only 02)")
    params = load_params(args.profile)
    device = resolve_device(args.device)
    A = params["assets"]
    target_dir = assets.teacher_dir(A["teacher"], A["hub_allowed"])
    tokenizer = assets.load_tokenizer(A["tokenizer"], A["teacher"], A["hub_allowed"])
    P = {**params["drafter"], "max_steps": args.steps, "epochs": 1000, "save_every": args.tau_every or args.steps,
         "log_every": max(1, args.steps // 24),
         "heldout_prompts": args.heldout, "compile": "off" if device == "cpu" else params["drafter"]["compile"]}
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"node": platform.node(), "cpu": platform.machine(),
                          "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None},
              "versions": {"torch": torch.__version__}, "arguments": {k: str(v) for k, v in vars(args).items()},
              "runs": {}}
    for name, changes in map(parse_arm, args.arms):
        arm_P = {**P, **changes}
        started = time.time()
        run = train_run(name, target_dir, args.data, args.work / name, arm_P, tokenizer, device=device, seed=args.seed)
        seconds = time.time() - started
        report = tau_of_drafter(run.final, run, arm_P, tokenizer, device=device)
        by_step = tau_per_checkpoint(run, arm_P, tokenizer, device=device) if args.tau_every else []
        losses = [row["loss"] for row in run.history]
        tail = losses[-max(1, len(losses) // 4):]
        result["runs"][name] = {"settings": changes, "train_seconds": round(seconds, 1),
                                "loss_by_step": {r["step"]: round(r["loss"], 4) for r in run.history},
                                "loss_last_quarter": round(sum(tail) / len(tail), 4),
                                "heldout": heldout_objective(run.final, target_dir, args.data, arm_P, tokenizer, device),
                                "heldout_tau": round(report["tau"], 4),
                                "heldout_tau_by_category": report["tau_by_category"],
                                "acceptance_per_position": [round(a, 4) for a in report["acceptance_per_position"]]}
        if by_step:
            result["runs"][name]["tau_by_step"] = {r["step"]: round(r["tau"], 4) for r in by_step}
            result["runs"][name]["accept_pos1_by_step"] = {r["step"]: round(r["acceptance_per_position"][0], 4)
                                                           for r in by_step}
        print(name, json.dumps({k: v for k, v in result["runs"][name].items() if k != "loss_by_step"}), flush=True)
    print("\n| arm | training loss (last quarter) | held-out loss | held-out accuracy | greedy agreement | held-out tau |"
          "\n|---|---:|---:|---:|---:|---:|")
    for name, r in result["runs"].items():
        print(f"| {name} | {r['loss_last_quarter']:.3f} | {r['heldout']['loss']:.3f} | {r['heldout']['accuracy']:.3f} "
              f"| {r['heldout']['greedy_agreement']:.3f} | {r['heldout_tau']:.3f} |")
    out = args.out or Path(__file__).resolve().parent / "results" / f"drafter_recipe_{device.split(':')[0]}.json"
    io.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
