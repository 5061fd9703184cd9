"""Times one layer's decode attention on CUDA, torch's SDPA path against the per-row torch path, on
Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head size 128, bf16), and writes the JSON.

Usage: python benchmarks/cuda_attention_bench.py OUT.json [--batch 16,64] [--context 8192,32768]
Not a test: it needs a CUDA GPU and only measures (both paths are checked against the reference in
tests/test_attention.py).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.core import sdpa_attention
from engine.core.attention import ForwardBatch, attend_cached_torch
from engine.core.kv_cache import KVCache

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch", default="16,64")
    parser.add_argument("--context", default="8192,32768")
    parser.add_argument("--new", type=int, default=1, help="new tokens per row (1: decode, gamma + 1: verify)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for batch_size in map(int, args.batch.split(",")):
        for context in map(int, args.context.split(",")):
            cache = KVCache(layers=1, slots=batch_size, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                            capacity=context + args.new, dtype=torch.bfloat16, device="cuda")
            cache.k.normal_(), cache.v.normal_()
            batch = ForwardBatch(cache, list(range(batch_size)), [context] * batch_size, args.new)
            query = torch.randn(batch_size, HEADS, args.new, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            scale = HEAD_DIM ** -0.5
            kv_bytes = 2 * batch_size * KV_HEADS * (context + args.new) * HEAD_DIM * 2  # K and V read once
            row = {"batch": batch_size, "context": context, "new_tokens": args.new, "kv_bytes": kv_bytes}
            row["sdpa_ms"] = 1e3 * timed(lambda: sdpa_attention.attend_rows(
                query, cache.k[0], cache.v[0], batch.slots, batch.slot_tensor, batch.start_tensor,
                max(batch.ends), scale),
                args.repeats)
            row["per_row_torch_ms"] = 1e3 * timed(lambda: attend_cached_torch(
                query, cache.k[0], cache.v[0], batch, scale), args.repeats)
            for path in ("sdpa", "per_row_torch"):
                row[f"{path}_gb_s"] = kv_bytes / (row[f"{path}_ms"] * 1e-3) / 1e9
            print(json.dumps(row), flush=True)
            rows.append(row)
            del cache
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
