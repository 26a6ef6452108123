"""Notebooks 06 and 07 executed with papermill on a micro profile: a chain micro target stands in for
the teacher and for the QAD twin, its own greedy texts for the teacher and QAD data."""
import json
import shutil

import pytest

from eqc_utils import io
from eqc_utils.paths import REPO_ROOT
from tests._fixtures_drafter import chain_target_dir, load_causal_lm, micro_llama_dir, tokenizer  # noqa: F401
from tests.test_drafter_train import corpus  # noqa: F401


@pytest.mark.slow
def test_notebooks_06_and_07_train_measure_and_compare(chain_target_dir, corpus, tmp_path, monkeypatch):
    import papermill as pm

    path, _ = corpus
    for var, sub in (("EQC_RUNS_DIR", "runs"), ("EQC_FIGURES_DIR", "figures"), ("EQC_REPORTS_DIR", "reports")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    runs = tmp_path / "runs" / "tiny"
    (runs / "02_teacher_data").mkdir(parents=True)
    shutil.copy(path, runs / "02_teacher_data" / "teacher.jsonl")
    (runs / "05_qad_data").mkdir(parents=True)
    shutil.copy(path, runs / "05_qad_data" / "qad.jsonl")
    shutil.copytree(chain_target_dir, runs / "04_pack_target" / "target_dense")
    overrides = {"assets.teacher": str(chain_target_dir), "drafter.num_layers": 1, "drafter.max_steps": 3,
                 "drafter.save_every": 2, "drafter.log_every": 1, "drafter.heldout_prompts": 1,
                 "drafter.eval_max_new_tokens": 12, "drafter.vllm_check": False, "device": "cpu"}
    for name in ("06_drafter_pretrain", "07_drafter_finetune"):
        pm.execute_notebook(str(REPO_ROOT / "notebooks" / f"{name}.ipynb"), str(tmp_path / f"{name}.ipynb"),
                            parameters={"profile": "tiny", "overrides": overrides}, kernel_name="python3",
                            cwd=str(REPO_ROOT), progress_bar=False)
    tau = io.read_json(runs / "06_drafter_pretrain" / "pretrain" / "tau.json")
    assert [row["step"] for row in tau] == [2, 3] and all(1.0 <= row["tau"] <= 8.0 for row in tau)
    summary = io.read_json(runs / "07_drafter_finetune" / "tau_summary.json")
    assert [row["drafter"] for row in summary] == ["pretrained only", "two-stage", "direct"]
    metrics = json.loads((runs / "07_drafter_finetune" / "metrics.json").read_text())
    assert metrics["tau_two_stage"] >= 1.0 and metrics["tau_direct"] >= 1.0
    assert (tmp_path / "figures" / "tiny" / "drafter_two_stage_vs_direct.png").exists()
    assert json.loads((runs / "07_drafter_finetune" / "finetune" / "drafter" / "config.json").read_text())[
        "architectures"] == ["DFlashDraftModel"]
