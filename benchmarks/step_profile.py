"""Where one plain decode step of the engine goes: GEMMs, the attention kernel, everything else.

Not a test and not `magicdec bench`: a breakdown of the step `bench` times, on the real default model
with a cache of random K/V (a step's cost does not depend on the values). Reports the step's median
time, the self time of `aten::mm` (every linear layer and the lm_head) and of all other aten ops from
`torch.profiler`, the fused attention kernel timed alone over the same cache, and `sum()` over the
same K and V as the streaming yardstick. Writes JSON.

    .venv/bin/python benchmarks/step_profile.py --batch 16 --context 4096 --out benchmarks/results/step_profile.json
"""

from __future__ import annotations

import json
import platform
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.core import kernels as cpu_kernels
from engine.core.attention import ForwardBatch
from decode_setup import median_seconds, random_cache_runner, step_arguments


def main() -> None:
    args = step_arguments(__doc__, context=4096, repeats=9, out="benchmarks/results/step_profile.json").parse_args()
    B, L = args.batch, args.context

    loaded, runner, tokens = random_cache_runner(B, L)  # tokens: [B, 1], one new token per row
    generator = torch.Generator().manual_seed(1)

    def step():
        runner.forward(tokens, ForwardBatch(runner.cache, list(range(B)), [L] * B, 1), last_only=True)

    step_s = median_seconds(step, args.repeats)
    profiled_steps = 5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profiled_steps):
            step()
    events = prof.key_averages()
    mm_us = sum(e.self_cpu_time_total for e in events if e.key == "aten::mm")
    other_us = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::") and e.key != "aten::mm")

    cache = runner.cache
    kv_heads, head_dim = cache.kv_heads, cache.head_dim
    heads = loaded.model.config.num_attention_heads
    query = torch.randn(B, kv_heads, heads // kv_heads, head_dim, generator=generator)  # [B, kv_heads, group, D]
    slots, ends = torch.arange(B), torch.full((B,), L)
    kernel = cpu_kernels.load()
    kernel_s = None
    if kernel is not None:
        kernel_s = median_seconds(lambda: [kernel.attend_cached(query, cache.k[layer], cache.v[layer], slots, ends, 1)
                                           for layer in range(cache.layers)], args.repeats)
    k_used, v_used = cache.k[:, :, :, :L], cache.v[:, :, :, :L]  # [layers, B, kv_heads, L, D] views
    sum_s = median_seconds(lambda: [(k_used[layer].sum(), v_used[layer].sum()) for layer in range(cache.layers)],
                           args.repeats)
    kv_bytes = 2 * k_used.numel() * k_used.element_size()

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "batch": B, "context": L,
        "step_ms": 1e3 * step_s,
        "gemm_ms": mm_us / 1e3 / profiled_steps,
        "other_aten_ms": other_us / 1e3 / profiled_steps,
        "attention_kernel_ms": None if kernel_s is None else 1e3 * kernel_s,
        "kv_bytes": kv_bytes,
        "attention_kernel_gb_per_s": None if kernel_s is None else kv_bytes / kernel_s / 1e9,
        "sum_over_same_kv_ms": 1e3 * sum_s,
        "sum_gb_per_s": kv_bytes / sum_s / 1e9,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
