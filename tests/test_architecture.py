"""The library's shape: the import-linter contracts in pyproject.toml hold (runner -> stages ->
library -> io/paths; no import cycles). Run `.venv/bin/lint-imports` for the full report."""
from __future__ import annotations

import os
import subprocess
import sys

from eqc_utils.paths import REPO_ROOT


def lint_imports(folder, config) -> tuple[int, str]:
    """import-linter in a child process: it configures logging globally, which would silence the
    log-capturing tests that run after it in this process."""
    env = {**os.environ, "PYTHONPATH": str(folder)}
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True, no_logo=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_import_contracts_hold():
    status, report = lint_imports(REPO_ROOT, REPO_ROOT / "pyproject.toml")
    assert status == 0, report
    assert "KEPT" in report and "BROKEN" not in report


def test_a_broken_layer_is_caught(tmp_path):
    """The contract can fail: a stage-level module importing the runner breaks it."""
    package = tmp_path / "eqc_utils"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pipeline.py").write_text("")
    (package / "stage.py").write_text("from eqc_utils import pipeline\n")
    config = tmp_path / "pyproject.toml"
    config.write_text('[tool.importlinter]\nroot_package = "eqc_utils"\n[[tool.importlinter.contracts]]\n'
                      'name = "layers"\ntype = "layers"\nlayers = ["eqc_utils.pipeline", "eqc_utils.stage"]\n')
    status, report = lint_imports(tmp_path, config)
    assert status == 1 and "BROKEN" in report, report
