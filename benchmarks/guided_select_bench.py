"""The guided view's selection op (`guided_select`, engine/core/csrc/cpu_guided.cpp) on one round's
worth of tasks: 30 layers x 16 rows x 3 KV heads over 3,328 scores, sink 16, top 464 (budget 512,
window 32), without and with the compact store's refill, at three amounts of change between rounds
(scores = the last round's x (1 + noise x N(0, 1)); churn: the share of kept entries rewritten), with
`draft.floor` 0 (by score alone) and 1 (faint positions by recency), `draft.successors` 0 and 4 (each
position raised to its 4 predecessors' scores first), for scores u^8 (more positions above the floor's
bar than `top`: a selection by score) and u^32 (fewer: no selection), u uniform.
Median of 5 calls after one. Run it with PYTHONPATH at a checkout to time that checkout's op. Not a test.
"""

from __future__ import annotations

import time

import torch

from engine.core import kernels

LAYERS, ROWS, KV_HEADS, POSITIONS, HEAD_DIM = 30, 16, 3, 3328, 64
SINK, TOP, STORE_ENTRIES, CAPACITY = 16, 464, 1024 + 64, 4096


def time_rounds(op, base: torch.Tensor, with_store: bool, noise: float, floor: float, successors: int,
                repeats: int = 5) -> tuple[float, float]:
    """(median ms per call, mean churn) over `repeats` calls after a first one."""
    slots = torch.arange(ROWS)
    kept_end = torch.full((ROWS,), POSITIONS - 32, dtype=torch.long)
    kept = torch.zeros(LAYERS, ROWS, KV_HEADS, SINK + TOP, dtype=torch.long)
    hint = torch.zeros(LAYERS, ROWS, KV_HEADS)
    store = (None,) * 4
    if with_store:
        cache_k = torch.randn(LAYERS, ROWS, KV_HEADS, CAPACITY, HEAD_DIM)  # [layers, slots, kv_heads, capacity, D]
        cache_v = torch.randn_like(cache_k)
        store_k = torch.zeros(LAYERS, ROWS, KV_HEADS, STORE_ENTRIES, HEAD_DIM, dtype=torch.bfloat16)
        store = (store_k, torch.zeros_like(store_k), cache_k, cache_v)
    old_count = torch.zeros(ROWS, dtype=torch.long)
    times, churn = [], []
    for call in range(repeats + 1):
        scores = (base * (1 + noise * torch.randn_like(base))).abs().contiguous()  # [layers, B, kv_heads, N]
        start = time.perf_counter()
        changed = op.guided_select(scores, slots, kept_end, old_count, kept, hint, 1.0, floor, SINK, TOP, successors, *store)
        elapsed = time.perf_counter() - start
        old_count = torch.full((ROWS,), SINK + TOP, dtype=torch.long)
        if call:
            times.append(elapsed * 1e3)
            churn.append(changed / (LAYERS * ROWS * KV_HEADS * (SINK + TOP)))
    return sorted(times)[len(times) // 2], sum(churn) / len(churn)


def main() -> None:
    op = kernels.load()
    for peak in (8, 32):  # heavy-tailed, as attention mass is: ~24% / ~10% of positions above 1 / N
        base = torch.rand(LAYERS, ROWS, KV_HEADS, POSITIONS).pow(peak)
        base /= base.sum(-1, keepdim=True)  # per-query probabilities
        above = float((base >= 1 / (POSITIONS - 32)).sum(-1).float().mean())
        for floor in (0.0, 1.0):
            for successors in (0, 4):
                for noise in (0.0, 0.3, 1.0):
                    alone, _ = time_rounds(op, base, False, noise, floor, successors)
                    refilled, churn = time_rounds(op, base, True, noise, floor, successors)
                    print(f"u^{peak} ({above:.0f} positions above the bar), floor {floor}, successors {successors}, "
                          f"noise {noise}: selection {alone:.1f} ms, with the refill {refilled:.1f} ms (churn {churn:.2f})")


if __name__ == "__main__":
    main()
