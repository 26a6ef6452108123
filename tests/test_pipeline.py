"""run_all.py end to end on a micro profile through papermill (notebook 01): outputs, the cache skip,
the failure path and the HTML reports; then the stamps, the stage selection and the command-line
errors in-process, without a kernel."""
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser

import pytest
import yaml

from eqc_utils import io
from eqc_utils.params import load_params
from eqc_utils.paths import NOTEBOOKS_DIR, PARAMS_DIR, REPO_ROOT, stage_dir


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
    headline = json.loads((env["root"] / "figures" / "micro" / "headline.json").read_text())
    assert headline["profile"] == "micro" and list(headline["stages"]) == ["01_prompts"]
    assert headline["stages"]["01_prompts"]["metrics"] == metrics
    assert headline["stages"]["01_prompts"]["seconds"] > 0 and "CPU cores" in headline["machine"]

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
    # the kernel's own log noise stays out of the terminal
    noise = failed.stdout + failed.stderr
    assert "without encryption" not in noise and "KeyboardInterrupt caught in kernel" not in noise, noise
    index, parser = parse_index(env)
    assert parser.rows == ["failed"]
    assert (index.parent / "01_prompts.html").exists()
    # the previous run's stamp went when the stage started: the next run re-runs it
    assert not (env["root"] / "runs" / "micro" / "01_prompts" / ".stamp.json").exists()
    dry = run_all(env, "--only", "01", "--dry-run")
    assert "[01_prompts] would run: never ran" in dry.stdout, dry.stdout


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


# ---- stamps, selection and command-line errors, in-process (no kernel)

