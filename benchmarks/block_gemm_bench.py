"""One decode step's GEMMs of the default model read from its GGUF blocks against its float32 weights.

Not a test: a micro-benchmark behind BENCHMARKS.md section 19. It loads the default model as the
engine does (`ModelRunner` keeps the GGUF's blocks), then times the few-row kernel over the 210
layer linears (Q4_1) and the lm_head (Q8_0) at M rows, each call reading the blocks, against the
same calls reading the float32 weights. It asserts that both give the same bits. Median of
--repeats. Writes JSON.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/block_gemm_bench.py --rows 1,4,13,16,40 \\
        --out benchmarks/results/block_gemm.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from decode_setup import cpu_model_name, median_seconds
from engine.core import kernels
from engine.core.linear import FORMATS
from engine.core.runner import ModelRunner
from engine.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,13,16,40")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    loaded = load_model("smollm2-135m-instruct", device="cpu", attn_implementation="magicdec")
    ModelRunner(loaded, slots=1, capacity=64)  # keeps the GGUF's blocks, as a job's runner does
    kernel = kernels.load()
    linears = [m for m in loaded.model.modules() if getattr(m, "packed", None) is not None]
    parts = {"layers": [m for m in linears if m is not loaded.model.lm_head], "lm_head": [loaded.model.lm_head]}
    if not parts["layers"] or loaded.model.lm_head.packed is None:
        raise SystemExit("block_gemm_bench: the model has no GGUF blocks here (no kernel, or MAGICDEC_GGUF_BLOCKS=0)")

    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {K: torch.randn(rows, K) for K in {m.weight.shape[1] for m in linears}}
        row = {"rows": rows}
        for name, modules in parts.items():
            calls = [(xs[m.weight.shape[1]], m.weight, m.packed) for m in modules]

            def from_blocks():
                return [kernel.small_linear_cat(x, [w], [None], [p.blocks], [FORMATS[p.format]]) for x, w, p in calls]

            def from_float32():
                return [kernel.small_linear(x, w, None) for x, w, _ in calls]

            assert all(torch.equal(a, b) for a, b in zip(from_blocks(), from_float32())), name
            fp32, blocks = (1e3 * median_seconds(fn, args.repeats) for fn in (from_float32, from_blocks))
            row[name] = {"gemms": len(calls), "float32_ms": round(fp32, 2), "blocks_ms": round(blocks, 2),
                         "ratio": round(fp32 / blocks, 2)}
        results.append(row)
        print(row, flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_model_name(),
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "threads": torch.get_num_threads(), "isa": kernel.vector_isa(), "bit_equal": True, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
