"""The chunked-prefill attention kernel alone: its AMX task against its vector task, in one process.

Not a test: a micro-benchmark behind BENCHMARKS.md section 33. The default model's attention shapes
(30 layers, 3 KV heads of 64, 3 query heads per KV head) over random K/V, each layer its own tensor (so
the reads come from memory as in a job): one segment of `chunk` new tokens at position `at` (the
cache holds `at + chunk` positions), as a prefill chunk of a long prompt or a question's remainder
after a reused document. Times `prefill_attention` over the 30 layers with the AMX tile unit on and
off (`use_amx`), alternating, median of --repeats, and checks both against each other (float32
accuracy, not bits: the two tasks sum in different orders). Writes JSON.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/prefill_attention_bench.py \\
        --shapes 512@0,512@2048,512@3072,40@2200 --out benchmarks/results/prefill_attention_amx.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from decode_setup import median_seconds, write_result
from engine.core import kernels

LAYERS, KV_HEADS, HEAD_DIM, QUERY_HEADS_PER_KV = 30, 3, 64, 3  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="512@0,512@2048,512@3072,40@2200",
                        help="chunk@position pairs, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    kernel = kernels.load()
    if kernel is None:
        raise SystemExit("prefill_attention_bench: the fused CPU kernel is not available here")
    previous = kernel.use_amx(True)
    if not kernel.prefill_amx_in_use():
        raise SystemExit("prefill_attention_bench: no AMX tiles here (nothing to compare)")

    g = torch.Generator().manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        chunk, at = (int(n) for n in shape.split("@"))
        capacity = at + chunk
        k_layers = [torch.randn(1, KV_HEADS, capacity, HEAD_DIM, generator=g) for _ in range(LAYERS)]
        v_layers = [torch.randn(1, KV_HEADS, capacity, HEAD_DIM, generator=g) for _ in range(LAYERS)]
        query = torch.randn(chunk, KV_HEADS * QUERY_HEADS_PER_KV, HEAD_DIM, generator=g)  # [N, H, D]
        segment = [torch.tensor([value]) for value in (0, at, 0, chunk)]  # slot, start, offset, length

        def layers(amx: bool):
            kernel.use_amx(amx)
            return [kernel.prefill_attention(query, k, v, *segment, HEAD_DIM ** -0.5)
                    for k, v in zip(k_layers, v_layers)]

        for a, b in zip(layers(True), layers(False)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        amx_s, vector_s = [], []
        for _ in range(args.repeats):  # alternating, so that a slow stretch of the machine hits both
            amx_s.append(median_seconds(lambda: layers(True), 1))
            vector_s.append(median_seconds(lambda: layers(False), 1))
        amx_ms, vector_ms = 1e3 * sorted(amx_s)[len(amx_s) // 2], 1e3 * sorted(vector_s)[len(vector_s) // 2]
        row = {"chunk": chunk, "at": at, "amx_ms": round(amx_ms, 2), "vector_ms": round(vector_ms, 2),
               "speedup": round(vector_ms / amx_ms, 3)}
        results.append(row)
        print(row, flush=True)
    kernel.use_amx(previous)
    write_result(args.out, isa=kernel.vector_isa(), layers=LAYERS, results=results)


if __name__ == "__main__":
    main()
