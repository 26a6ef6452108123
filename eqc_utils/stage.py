"""What a notebook needs from the pipeline: its params, its output folder, its inputs from earlier
stages, and one way to record headline metrics for the report.

    S = open_stage("03_qad_target", profile, overrides)
    S.params["qad"]["lr"]; S.path("ckpt"); S.input("02_teacher_data", "teacher.jsonl"); S.record(kl=0.03)
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

from eqc_utils import io
from eqc_utils.params import load_params
from eqc_utils.paths import figures_dir, stage_dir

METRICS_FILE = "metrics.json"
RESOLVED_PARAMS_FILE = "params.resolved.yaml"


class MissingInputError(FileNotFoundError):
    """An earlier stage's artifact is absent."""


@dataclass
class Stage:
    name: str
    profile: str
    params: dict
    dir: Path

    def path(self, *parts: str) -> Path:
        """A path inside this stage's output folder (parent folders created)."""
        path = self.dir.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def input(self, stage: str, *parts: str) -> Path:
        """An artifact of an earlier stage; a clear error says which stage to run when it is missing."""
        path = stage_dir(self.profile, stage).joinpath(*parts)
        if not path.exists():
            raise MissingInputError(
                f"{self.name} needs {path}, made by stage {stage}: run "
                f"`python run_all.py --profile {self.profile} --only {stage[:2]}` first")
        return path

    def figure(self, name: str) -> Path:
        return figures_dir(self.profile) / name

    def record(self, **metrics) -> dict:
        """Merge headline metrics into this stage's metrics.json (shown in reports/<profile>/index.html)."""
        path = self.dir / METRICS_FILE
        current = io.read_json(path) if path.exists() else {}
        current.update({k: _plain(v) for k, v in metrics.items()})
        io.write_json(path, current)
        return current


def _plain(value):
    """Numbers from numpy/torch become JSON numbers."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    if isinstance(value, float):
        return round(value, 6)
    return value


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass
    try:
        import torch
        torch.manual_seed(seed)
    except ImportError:
        pass


def open_stage(name: str, profile: str = "tiny", overrides: dict | list | None = None) -> Stage:
    """Load and validate the profile, seed the RNGs, save the resolved params beside the outputs.

    The stage's stamp is removed before anything is written: once an execution (from run_all.py or by
    hand in JupyterLab, with any overrides) starts rewriting the stage's artifacts, they no longer count
    as up to date until run_all.py completes the stage again."""
    import yaml

    from eqc_utils.stamps import remove_stamp
    params = load_params(profile, overrides)
    if params["assets"]["hub_allowed"]:
        for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            os.environ[flag] = "0"
    seed_everything(params["seed"])
    out = stage_dir(params["profile"], name)
    remove_stamp(params["profile"], name)
    io.write_text(out / RESOLVED_PARAMS_FILE, yaml.safe_dump(params, sort_keys=False))
    # metrics are per execution: a re-run starts them afresh
    (out / METRICS_FILE).unlink(missing_ok=True)
    return Stage(name=name, profile=params["profile"], params=params, dir=out)
