"""DeepSpeed's shared-memory all-reduce for CPU tensor parallelism, built once into magicdec's cache.

`deepspeed.init_distributed` on a CPU compiles this op (`deepspeed_shm_comm`) with torch's extension
builder the first time, and that builder waits, without limit, while a `lock` file from an earlier
build exists in the build folder: a rank killed mid-build (Ctrl-C, a test's timeout) leaves one behind,
and every later tensor-parallel job then hangs at start-up, silently. `prepare()` runs before
`init_distributed` on every rank: it points the builder at magicdec's cache (unless the user set
TORCH_EXTENSIONS_DIR), and under magicdec's own file lock removes a stale `lock` and builds or loads
the op. DeepSpeed keeps the loaded op per process, so its own load inside `init_distributed` touches
no lock file. DeepSpeed also never unlinks the op's per-rank buffers (`/dev/shm`, 67 MB each, in
RAM): `release_buffer()` removes the name once every rank has mapped them, so no job, finished or
killed, leaves them behind. This module does not decide whether the op is used (engine/scale/group.py
does).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from engine.cache_dir import cache_root, file_lock
from engine.steps import step, waiting

OP_NAME = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME, the build folder's name
BUFFER_PREFIX = "deepspeed_allreduce_buffer"  # the op's SHM_BUFFER_NAME (deepspeed/ops/csrc/cpu/comm/shm.cpp)
SHM_DIR = Path("/dev/shm")
log = logging.getLogger(__name__)


def extensions_dir() -> Path:
    """Where torch builds DeepSpeed's ops for magicdec (the user's TORCH_EXTENSIONS_DIR wins)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_root() / "torch_extensions")


def prepare(deepspeed) -> None:
    """Build (first time) or load the shm all-reduce op in this process; a failure is left to DeepSpeed.

    deepspeed: the imported module (engine/scale/group.py imports it with its output redirected)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # not a CPU accelerator, or an op DeepSpeed will not use here
    root = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)  # torch's builder reads it
    build_dir = root / builder.name
    build_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(build_dir.parent / f"{builder.name}.build.lock",
                   on_wait=waiting(f"to finish with DeepSpeed's shared-memory all-reduce in {build_dir}")):
        # Holding our lock, no magicdec process is inside torch's builder for this folder: a `lock`
        # file now is a killed build's leftover.
        (build_dir / "lock").unlink(missing_ok=True)
        announced = contextlib.nullcontext() if any(build_dir.glob(f"{builder.name}*.so")) else step(
            f"compiling DeepSpeed's shared-memory all-reduce once into {build_dir}",
            "compiled DeepSpeed's shared-memory all-reduce")  # else torch only loads the earlier build
        try:
            with announced:
                builder.load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed retries and reports in init_distributed
            log.warning("DeepSpeed's shared-memory all-reduce did not build: %s",
                        str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)


def buffer_path(rank: int) -> Path:
    """Where the op keeps `rank`'s all-reduce buffer: shm.cpp names it by user, MASTER_ADDR, MASTER_PORT
    and rank."""
    return SHM_DIR / (f"{BUFFER_PREFIX}_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
                      f"{os.environ.get('MASTER_PORT')}_{rank}")


def release_buffer(rank: int) -> None:
    """Unlink this rank's buffer name; call it only after every rank has mapped every buffer (a barrier
    after `init_distributed`, which returns only once this rank has opened all the others). The mappings
    stay valid, and the kernel frees the memory when the last process using it exits. Nothing to do
    when the op was not set up (no buffer by that name)."""
    buffer_path(rank).unlink(missing_ok=True)
