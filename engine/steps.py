"""One-time steps announced as they happen (converting a model, compiling the CPU kernels).

Engine code never prints: it says what it is doing through the `engine` logger at INFO level, one
line when a step starts (so a long silence has a name) and one with its time when it ends. The
CLI's console renders these lines on stderr (`--quiet` drops them, `--json` keeps them off stdout);
a library caller sees them only if it configures logging. Nothing here knows about terminals.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

LOGGER = "engine"  # the root of every engine logger (`logging.getLogger(__name__)` in engine/...)
log = logging.getLogger(f"{LOGGER}.steps")


@contextlib.contextmanager
def step(starting: str, finished: str):
    """Log `starting` now and `finished in N s` when the block ends (nothing more if it raises)."""
    log.info("%s", starting)
    t0 = time.perf_counter()
    yield
    log.info("%s in %.1f s", finished, time.perf_counter() - t0)


def waiting(what: str) -> Callable[[], None]:
    """An `on_wait` for `engine.cache_dir.file_lock`: logs that another process is doing `what`."""
    return lambda: log.info("waiting for another magicdec process %s", what)
