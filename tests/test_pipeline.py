"""run_all.py end to end on a micro profile through papermill (notebook 01): outputs, the cache skip,
the failure path and the HTML reports."""
import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import yaml

from eqc_utils.paths import NOTEBOOKS_DIR, PARAMS_DIR, REPO_ROOT


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    raw = yaml.safe_load((PARAMS_DIR / "tiny.yaml").read_text())
    raw["profile"] = "micro"
    raw["prompts"]["stage1_quotas"] = {"chat": 6, "stem": 0, "math": 2, "code": 2}
    raw["prompts"]["stage2_quotas"] = {"chat": 6, "stem": 0, "math": 2, "code": 2}
    raw["prompts"]["max_prompt_tokens"] = None  # keep every drawn prompt: counts become exact
    profile = root / "micro.yaml"
    profile.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, EQC_RUNS_DIR=str(root / "runs"), EQC_REPORTS_DIR=str(root / "reports"),
               EQC_FIGURES_DIR=str(root / "figures"))
    return {"root": root, "profile": str(profile), "env": env}


def run_all(env, *args):
    return subprocess.run([sys.executable, "run_all.py", "--profile", env["profile"], *args], cwd=REPO_ROOT,
                          env=env["env"], capture_output=True, text=True, timeout=600)


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.rows = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a":
            self.hrefs.append(attrs["href"])
        if tag == "tr" and "class" in attrs:
            self.rows.append(attrs["class"])


def parse_index(env):
    index = env["root"] / "reports" / "micro" / "index.html"
    parser = Links()
    parser.feed(index.read_text())
    return index, parser


@pytest.mark.slow
def test_run_skip_and_reports(env):
    first = run_all(env, "--only", "01")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "[01_prompts] ran in" in first.stdout
    out = env["root"] / "runs" / "micro" / "01_prompts"
    rows = [json.loads(line) for line in (out / "prompts_stage1.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and {"id", "category", "conversations", "reasoning", "source"} <= set(rows[0])
    assert yaml.safe_load((out / "params.resolved.yaml").read_text())["profile"] == "micro"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stage1_prompts"] == 10 and metrics["overlap"] == 0
    assert (env["root"] / "figures" / "micro" / "prompts.png").stat().st_size > 1000

    second = run_all(env, "--only", "01")
    assert second.returncode == 0 and "[01_prompts] skipped (up to date)" in second.stdout

    dry = run_all(env, "--only", "01", "--dry-run", "-p", "prompts.shuffle_seed=5")
    assert "would run: changed: params" in dry.stdout
    (out / "prompts_stage2.jsonl").unlink()
    dry = run_all(env, "--only", "01", "--dry-run")
    assert "would run: missing outputs: prompts_stage2.jsonl" in dry.stdout

    index, parser = parse_index(env)
    assert parser.rows == ["skipped"]
    for href in parser.hrefs:
        assert (index.parent / href).exists(), href
    assert {"01_prompts.html", "01_prompts.code.html", "01_prompts.ipynb"} <= set(parser.hrefs)
    hidden = (index.parent / "01_prompts.html").read_text()
    assert "build_prompt_sets" not in hidden and "build_prompt_sets" in (index.parent / "01_prompts.code.html").read_text()


@pytest.mark.slow
def test_failure_saves_report_names_cell_and_exits_nonzero(env):
    # a quota for a split the local sources do not have makes the notebook raise
    failed = run_all(env, "--only", "01", "-p", "prompts.stage1_quotas.stem=3")
    assert failed.returncode == 1
    assert "FAILED" in failed.stdout and "01_prompts.ipynb: cell" in failed.stdout
    assert "PromptSourceError" in failed.stdout
    index, parser = parse_index(env)
    assert parser.rows == ["failed"]
    assert (index.parent / "01_prompts.html").exists()


def test_bad_profile_fails_before_any_notebook(env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("profile: bad\nseed: 0\n")
    result = subprocess.run([sys.executable, "run_all.py", "--profile", str(bad)], cwd=REPO_ROOT,
                            env=env["env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "missing key" in result.stderr and "bad.yaml" in result.stderr


def test_list_shows_registry():
    result = subprocess.run([sys.executable, "run_all.py", "--list"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "01  paper stage 1  01_prompts" in result.stdout


def test_committed_notebooks_are_clean_and_parameterised():
    notebooks = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
    assert notebooks
    for path in notebooks:
        nb = json.loads(path.read_text())
        params = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(params) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
        source = "".join(params[0]["source"])
        assert 'profile = "tiny"' in source and "overrides = {}" in source, path.name
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell.get("outputs") == [] and cell.get("execution_count") is None, \
                    f"{path.name}: committed with outputs; clear them (jupyter nbconvert --clear-output)"


def test_registered_stages_have_notebooks_in_order():
    from eqc_utils.pipeline import REGISTRY
    names = [s.name for s in REGISTRY]
    assert names == sorted(names)
    for spec in REGISTRY:
        assert spec.notebook.exists(), f"{spec.name} registered without a notebook"
        for up in spec.upstream:
            assert up in names and up < spec.name


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium not installed")
def test_index_renders_in_headless_chromium(env, tmp_path):
    index, _ = parse_index(env)
    shot = tmp_path / "index.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    "--window-size=1200,600", index.as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 5000
