"""Up to how many rows the few-row kernel's AVX-512 GGUF panels beat torch's float32 GEMM: measured
once per machine and kept.

Where a model's weights are kept as 16-output panels (`engine.core.linear`), the kernel reads 0.625
bytes a Q4_1 weight and torch's GEMM reads the 4-byte float32 copy. Which is faster at a verification
forward's 48-144 rows or a prefill chunk's 512 depends on the CPU and on the GEMM library torch
brings for it, and differs by machine more than a constant can say: one step's layers of the default
model at 48 / 128 / 512 rows took 98 / 151 / 702 ms by the panels against 179 / 196 / 777 ms by
torch on a 2-vCPU AMD EPYC Zen 4, while on a 2-vCPU Xeon torch's GEMM caught up near 96 rows
(BENCHMARKS.md section 40). So `row_limit` times both, once, on an up and a down projection of a
small model's shape (synthetic Q4_1 weights) at rising row counts, and takes the panels up to the
last count where they were not slower by more than 5% (`math.inf`: at every count measured). The
answer is kept beside the kernel's build, keyed by the CPU, torch and the thread count;
`MAGICDEC_PANEL_ROWS` (a row count, or `all`) sets it instead. Only a panel call's limit comes from
here; other weights keep `engine.core.linear.max_rows()`. This module measures and remembers; it
does not multiply anything the engine keeps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cache_dir import cache_root
from engine.core.kernels import cpu_model
from engine.errors import JobError

if TYPE_CHECKING:
    import torch

ENV = "MAGICDEC_PANEL_ROWS"  # a row count, or "all": the limit, unmeasured
LADDER = (48, 64, 96, 128, 192, 256, 384, 512)  # row counts timed, in order
SHAPES = ((1536, 576), (576, 1536))  # (N, K): an up and a down projection (SmolLM2-135M's)
REPEATS = 5
# Within 5% the panels keep the rows: as fast, and a row's bits then do not depend on how many rows
# its call had (a verification forward's, a prefill chunk's), as in a plain decode step.
TIE = 1.05
log = logging.getLogger(__name__)


def limit_from_timings(timings: list[tuple[int, float, float]], floor: int) -> float:
    """The rows up to which the panels take a call: timings (rows, panels seconds, torch seconds) in
    rising rows; the last row count before the first where the panels were slower by more than
    TIE (`floor` if that is the first; never below it), `math.inf` if they never were."""
    limit = floor
    for rows, panels_s, torch_s in timings:
        if panels_s > TIE * torch_s:
            return max(limit, floor)
        limit = rows
    return math.inf


def setting_from_env() -> float | None:
    """`MAGICDEC_PANEL_ROWS` read: None when unset, `math.inf` for "all", else its row count; anything
    else is a JobError naming it (the CLI asks before a job opens its output; no torch needed here)."""
    setting = os.environ.get(ENV, "").strip().lower()
    if not setting:
        return None
    if setting == "all":
        return math.inf
    if not setting.isdigit():
        raise JobError(f"{ENV}={setting!r}: expected a row count or 'all'")
    return int(setting)


def row_limit(kernel, panel_format: int, floor: int) -> float:
    """The panels' row limit on this machine: `MAGICDEC_PANEL_ROWS`, else the kept measurement, else
    measured now (a second or two) and kept. kernel: the compiled module; panel_format: its id of
    Q4_1 panels; floor: the few-row limit, which the panels always take."""
    setting = setting_from_env()
    if setting is not None:
        return max(setting, floor)
    path = _kept_at(kernel)
    try:
        kept = json.loads(path.read_text())
        return math.inf if kept["limit"] is None else float(kept["limit"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timings = measure(kernel, panel_format)
    limit = limit_from_timings(timings, floor)
    log.info("GGUF panels against torch's GEMM, measured once on this machine: panels for %s",
             "any number of rows" if limit == math.inf else f"up to {int(limit)} rows")
    try:  # whole or not at all: written aside, then renamed over (another process may be reading it)
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        aside.write_text(json.dumps({"limit": None if limit == math.inf else limit,
                                     "timings": [list(t) for t in timings]}))
        os.replace(aside, path)
    except OSError:  # a read-only cache: measured again by the next process
        pass
    return limit


def measure(kernel, panel_format: int) -> list[tuple[int, float, float]]:
    """(rows, panels seconds, torch seconds) at each count of LADDER, over SHAPES: the least of REPEATS
    alternating timings of each (the least is the one other work on the machine disturbed least)."""
    import torch  # here, not at import: the CLI reads `setting_from_env` before it loads torch
    import torch.nn.functional as F

    from engine.models.gguf_blocks import dequantise, to_panels

    operands = []
    for N, K in SHAPES:
        blocks = synthetic_q4_1(N, K)
        operands.append((K, dequantise(blocks, "q4_1"), to_panels(blocks, "q4_1")))
    timings = []
    for rows in LADDER:
        xs = [torch.randn(rows, K) for K, _, _ in operands]
        panels_s, torch_s = math.inf, math.inf
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            for x, (_, weight, panels) in zip(xs, operands):
                kernel.small_linear_cat(x, [weight], [None], [panels], [panel_format])
            t1 = time.perf_counter()
            for x, (_, weight, _) in zip(xs, operands):
                F.linear(x, weight)
            t2 = time.perf_counter()
            panels_s, torch_s = min(panels_s, t1 - t0), min(torch_s, t2 - t1)
        timings.append((rows, panels_s, torch_s))
    return timings


def synthetic_q4_1(N: int, K: int) -> torch.Tensor:
    """Q4_1 blocks uint8 [N, K / 32, 20] of random nibbles with scales of ordinary size (d 0.01, m -0.08)."""
    import torch

    from engine.models.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

    g = torch.Generator().manual_seed(N * K)
    blocks = torch.randint(0, 256, (N, K // BLOCK_WEIGHTS, BLOCK_BYTES["q4_1"]), dtype=torch.uint8, generator=g)
    scales = torch.tensor([0.01, -0.08], dtype=torch.float16).view(torch.uint8)  # d, m as fp16 bytes
    blocks[..., :4] = scales
    return blocks


def _kept_at(kernel) -> Path:
    """Where the measurement is kept: beside the kernel's build (keyed by its sources, the CPU's flags
    and torch), per CPU model and thread count."""
    import torch

    cpu = "".join(c if c.isalnum() else "_" for c in cpu_model())[:64]
    name = getattr(kernel, "__name__", "kernel")
    return cache_root() / "torch_extensions" / name / f"panel_rows_{cpu}_{torch.get_num_threads()}t.json"
