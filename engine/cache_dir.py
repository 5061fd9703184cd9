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
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("MAGICDEC_CACHE") or Path.home() / ".cache" / "magicdec")


@contextlib.contextmanager
def file_lock(path: Path, *, on_wait: Callable[[], None] | None = None):
    """An exclusive advisory lock on `path` (created if missing) for the block's duration.

    on_wait: called once if another process holds the lock, before waiting for it (to say why)."""
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
