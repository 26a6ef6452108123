import json

from eqc_utils import io
from eqc_utils.headline import write_headline


def test_stages_without_local_results_keep_their_earlier_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("EQC_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("EQC_FIGURES_DIR", str(tmp_path / "figures"))
    earlier = {"profile": "small", "written": "2026-12-02 10:00:00", "machine": "1x NVIDIA H200",
               "stages": {"01_prompts": {"metrics": {"rows": 1}, "seconds": 9.0},
                          "02_teacher_data": {"metrics": {"rows": 2500}, "seconds": 228.0}}}
    io.write_json(tmp_path / "figures" / "small" / "headline.json", earlier)
    io.write_json(tmp_path / "runs" / "small" / "01_prompts" / "metrics.json", {"rows": 7})
    io.write_json(tmp_path / "runs" / "small" / "01_prompts" / ".stamp.json", {"seconds": 30.0, "machine": "2 CPU cores"})
    path = write_headline("small", ["01_prompts", "02_teacher_data", "03_qad_target"], machine="2 CPU cores")
    stages = json.loads(path.read_text())["stages"]
    assert stages["01_prompts"] == {"metrics": {"rows": 7}, "seconds": 30.0, "machine": "2 CPU cores"}
    assert stages["02_teacher_data"] == {"metrics": {"rows": 2500}, "seconds": 228.0, "machine": "1x NVIDIA H200",
                                         "kept_from": "2026-12-02 10:00:00"}
    assert "03_qad_target" not in stages
    again = json.loads(write_headline("small", ["01_prompts", "02_teacher_data"], machine="x").read_text())
    assert again["stages"]["02_teacher_data"]["kept_from"] == "2026-12-02 10:00:00"   # the first file's date stays
