"""Atomic writes and JSONL helpers: an interrupted stage never leaves a half-written file that a
later stage would trust."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed over `path` (file or folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)) / path.name
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


class DiskSpaceError(OSError):
    """Too little free disk space for a large write that is about to start."""


def tree_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (a file: its size; missing: 0)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def ensure_free_space(path: str | Path, need_bytes: int, what: str) -> None:
    """Raise DiskSpaceError naming `what`, `path` and both sizes when the disk holding `path` has less than
    `need_bytes` free. Checked before large writes: a disk that fills up half-way gives cryptic errors (torch.save:
    "unexpected pos") and leaves the stage to be resumed from its previous checkpoint."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        gib = 2 ** 30
        raise DiskSpaceError(f"{what} needs about {need_bytes / gib:.2f} GiB at {path}, but only {free / gib:.2f} GiB "
                             "are free on that disk: free some space (old runs, *.stale-* folders), keep fewer "
                             "checkpoints (keep_last_ckpts), or point EQC_RUNS_DIR at a larger disk")


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    count = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file of objects; a malformed line, or one holding something other than a JSON
    object, raises ValueError naming the file and line number."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); fix or delete that line") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got a {_json_kind(row)}; "
                                 "fix or delete that line")
            rows.append(row)
    return rows


def _json_kind(value) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


# ---------------------------------------------------------------- stale state: moved aside, never deleted

def stale_name(path: str | Path, stamp: str | None = None) -> Path:
    """`<name>.stale-<YYYYmmdd-HHMMSS>` beside `path` (with a counter if that name is taken)."""
    path = Path(path)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    candidate = path.with_name(f"{path.name}.stale-{stamp}")
    n = 2
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.stale-{stamp}-{n}")
        n += 1
    return candidate


def move_aside(path: str | Path, stamp: str | None = None) -> Path | None:
    """Rename a file or folder to `stale_name(path)`; None when there is nothing at `path`."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    target = stale_name(path, stamp)
    os.replace(path, target)
    return target


def flat_settings(settings: dict, prefix: str = "") -> dict:
    """{"qad": {"lr": 1}} -> {"qad.lr": 1}: dotted keys, so that changes can be named."""
    out = {}
    for key, value in settings.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flat_settings(value, dotted))
        else:
            out[dotted] = value
    return out


def describe_changes(old: dict | None, new: dict, limit: int = 8) -> str:
    """'qad.lr: 0.001 -> 1e-05, qad.seed: 0 -> 1' for the settings that differ (dotted keys)."""
    if old is None:
        return "settings not recorded (made by an earlier version)"
    old, new = flat_settings(old), flat_settings(new)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k, "<absent>") != new.get(k, "<absent>")]
    if not changed:
        return "no setting changed"
    parts = [f"{k}: {_short(old.get(k, '<absent>'))} -> {_short(new.get(k, '<absent>'))}" for k in changed[:limit]]
    if len(changed) > limit:
        parts.append(f"and {len(changed) - limit} more")
    return ", ".join(parts)


def _short(value, width: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= width else text[: width - 3] + "..."
