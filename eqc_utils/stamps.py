"""Stage stamps on disk: where a stage's stamp lives, reading it, and removing it when the stage starts.
Below both the runner (eqc_utils.pipeline, which computes and writes stamps) and the stages
(eqc_utils.stage, which removes its stamp before rewriting artifacts)."""
from __future__ import annotations

from pathlib import Path

from eqc_utils import io
from eqc_utils.paths import runs_root

STAMP_FILE = ".stamp.json"


def stamp_path(profile: str, stage: str) -> Path:
    # not stage_dir(): looking at a stamp (e.g. in --dry-run) must not create folders
    return runs_root() / profile / stage / STAMP_FILE


def remove_stamp(profile: str, stage: str) -> None:
    """Invalidate a stage's cached result: called before its notebook (re)writes any artifact."""
    stamp_path(profile, stage).unlink(missing_ok=True)


def read_stamp(profile: str, stage: str) -> dict | None:
    path = stamp_path(profile, stage)
    return io.read_json(path) if path.exists() else None
