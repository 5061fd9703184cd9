"""PQCache's prefill cost per row: the k-means and codes of one prompt's keys, C++ op against torch.

`PQCache.prefill_done` fits 2^bits centroids per (layer, KV head, sub-space) on up to `kmeans_sample`
keys and encodes every key; its nearest-centroid step runs either as the C++ op `pq_nearest` or as
torch's batched matmul (`engine.spec.compressors.pqcache.nearest`). This times one slot's
`prefill_done` both ways on a cache of random keys shaped like the default model's (30 layers, 3 KV
heads, head size 64), alternating the two, and checks that the codes agree on nearly every key (two
centroids within a rounding error of each other may swap). Example:

    .venv/bin/python benchmarks/pq_codes_bench.py --context 3328 --repeats 3 \\
        --out benchmarks/results/pq_codes/prefill_3328.json

Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from decode_setup import write_result
from engine.config.schema import DraftConfig
from engine.core import kernels
from engine.core.kv_cache import KVCache
from engine.spec.compressors.pqcache import PQCache


def timed_prefill(config: DraftConfig, cache: KVCache, context: int, use_kernel: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one slot's prefill_done, and the codes it wrote [layers, kv_heads, context, subspaces]."""
    load = kernels.load
    if not use_kernel:
        kernels.load = lambda: None
    try:
        method = PQCache(config, cache, num_heads=9)
        started = time.perf_counter()
        method.prefill_done(0, context, None)
        return time.perf_counter() - started, method.codes[:, 0, :, :context].clone()
    finally:
        kernels.load = load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=3328)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--subspaces", type=int, default=16)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if kernels.load() is None:
        raise SystemExit("the C++ kernels are not built here: nothing to compare")
    cache = KVCache(layers=30, slots=1, kv_heads=3, head_dim=64, capacity=args.context, dtype=torch.float32,
                    device="cpu")
    cache.k.normal_(generator=torch.Generator().manual_seed(0))  # [layers, 1, kv_heads, context, 64]
    config = DraftConfig(method="pqcache", budget=512, sink=16, window=32, subspaces=args.subspaces, bits=args.bits)
    seconds = {"kernel": [], "torch": []}
    codes = {}
    for _ in range(args.repeats):
        for name in ("kernel", "torch"):
            s, codes[name] = timed_prefill(config, cache, args.context, use_kernel=name == "kernel")
            seconds[name].append(s)
    agree = float((codes["kernel"] == codes["torch"]).float().mean())
    best = {name: min(values) for name, values in seconds.items()}
    print(f"prefill_done of one {args.context}-token slot: kernel {best['kernel']:.2f} s, torch {best['torch']:.2f} s "
          f"({best['torch'] / best['kernel']:.1f}x); codes agree on {agree:.4%} of keys x sub-spaces")
    write_result(args.out, context=args.context, subspaces=args.subspaces, bits=args.bits, seconds=seconds,
                 best_s=best, speedup=best["torch"] / best["kernel"], codes_agree=agree)


if __name__ == "__main__":
    main()
