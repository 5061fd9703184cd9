"""A draft step's attention over a compact store (`attend_entries`), one layer, for the two layouts
the drafts keep there: StreamingLLM's (sinks, then a ring that shows nearly all of its entries) and
SnapKV's / guided's (`budget - window` chosen entries, then a ring of `budget + extra` entries of
which the view shows only the newest `window`). The same number of entries is shown in both, so a
difference is what the hidden ring blocks cost. Batch 16, 3 KV heads of 64 dims, 3 query heads per
KV head, one new token, bfloat16 store, random values (the cost does not depend on them). Median of
200 calls. Run it with PYTHONPATH at a checkout to time that checkout's kernel. Not a test.

    PYTHONPATH=. .venv/bin/python benchmarks/entries_layout_bench.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.core import kernels

ROWS, KV_HEADS, GROUP, HEAD_DIM, WINDOW, EXTRA = 16, 3, 3, 64, 32, 9


def time_layout(op, size: int, shown: list[tuple[int, int]], repeats: int = 200) -> float:
    """Median ms of one call over a store of `size` entries per row showing the entry ranges `shown`."""
    entry_pos = torch.full((ROWS, size), -1, dtype=torch.long)  # [B, S]: the position each entry holds
    position = 0
    for first, stop in shown:
        entry_pos[:, first:stop] = torch.arange(position, position + stop - first)
        position += stop - first
    k = torch.randn(ROWS, KV_HEADS, size, HEAD_DIM).to(torch.bfloat16)  # [slots, kv_heads, S, D]
    v = torch.randn(ROWS, KV_HEADS, size, HEAD_DIM).to(torch.bfloat16)
    query = torch.randn(ROWS, KV_HEADS, GROUP, HEAD_DIM)  # [B, kv_heads, group * T, D]
    slots, ends = torch.arange(ROWS), torch.full((ROWS,), position + 1, dtype=torch.long)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op.attend_entries(query, k, v, slots, ends, 1, entry_pos)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    op = kernels.load()
    for budget in (512, 1024):
        ring = budget + EXTRA
        sinks = time_layout(op, 16 + ring, [(0, budget)])
        kept = budget - WINDOW
        chosen = time_layout(op, kept + ring, [(0, kept), (kept + 100, kept + 100 + WINDOW)])
        print(f"budget {budget}, {args.threads} threads: StreamingLLM's layout {sinks:.3f} ms, "
              f"SnapKV's / guided's {chosen:.3f} ms a layer")


if __name__ == "__main__":
    main()
