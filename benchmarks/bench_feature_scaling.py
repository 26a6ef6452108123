#!/usr/bin/env python
"""Does the drafter learn faster when `fc` trains on scaled target features (drafter.scale_features)?

Two drafter runs side by side in one process, identical but for `scale_features` (same seed, data, batches,
anchors): training loss by step, and held-out tau with acceptance per block position at the end. Also prints how
uneven the target's features are (the share of their energy in the four largest of each layer's dimensions).

    # 2-core CPU, SmolLM2 teacher, tiny's drafter shape (2 layers, block 8), teacher answers from notebook 02:
    python benchmarks/bench_feature_scaling.py --data runs/tiny/02_teacher_data/teacher.jsonl --steps 120
    # one GPU, small's shape:
    python benchmarks/bench_feature_scaling.py --profile small --data runs/small/02_teacher_data/teacher.jsonl \\
        --steps 600 --device cuda

Writes benchmarks/results/feature_scaling_<device>.json (machine, versions, date, arguments, results).
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
from eqc_utils.drafter.data import build_examples, split_heldout  # noqa: E402
from eqc_utils.drafter.model import default_target_layer_ids  # noqa: E402
from eqc_utils.drafter.runs import tau_of_drafter, train_run  # noqa: E402
from eqc_utils.drafter.train import FEATURE_SCALE_EXAMPLES, feature_rms, load_target  # noqa: E402
from eqc_utils.params import load_params  # noqa: E402


def feature_unevenness(target_dir: Path, data: Path, P: dict, tokenizer, device: str) -> list[dict]:
    """Per chosen target layer: median and largest per-dimension RMS, and the top-4 dimensions' energy share."""
    target = load_target(target_dir, device, "fp32")
    layer_ids = P["target_layer_ids"] or default_target_layer_ids(target.config.num_hidden_layers, P["num_layers"])
    train_rows, _ = split_heldout(io.read_jsonl(data), P["heldout_prompts"])
    examples = build_examples(train_rows[:FEATURE_SCALE_EXAMPLES], tokenizer, P["max_length"], 2 * P["block_size"])
    rms = feature_rms(target, examples, layer_ids, device).cpu()
    hidden = target.config.hidden_size
    rows = []
    for i, layer in enumerate(layer_ids):
        part = rms[i * hidden:(i + 1) * hidden]
        energy = part.pow(2)
        rows.append({"layer": layer, "median_rms": round(float(part.median()), 3), "max_rms": round(float(part.max()), 3),
                     "top4_energy_share": round(float(energy.topk(4).values.sum() / energy.sum()), 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", help="whose drafter settings to use (params/<profile>.yaml)")
    ap.add_argument("--data", type=Path, required=True, help="teacher conversations (notebook 02's teacher.jsonl)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("runs/_bench_feature_scaling"),
                    help="scratch folder for the two runs (resumable; delete to start over)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"--data {args.data}: no such file; run notebook 02 first (python run_all.py --only 02)")
    params = load_params(args.profile)
    device = resolve_device(args.device)
    A = params["assets"]
    target_dir = assets.teacher_dir(A["teacher"], A["hub_allowed"])
    tokenizer = assets.load_tokenizer(A["tokenizer"], A["teacher"], A["hub_allowed"])
    P = {**params["drafter"], "max_steps": args.steps, "epochs": 1000, "save_every": args.steps,
         "log_every": max(1, args.steps // 24), "compile": "off" if device == "cpu" else params["drafter"]["compile"]}
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"node": platform.node(), "cpu": platform.machine(),
                          "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None},
              "versions": {"torch": torch.__version__}, "arguments": {k: str(v) for k, v in vars(args).items()},
              "features": feature_unevenness(target_dir, args.data, P, tokenizer, device), "runs": {}}
    print(json.dumps(result["features"], indent=1), flush=True)
    for scaled in (False, True):
        name = "scaled" if scaled else "plain"
        started = time.time()
        run = train_run(name, target_dir, args.data, args.work / name, {**P, "scale_features": scaled}, tokenizer,
                        device=device, seed=args.seed)
        seconds = time.time() - started
        report = tau_of_drafter(run.final, run, P, tokenizer, device=device)
        losses = [row["loss"] for row in run.history]
        tail = losses[-max(1, len(losses) // 4):]
        result["runs"][name] = {"train_seconds": round(seconds, 1), "loss_by_step": {r["step"]: round(r["loss"], 4)
                                                                                   for r in run.history},
                                "accuracy_last": round(run.history[-1]["accuracy"], 4),
                                "loss_last_quarter": round(sum(tail) / len(tail), 4),
                                "heldout_tau": round(report["tau"], 4),
                                "acceptance_per_position": [round(a, 4) for a in report["acceptance_per_position"]]}
        print(name, json.dumps({k: v for k, v in result["runs"][name].items() if k != "loss_by_step"}), flush=True)
    plain, scaled = result["runs"]["plain"], result["runs"]["scaled"]
    print(f"\n| run | loss (last quarter) | accuracy (last row) | held-out tau |\n|---|---:|---:|---:|")
    for name, r in (("plain features", plain), ("scaled features", scaled)):
        print(f"| {name} | {r['loss_last_quarter']:.3f} | {r['accuracy_last']:.3f} | {r['heldout_tau']:.3f} |")
    out = args.out or Path(__file__).resolve().parent / "results" / f"feature_scaling_{device.split(':')[0]}.json"
    io.write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
