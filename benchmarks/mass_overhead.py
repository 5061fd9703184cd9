"""What asking verification for the attention mass (the guided draft's scores) costs: the same
verification forward timed with and without `ForwardBatch.mass`, side by side.

Not a test and not `magicdec bench`: the real default model over a cache of random K/V (a forward's
cost does not depend on the values), `--tokens` new tokens per row (gamma + 1). Each repeat times
the two forwards back to back, alternating which goes first, so drift on a shared machine hits both
alike; reports their medians and the ratio, for the whole verification forward and for the fused
attention kernel alone (`attend_cached` against `attend_cached_scores` on one layer's cache). The
issue's bar: with mass / without <= ~1.05. Writes JSON.

    .venv/bin/python benchmarks/mass_overhead.py --batch 16 --context 3328 --tokens 4 \
        --out benchmarks/results/mass_overhead.json
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch

from engine.core import kernels as cpu_kernels
from engine.core.attention import ForwardBatch
from decode_setup import random_cache_runner, step_arguments


def side_by_side(plain, with_mass, repeats: int) -> dict[str, float]:
    """Median seconds of each of two callables timed in alternating pairs, and their ratio."""
    plain(), with_mass()  # warm
    times = {"plain": [], "mass": []}
    for r in range(repeats):
        order = [("plain", plain), ("mass", with_mass)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    plain_s, mass_s = statistics.median(times["plain"]), statistics.median(times["mass"])
    return {"plain_ms": 1e3 * plain_s, "mass_ms": 1e3 * mass_s, "ratio": mass_s / plain_s}


def main() -> None:
    parser = step_arguments(__doc__, context=3328, repeats=15, out="benchmarks/results/mass_overhead.json")
    parser.add_argument("--tokens", type=int, default=4, help="new tokens per row (gamma + 1)")
    args = parser.parse_args()
    B, L, T = args.batch, args.context, args.tokens
    kernel = cpu_kernels.load()
    if kernel is None:
        raise SystemExit("the fused CPU kernel could not be built here: nothing to measure")
    loaded, runner, _ = random_cache_runner(B, L + T)
    cache = runner.cache
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1000, (B, T), generator=generator)  # [B, T]: the pending token + drafts
    slots, starts = list(range(B)), [L] * B
    mass = torch.empty(cache.layers, B, cache.kv_heads, L + T, dtype=torch.float32)  # [layers, B, kv_heads, N]

    def verify(with_mass: bool):
        batch = ForwardBatch(cache, slots, starts, T, mass=mass if with_mass else None)
        return runner.forward(tokens, batch)  # all T tokens' logits, as verification asks

    forward = side_by_side(lambda: verify(False), lambda: verify(True), args.repeats)

    heads, D = loaded.config.num_attention_heads, cache.head_dim
    q = torch.randn(B, cache.kv_heads, (heads // cache.kv_heads) * T, D, generator=generator) * D ** -0.5
    slot_t, ends = torch.arange(B), torch.full((B,), L + T)
    k0, v0 = cache.k[0], cache.v[0]  # [slots, kv_heads, capacity, D]
    attention = side_by_side(lambda: kernel.attend_cached(q, k0, v0, slot_t, ends, T),
                             lambda: kernel.attend_cached_scores(q, k0, v0, slot_t, ends, T, L + T),
                             args.repeats * 4)
    result = {
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "isa": kernel.vector_isa(), "batch": B, "context": L, "tokens": T, "repeats": args.repeats,
        "layers": cache.layers, "kv_heads": cache.kv_heads, "head_dim": D,
        "verify_forward": forward, "attention_one_layer": attention,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
