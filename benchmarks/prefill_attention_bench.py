"""The chunked-prefill attention kernel alone: one of its tasks against the one it replaces, in one process.

Not a test: a micro-benchmark behind BENCHMARKS.md section 33. The default model's attention shapes
(30 layers, 3 KV heads of 64, 3 query heads per KV head) over random K/V, each layer its own tensor (so
the reads come from memory as in a job): one segment of `chunk` new tokens at position `at` (the
cache holds `at + chunk` positions), as a prefill chunk of a long prompt or a question's remainder
after a reused document. Times `prefill_attention` over the 30 layers with the task on and off,
alternating, median of --repeats, and checks both against each other. `--task amx` (BENCHMARKS.md
section 33): float32 K/V and queries, the AMX tile unit on and off (`use_amx`), float32 accuracy (not
bits: the two sum in different orders). `--task bf16-dot` (section 41): bfloat16 K/V and queries (a
bfloat16 model's prefill), the bfloat16 dot-product task on and off (`prefill_use_bf16_dot`; off, the
query is widened to float32), within 2^-8 of the largest |V| (the probabilities' rounding). Writes JSON.

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
    parser.add_argument("--task", choices=["amx", "bf16-dot"], default="amx", help="the task timed against the one it replaces")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    kernel = kernels.load()
    if kernel is None:
        raise SystemExit("prefill_attention_bench: the fused CPU kernel is not available here")
    previous = kernel.use_amx(True)
    if args.task == "amx":
        if not kernel.prefill_amx_in_use():
            raise SystemExit("prefill_attention_bench: no AMX tiles here (nothing to compare)")
        dtype, switch, names = torch.float32, kernel.use_amx, ("amx_ms", "vector_ms")
    else:
        if not kernel.prefill_bf16_dot_in_use(HEAD_DIM):
            raise SystemExit("prefill_attention_bench: no bfloat16 dot-product task here (AVX512-BF16 without AMX)")
        dtype, switch, names = torch.bfloat16, kernel.prefill_use_bf16_dot, ("dot_ms", "widened_ms")

    g = torch.Generator().manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        chunk, at = (int(n) for n in shape.split("@"))
        capacity = at + chunk
        k_layers = [torch.randn(1, KV_HEADS, capacity, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
        v_layers = [torch.randn(1, KV_HEADS, capacity, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
        query = torch.randn(chunk, KV_HEADS * QUERY_HEADS_PER_KV, HEAD_DIM, generator=g).to(dtype)  # [N, H, D]
        segment = [torch.tensor([value]) for value in (0, at, 0, chunk)]  # slot, start, offset, length

        def layers(on: bool):
            switch(on)
            return [kernel.prefill_attention(query, k, v, *segment, HEAD_DIM ** -0.5)
                    for k, v in zip(k_layers, v_layers)]

        for a, b, v in zip(layers(True), layers(False), v_layers):
            atol = 1e-5 if dtype == torch.float32 else 2 ** -8 * v.float().abs().max().item()
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)
        on_s, off_s = [], []
        for _ in range(args.repeats):  # alternating, so that a slow stretch of the machine hits both
            on_s.append(median_seconds(lambda: layers(True), 1))
            off_s.append(median_seconds(lambda: layers(False), 1))
        on_ms, off_ms = 1e3 * sorted(on_s)[len(on_s) // 2], 1e3 * sorted(off_s)[len(off_s) // 2]
        row = {"chunk": chunk, "at": at, names[0]: round(on_ms, 2), names[1]: round(off_ms, 2),
               "speedup": round(off_ms / on_ms, 3)}
        results.append(row)
        print(row, flush=True)
    kernel.use_amx(previous)
    kernel.prefill_use_bf16_dot(True)
    write_result(args.out, isa=kernel.vector_isa(), task=args.task, layers=LAYERS, results=results)


if __name__ == "__main__":
    main()
