"""The folder magicdec keeps one-time work in (converted models, compiled kernels), and a lock for it.

`MAGICDEC_CACHE` names it (default `~/.cache/magicdec`). Several processes of one job (data-parallel
ranks) may start together, so whoever fills an entry holds `file_lock` on a file beside it. This
module knows nothing about what is stored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MAGICDEC_CACHE") or Path.home() / ".cache" / "magicdec")


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock on `path` (created if missing) for the block's duration."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
