"""The local cache (``$SPLITSERVE_CACHE``, default ``~/.cache/splitserve``) and its build-then-rename rule:
a build goes to a temporary directory that is renamed into place, so concurrent builders and builds killed
mid-way are both harmless."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE") or Path.home() / ".cache" / "splitserve")


def start_build(final: Path) -> Path:
    """A fresh temporary directory beside ``final`` to build into (OSError when the cache is not writable)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would follow the build into place
    return tmp


def publish(tmp: Path, final: Path) -> Path:
    """Renames a finished build into place; if another process got there first, keeps theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise
    return final


def _remove_abandoned_builds(final: Path, older_than_s: float = 3600) -> None:
    # A build killed mid-way leaves its temporary directory; no live build takes an hour.
    now = time.time()
    for leftover in final.parent.glob(f".{final.name}.*"):
        try:
            if now - leftover.stat().st_mtime > older_than_s:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def build_once(final: Path, write: Callable[[Path], None]) -> Path:
    """``final``, built first by ``write(tmp)`` unless it exists (OSError when the cache is not writable)."""
    if final.is_dir():
        return final
    tmp = start_build(final)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, final)
