"""The fused attention of one decode step over rows that share a prompt prefix, alone.

Not a test: a micro-benchmark behind BENCHMARKS.md section 19. It builds the default model's
attention shapes (30 layers, 3 KV heads of 64, 3 query heads per KV head) over random K/V: a batch
whose rows fall in groups, each group's slots holding the same K/V for `--shared` positions, and
each row `--own` more positions of its own (+ 17 per row, so the ends differ). It times
`attend_cached_shared` (a group's shared blocks read once) and `attend_cached` (every row on its
own) over all 30 layers at T new tokens a row, and asserts that both give the same bits. Each
layer's K/V is its own tensor, so the reads come from memory as in a job. Median of --repeats.
Writes JSON.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/shared_attention_bench.py --groups 5,4,4 \\
        --out benchmarks/results/shared_attention.json
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
    parser.add_argument("--groups", default="5,4,4", help="rows per group sharing a prefix")
    parser.add_argument("--shared", type=int, default=2688, help="shared positions (a multiple of 64)")
    parser.add_argument("--own", type=int, default=150, help="each row's own positions after them")
    parser.add_argument("--tokens", default="1,2", help="new tokens a row (T), comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    kernel = kernels.load()
    if kernel is None:
        raise SystemExit("shared_attention_bench: the fused CPU kernel is not available here")

    sizes = [int(n) for n in args.groups.split(",")]
    B = sum(sizes)
    capacity = args.shared + args.own + 17 * B + 64
    g = torch.Generator().manual_seed(0)
    k_layers, v_layers = [], []
    for _ in range(LAYERS):
        k = torch.randn(B, KV_HEADS, capacity, HEAD_DIM, generator=g)  # [slots, kv_heads, capacity, D]
        v = torch.randn(B, KV_HEADS, capacity, HEAD_DIM, generator=g)
        first = 0
        for size in sizes:  # a group's slots hold the same shared prefix
            k[first + 1:first + size, :, :args.shared] = k[first, :, :args.shared]
            v[first + 1:first + size, :, :args.shared] = v[first, :, :args.shared]
            first += size
        k_layers.append(k)
        v_layers.append(v)
    slots = torch.arange(B)
    members = torch.arange(B)
    offsets = torch.tensor([0] + [sum(sizes[:i + 1]) for i in range(len(sizes))])
    shared = torch.full((len(sizes),), args.shared)

    results = []
    for T in [int(t) for t in args.tokens.split(",")]:
        ends = torch.tensor([args.shared + args.own + 17 * b + T for b in range(B)])
        query = torch.randn(B, KV_HEADS, QUERY_HEADS_PER_KV * T, HEAD_DIM, generator=g)  # [B, kv_heads, R, D]

        def grouped():
            return [kernel.attend_cached_shared(query, k, v, slots, ends, T, members, offsets, shared)
                    for k, v in zip(k_layers, v_layers)]

        def per_row():
            return [kernel.attend_cached(query, k, v, slots, ends, T) for k, v in zip(k_layers, v_layers)]

        assert all(torch.equal(a, b) for a, b in zip(grouped(), per_row()))
        shared_ms, per_row_ms = (1e3 * median_seconds(fn, args.repeats) for fn in (grouped, per_row))
        row = {"T": T, "rows": B, "shared_ms": round(shared_ms, 2), "per_row_ms": round(per_row_ms, 2)}
        results.append(row)
        print(row, flush=True)
    write_result(args.out, isa=kernel.vector_isa(), groups=sizes, shared=args.shared,
                 own=args.own, results=results)


if __name__ == "__main__":
    main()
