"""Issue 7 on CPUs: drafter training launched data-parallel (`accelerate launch`, 2 CPU processes over gloo) on
a micro Llama target: the run trains, saves checkpoints, resumes after an interruption, and both ranks end with
the same weights (DDP keeps them in sync)."""
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from safetensors.torch import load_file

from eqc_utils import io
from eqc_utils.drafter.train import checkpoint_steps, read_history
from eqc_utils.params import load_params
from eqc_utils.paths import REPO_ROOT
from _micro_models import micro_llama


def _rows(n=24):
    words = "the quick brown fox jumps over the lazy dog while seven cats watch from a warm red roof".split()
    rows = []
    for i in range(n):
        answer = " ".join(words[(i + k) % len(words)] for k in range(60))
        rows.append({"id": f"r{i}", "conversations": [{"role": "system", "content": "You are a helpful assistant."},
                                                      {"role": "user", "content": f"Say words {i}."},
                                                      {"role": "assistant", "content": answer}]})
    return rows


def _launch(profile, target, data, out, tmp_path, processes=2):
    # the accelerate config a cluster user writes with `accelerate config`: data-parallel over gloo on CPUs
    config = tmp_path / "accelerate.yaml"
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
                                      "num_processes": processes, "num_machines": 1, "machine_rank": 0,
                                      "mixed_precision": "no", "use_cpu": False}))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "-m", "eqc_utils.drafter.runs", "--profile", str(profile), "--name", "pretrain",
           "--target", str(target), "--data", str(data), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_two_cpu_processes_train_save_and_resume(tmp_path):
    target = micro_llama(tmp_path / "target")
    data = tmp_path / "data.jsonl"
    io.write_jsonl(data, _rows())
    raw = load_params("tiny")
    raw["profile"] = "micro_dp"
    raw["device"] = "cpu"
    raw["drafter"].update(num_layers=1, block_size=8, num_anchors=8, max_length=128, heldout_prompts=2, epochs=1,
                          max_steps=3, batch_size=2, grad_accum=1, save_every=1, log_every=1, precision="fp32",
                          attention="sdpa", resume=True)
    profile = tmp_path / "micro_dp.yaml"
    profile.write_text(yaml.safe_dump(raw))
    out = tmp_path / "pretrain"

    first = _launch(profile, target, data, out, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "world 2" in first.stdout + first.stderr
    assert [s for s, _ in checkpoint_steps(out)] == [1, 2, 3]
    # the fp32 weights accelerate saved (the exported drafter/ is bf16)
    final_weights = load_file(out / "checkpoints" / "step-3" / "state" / "model.safetensors")
    assert (out / "checkpoints" / "step-3" / "drafter" / "config.json").exists()

    # interrupt after step 2: drop the last checkpoint and the final drafter, launch again
    shutil.rmtree(out / "checkpoints" / "step-3")
    shutil.rmtree(out / "drafter")
    second = _launch(profile, target, data, out, tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from step-2" in second.stdout + second.stderr
    assert [h["step"] for h in read_history(out)] == [1, 2, 3]
    resumed = load_file(out / "checkpoints" / "step-3" / "state" / "model.safetensors")
    # same data order and optimiser state; anchors are drawn per rank, so allow float noise only
    worst = max(float((final_weights[k] - resumed[k]).abs().max()) for k in final_weights)
    assert worst < 1e-4, worst
    assert (out / "drafter" / "config.json").exists()
