"""Issue 7 on CPUs: the paper profile's multi-process QAD launch (`accelerate launch`, one process per device)
run with 2 CPU processes over gloo on a micro Llama: the launcher works, the sharded checkpoint (accelerate
state per rank + the exported student) is saved and resumed, and 2 processes x micro-batch 1 give the same
weights as 1 process x 2 accumulation steps (same global batch)."""
import json
import re
import shutil

import pytest
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from _fixtures_quant import micro_params, teacher_rows
from _micro_models import micro_llama
from eqc_utils.quant import qad


def _student_weights(stage, step):
    folder = stage / "ckpts" / f"step-{step}" / "student"
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.slow
def test_two_cpu_processes_match_one_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("EQC_RUNS_DIR", str(tmp_path / "runs"))
    teacher = micro_llama(tmp_path / "teacher")
    params = micro_params(max_steps=2, save_every=2, eval_every=2, lr=3e-4, micro_batch_size=1, grad_accum_steps=2,
                          keep_last_ckpts=0)
    params["profile"] = "micro_mp"
    params["device"] = "cpu"
    params["assets"]["teacher"] = str(teacher)
    rows = teacher_rows(12)

    # one process, 2 accumulation steps
    single = tmp_path / "single"
    qad.prepare_qad(params, single, rows, teacher, AutoTokenizer.from_pretrained(teacher))
    qad.train_qad(params, single, teacher)

    # two processes through accelerate launch, same global batch (2 x 1); the profile travels as a YAML file
    multi = tmp_path / "runs" / "micro_mp" / qad.STAGE
    shutil.copytree(single / "data", multi / "data")
    shutil.copytree(single / "ptq_ct", multi / "ptq_ct")
    params["qad"].update(launcher="accelerate", num_processes=2)
    profile = tmp_path / "micro_mp.yaml"
    profile.write_text(yaml.safe_dump(params))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    summary = qad.run_qad(params, str(profile), {}, multi, teacher, log=lambda line: None)
    assert re.search(r"QAD: 2 process\(es\) on cpu(:0)?, 1 accumulation step\(s\) per process", (multi / "launch.log").read_text())
    assert (multi / "ckpts" / "step-2" / "state").is_dir()
    assert summary["steps"] == 2
    a, b = _student_weights(single, 2), _student_weights(multi, 2)
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst < 1e-5, f"2-process weights differ from 1-process by {worst}"

    # resume: 2 more steps from the saved step-2 state, in 2 processes
    overrides = {"qad.max_steps": 4, "qad.save_every": 2, "qad.eval_every": 2}
    params = json.loads(json.dumps(params))
    for key, value in overrides.items():
        section, name = key.split(".")
        params[section][name] = value
    gate_written = (multi / "gate.json").stat().st_mtime_ns
    summary = qad.run_qad(params, str(profile), overrides, multi, teacher, log=lambda line: None)
    train_log, eval_log = qad.read_logs(multi)
    assert [r["step"] for r in train_log] == [1, 2, 3, 4] and summary["steps"] == 4
    # a resumed run skips the start gate and the step-0 evaluation that a fresh run performs
    assert (multi / "gate.json").stat().st_mtime_ns == gate_written
    assert [r["step"] for r in eval_log] == [0, 2, 4]
