"""A bfloat16 model's layer GEMMs: the kernel's bfloat16 dot products against torch's bfloat16 GEMM.

Not a test: the micro-benchmark behind BENCHMARKS.md section 42. For each row count it times the
default model's 30 layers of linears (q, k, v, o, gate, up, down at SmolLM2-135M's shapes, random
bfloat16 weights: the time does not depend on the values) through `bf16_linear_cat` from panels and
through `F.linear`, alternating, the median of --repeats rounds each. Writes JSON.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/bf16_linear_bench.py --rows 16,32,48,80,144,512 \\
        --out benchmarks/results/bf16_linear.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from decode_setup import write_result
from engine.core import kernels

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [N, K]
LAYERS = 30


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32,48,80,144,512")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bf16_linear.json"))
    args = parser.parse_args()
    module = kernels.load()
    if module is None or not module.bf16_linear_available():
        raise SystemExit("bf16_linear_cat is not built here (it needs a CPU with AVX512-BF16)")
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator).bfloat16() for n, k in SHAPES]
    panels = [module.bf16_panels(w) for w in weights]
    results = []
    for M in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(M, k, generator=generator).bfloat16() for _, k in SHAPES]
        ours = lambda: [module.bf16_linear_cat(x, [p], [None]) for x, p in zip(xs, panels)]  # noqa: E731
        torchs = lambda: [F.linear(x, w) for x, w in zip(xs, weights)]  # noqa: E731
        for fn in (ours, torchs):
            fn()
        timed = {"kernel": [], "torch": []}
        for _ in range(args.repeats):
            timed["kernel"].append(seconds(ours))
            timed["torch"].append(seconds(torchs))
        kernel_ms = statistics.median(timed["kernel"]) * LAYERS * 1e3
        torch_ms = statistics.median(timed["torch"]) * LAYERS * 1e3
        flop = 2 * M * sum(n * k for n, k in SHAPES) * LAYERS
        row = {"rows": M, "kernel_ms": round(kernel_ms, 2), "torch_ms": round(torch_ms, 2),
               "speedup": round(torch_ms / kernel_ms, 3), "kernel_gflop_per_s": round(flop / kernel_ms / 1e6, 1)}
        print(row)
        results.append(row)
    write_result(args.out, torch=torch.__version__, layers=LAYERS, results=results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