@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Empty runs/, reports/ and figures/ folders for the tiny profile."""
    for var, sub in (("EQC_RUNS_DIR", "runs"), ("EQC_REPORTS_DIR", "reports"), ("EQC_FIGURES_DIR", "figures")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    return tmp_path


def finish_01():
    """Make 01_prompts look completed for the tiny profile: its outputs and a current stamp."""
    from eqc_utils import pipeline
    spec = next(s for s in pipeline.REGISTRY if s.name == "01_prompts")
    out = stage_dir("tiny", spec.name)
    for name in spec.outputs:
        (out / name).write_text("{}\n")
    io.write_json(out / ".stamp.json", pipeline.compute_stamp(spec, load_params("tiny"), "tiny"))
    return out


def dry_run(**kwargs):
    from eqc_utils import pipeline
    log = []
    pipeline.run_pipeline("tiny", dry_run=True, log=log.append, **kwargs)
    return log


def test_library_edit_invalidates_stamps_and_dry_run_says_so(runs, tmp_path, monkeypatch):
    from eqc_utils import pipeline
    lib = tmp_path / "lib"
    (lib / "quant").mkdir(parents=True)
    (lib / "__init__.py").write_text("")
    (lib / "quant" / "grid.py").write_text("GROUP = 128\n")
    monkeypatch.setattr(pipeline, "LIBRARY_DIR", lib)
    finish_01()
    assert dry_run(only=["01"]) == ["[01_prompts] would skip: up to date"]
    (lib / "__pycache__").mkdir()  # bytecode and non-source files are not part of the library digest
    (lib / "__pycache__" / "grid.cpython-311.pyc").write_bytes(b"\0")
    (lib / "notes.txt").write_text("x")
    assert dry_run(only=["01"]) == ["[01_prompts] would skip: up to date"]
    (lib / "quant" / "grid.py").write_text("GROUP = 64\n")  # a fix deep inside the library
    assert dry_run(only=["01"]) == ["[01_prompts] would run: changed: library (eqc_utils)"]


def test_library_digest_covers_the_package_and_is_cheap():
    from eqc_utils import pipeline
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        digest = pipeline.library_digest()
        timings.append(time.perf_counter() - started)
    assert min(timings) < 0.05, timings
    assert digest == pipeline.library_digest(REPO_ROOT / "eqc_utils")
    spec = pipeline.REGISTRY[0]
    assert pipeline.compute_stamp(spec, load_params("tiny"), "tiny")["library"] == digest


def test_a_run_cut_off_later_keeps_the_headline_of_the_stages_it_finished(runs, monkeypatch):
    # a GPU node taken back during 02 (here: Ctrl-C) must not take 01's numbers with it
    import papermill
    from eqc_utils import pipeline

    def notebook(input_path, output_path, **kwargs):
        if "01_prompts" not in input_path:
            raise KeyboardInterrupt
        io.write_json(finish_01() / "metrics.json", {"stage1_prompts": 7})

    monkeypatch.setattr(papermill, "execute_notebook", notebook)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_pipeline("tiny", end="02", log=lambda line: None)
    headline = json.loads((runs / "figures" / "tiny" / "headline.json").read_text())
    assert list(headline["stages"]) == ["01_prompts"]
    assert headline["stages"]["01_prompts"]["metrics"] == {"stage1_prompts": 7}
    assert (runs / "reports" / "tiny" / "index.html").exists()


@pytest.mark.parametrize("interruption", [RuntimeError("kernel died"), KeyboardInterrupt()])
def test_failed_forced_run_leaves_no_stamp_and_reruns(runs, monkeypatch, interruption):
    import papermill
    from eqc_utils import pipeline
    out = finish_01()
    seen = {}

    def half_run(input_path, output_path, **kwargs):
        seen["stamp while running"] = pipeline.read_stamp("tiny", "01_prompts")
        (out / "prompts_stage1.jsonl").write_text("half-new\n")
        raise interruption

    monkeypatch.setattr(papermill, "execute_notebook", half_run)
    if isinstance(interruption, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            pipeline.run_pipeline("tiny", only=["01"], force=True, log=lambda line: None)
    else:
        results = pipeline.run_pipeline("tiny", only=["01"], force=True, log=lambda line: None)
        assert [r.status for r in results] == ["failed"] and "kernel died" in results[0].error
    assert seen == {"stamp while running": None}
    assert pipeline.read_stamp("tiny", "01_prompts") is None
    assert dry_run(only=["01"]) == ["[01_prompts] would run: never ran"]


def test_notebook_run_by_hand_invalidates_the_stamp(runs, monkeypatch):
    # e.g. 01 executed in JupyterLab with other overrides: its artifacts no longer match the stamp
    from eqc_utils import stage
    out = finish_01()
    monkeypatch.setattr(stage, "seed_everything", lambda seed: None)
    stage.open_stage("01_prompts", "tiny", {"prompts.shuffle_seed": 5})
    assert not (out / ".stamp.json").exists()
    assert dry_run(only=["01"]) == ["[01_prompts] would run: never ran"]


def test_stage_numbers_and_names_select_their_stage():
    from eqc_utils import pipeline
    stages = pipeline.registered()

    def names(**kwargs):
        return [s.name for s in pipeline.select(stages, **kwargs)]

    assert names(only=["1"]) == names(only=["01"]) == names(only=["01_prompts"]) == ["01_prompts"]
    assert names(paper_stage=2, start="04") == ["04_pack_target", "05_qad_data"]
    assert names(paper_stage=1, only=["02"]) == ["02_teacher_data"]
    assert names(start="6") == ["06_drafter_pretrain", "07_drafter_finetune", "08_drafter_quant", "09_eval"]
    assert names(paper_stage=4) == ["09_eval"]
    assert names(end="07") == [s.name for s in stages if s.number <= "07"]
    assert names(start="03", end="05") == ["03_qad_target", "04_pack_target", "05_qad_data"]
    assert names(paper_stage=3, end="7") == ["06_drafter_pretrain", "07_drafter_finetune"]


def load_run_all():
    spec = importlib.util.spec_from_file_location("run_all_cli", REPO_ROOT / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (["--only", "012"], "--only '012': unknown stage; known: 01 (01_prompts)"),   # used to run 01
    (["--from", "013"], "--from '013': unknown stage"),
    (["--only", "01_prompt"], "--only '01_prompt': unknown stage"),
    (["--stage", "1", "--only", "03"], "--only 03 conflicts with --stage 1"),       # used to run nothing, exit 0
    (["--only", "01", "--from", "03"], "--only 01 conflicts with --from 03"),
    (["--stage", "1", "--from", "03"], "--from 03 conflicts with --stage 1"),
    (["--from", "05", "--to", "03"], "--to 03 conflicts with --from 05"),
    (["--only", "08", "--to", "07"], "--only 08 conflicts with --to 07"),
    (["--stage", "4", "--to", "07"], "--to 07 conflicts with --stage 4"),
    (["--to", "7x"], "--to '7x': unknown stage"),
    (["-p", "profile=paper"], "'profile' cannot be overridden"),                   # used to write runs/paper/
    (["--profile", "nowhere/x.yaml"], f"(tried {os.path.abspath('nowhere/x.yaml')}); available profiles: "),
])
def test_command_line_errors_name_the_problem_and_exit_2(args, message, runs, capsys):
    code = load_run_all().main([*args, "--dry-run"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith("error: ") and message in err, err


def test_notebooks_get_a_profile_file_as_an_absolute_path(tmp_path, monkeypatch):
    # the kernel runs in the repository root: a path relative to the caller's folder would miss
    from eqc_utils import pipeline
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((PARAMS_DIR / "tiny.yaml").read_text())
    raw["profile"] = "micro"
    (tmp_path / "micro.yaml").write_text(yaml.safe_dump(raw))
    assert pipeline._notebook_profile_arg("micro.yaml") == str(tmp_path / "micro.yaml")
    assert pipeline._notebook_profile_arg("tiny") == "tiny"


def test_kernel_noise_filter_drops_only_the_two_known_messages(tmp_path):
    from eqc_utils import pipeline

    def passes(message):
        record = logging.LogRecord("IPKernelApp", logging.WARNING, __file__, 1, message, (), None)
        return pipeline.KernelNoiseFilter().filter(record)

    assert not passes("Kernel is running over TCP without encryption. All communication ...")
    assert not passes("KeyboardInterrupt caught in kernel.")
    assert passes("Exception in message handler:") and passes("Unknown message type: %r")
    config = json.loads(pipeline.kernel_config(tmp_path).read_text())["IPKernelApp"]["logging_config"]
    factory = config["filters"]["eqc_kernel_noise"]["()"]
    module, _, name = factory.rpartition(".")
    assert getattr(importlib.import_module(module), name) is pipeline.KernelNoiseFilter
    assert config["handlers"]["console"]["filters"] == ["eqc_kernel_noise"]


@pytest.mark.slow
def test_kernel_log_keeps_errors_but_not_the_known_noise(runs, tmp_path, monkeypatch, capfd):
    # the kernel is a child process writing to this terminal: its startup warning about unencrypted
    # TCP and jupyter_client's shutdown interrupt ("KeyboardInterrupt caught in kernel") are dropped
    import nbformat
    from eqc_utils import pipeline
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [
        nbformat.v4.new_code_cell('profile = "tiny"\noverrides = {}', metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell('import logging\nlog = logging.getLogger("IPKernelApp")\n'
                                  'log.error("KeyboardInterrupt caught in kernel.")\n'
                                  'log.error("kernel log line that must still show")'),
        nbformat.v4.new_code_cell('raise ValueError("boom")'),
    ]
    monkeypatch.setattr(pipeline, "NOTEBOOKS_DIR", tmp_path)
    nbformat.write(nb, str(tmp_path / "99_noise.ipynb"))
    spec = pipeline.StageSpec("99_noise", 4, ("seed",), ())
    result = pipeline.execute(spec, "tiny", [], load_params("tiny"), log=lambda line: None)
    assert result.status == "failed" and "ValueError: boom" in result.error
    out, err = capfd.readouterr()
    assert "kernel log line that must still show" in err, err
    assert "without encryption" not in out + err and "KeyboardInterrupt caught" not in out + err, err
