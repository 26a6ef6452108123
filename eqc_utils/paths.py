"""Where things live. Everything generated goes under runs/<profile>/ (git-ignored) or reports/, figures/."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PARAMS_DIR = REPO_ROOT / "params"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
PACKAGE_DATA_DIR = Path(__file__).resolve().parent / "data"


def runs_root() -> Path:
    """Root of all artifacts; EQC_RUNS_DIR moves it (tests point it at a temporary folder)."""
    return Path(os.environ.get("EQC_RUNS_DIR", REPO_ROOT / "runs"))


def reports_root() -> Path:
    return Path(os.environ.get("EQC_REPORTS_DIR", REPO_ROOT / "reports"))


def figures_root() -> Path:
    return Path(os.environ.get("EQC_FIGURES_DIR", REPO_ROOT / "figures"))


def cache_dir() -> Path:
    """Profile-independent cache of converted assets (teacher HF folder, tokenizer, punkt).
    Kept apart from EQC_RUNS_DIR so that tests with a temporary runs folder reuse the conversions."""
    path = Path(os.environ.get("EQC_ASSETS_DIR", REPO_ROOT / "runs" / "_assets"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def stage_dir(profile: str, stage: str) -> Path:
    path = runs_root() / profile / stage
    path.mkdir(parents=True, exist_ok=True)
    return path


def figures_dir(profile: str) -> Path:
    path = figures_root() / profile
    path.mkdir(parents=True, exist_ok=True)
    return path
