"""The library's shape: the import-linter contracts in pyproject.toml hold (runner -> stages ->
library -> io/paths; no import cycles). Run `.venv/bin/lint-imports` for the full report."""
from __future__ import annotations

import os

from eqc_utils.paths import REPO_ROOT


def test_import_contracts_hold(capsys):
    from importlinter.cli import lint_imports
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)       # import-linter finds the package from the current folder
    try:
        status = lint_imports(config_filename=str(REPO_ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    finally:
        os.chdir(cwd)
    report = capsys.readouterr().out
    assert status == 0, report
    assert "KEPT" in report and "BROKEN" not in report


def test_a_broken_layer_is_caught(tmp_path, capsys):
    """The contract can fail: a stage-level module importing the runner breaks it."""
    from importlinter.cli import lint_imports
    package = tmp_path / "eqc_utils"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pipeline.py").write_text("")
    (package / "stage.py").write_text("from eqc_utils import pipeline\n")
    config = tmp_path / "pyproject.toml"
    config.write_text('[tool.importlinter]\nroot_package = "eqc_utils"\n[[tool.importlinter.contracts]]\n'
                      'name = "layers"\ntype = "layers"\nlayers = ["eqc_utils.pipeline", "eqc_utils.stage"]\n')
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        import sys
        sys.path.insert(0, str(tmp_path))
        saved = {k: v for k, v in sys.modules.items() if k == "eqc_utils" or k.startswith("eqc_utils.")}
        for k in saved:
            del sys.modules[k]
        try:
            status = lint_imports(config_filename=str(config), no_cache=True, no_logo=True)
        finally:
            sys.path.remove(str(tmp_path))
            for k in [k for k in sys.modules if k == "eqc_utils" or k.startswith("eqc_utils.")]:
                del sys.modules[k]
            sys.modules.update(saved)
    finally:
        os.chdir(cwd)
    assert status == 1 and "BROKEN" in capsys.readouterr().out


WORKPLACE_WORDS = r"lendable|device call|\$OUT|carry limit|engineers' jobs|METHOD\.md|ASSETS\.md"


def test_docs_and_code_speak_to_users_only():
    """Nothing in the shipped files describes the machines it was built on or cites files that do not ship."""
    import re
    pattern = re.compile(WORKPLACE_WORDS, re.IGNORECASE)
    skip = {".git", ".venv", "runs", "reports", "__pycache__", "eqc.egg-info", "node_modules"}
    hits = []
    for path in REPO_ROOT.rglob("*"):
        parts = path.relative_to(REPO_ROOT).parts
        if path.is_dir() or any(p in skip or (p.startswith(".") and p not in (".ci",)) for p in parts[:-1]):
            continue
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".ipynb", ".txt", ""}:
            continue
        if path.name == "test_architecture.py":
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{path.relative_to(REPO_ROOT)}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not hits, hits[:10]
