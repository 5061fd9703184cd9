"""Prefill: a row's prompt into its cache slot, in chunks, for every model that keeps a cache of it.

`prefill_row` runs the prompt through one `ModelRunner` in `batch.prefill_chunk`-token forwards,
writing K/V at the slot's positions 0..n-1, and returns the last position's logits. With a
`PrefixStore`, the longest stored prefix of the prompt is copied in instead of computed (never the
last token, whose logits start the row, nor a listener's observation window, which must be the
row's own queries), and the row's own full blocks are stored for later rows. A `SlotListener` (a
draft's compressor) may ask for the queries of the prompt's last `observe_window` positions
(SnapKV's observation window), which `QueryWindow` captures as the forwards pass, and is told when
the slot's prompt is cached. This module knows nothing of speculation or scheduling.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine.core.attention import ForwardBatch
from engine.core.prefix_store import PrefixStore
from engine.core.runner import ModelRunner


class SlotListener(Protocol):
    """What follows a cache slot's life (a draft's KV compressor): prompt cached, tokens committed, freed."""

    observe_window: int  # trailing prompt queries it needs at prefill (0: none)

    def prefill_done(self, slot: int, prompt_len: int, observed: torch.Tensor | None) -> None:
        """observed: [layers, heads, window, head_dim] (the last `window` prompt queries) or None."""

    def committed(self, slot: int, length: int) -> None: ...

    def release(self, slot: int) -> None: ...


class QueryWindow:
    """Captures, during one row's prefill, the queries of positions >= observe_from (all layers)."""

    def __init__(self, layers: int, heads: int, window: int, head_dim: int, observe_from: int,
                 device: torch.device, dtype: torch.dtype):
        self.observe_from = observe_from
        self.queries = torch.zeros(layers, heads, window, head_dim, dtype=dtype, device=device)

    def observe(self, layer: int, query: torch.Tensor, batch: ForwardBatch) -> None:
        start = batch.starts[0]
        lo = max(self.observe_from, start)
        hi = start + batch.num_new
        if lo < hi:  # query: [1, heads, T, D]
            self.queries[layer, :, lo - self.observe_from: hi - self.observe_from] = \
                query[0, :, lo - start: hi - start]


def prefill_row(runner: ModelRunner, slot: int, prompt_ids: list[int], chunk: int,
                listener: SlotListener | None = None, store: PrefixStore | None = None, *,
                on_chunk: Callable[[], None] | None = None) -> tuple[torch.Tensor, int]:
    """Cache one row's prompt in `slot` (chunked), reusing a stored prefix; tell the listener.

    on_chunk: called before each chunk's forward (an observer's chance to look at the clock).

    Returns the last position's logits [1, vocab] and how many prompt tokens were reused, not computed.
    """
    n = len(prompt_ids)
    window = min(listener.observe_window, n) if listener is not None else 0
    observer = None
    if window:
        observer = QueryWindow(runner.layers, runner.heads, window, runner.head_dim, n - window,
                               runner.device, runner.loaded.dtype)
    runner.cache.clear(slot)
    reused = 0
    if store is not None:
        blocks = store.match(prompt_ids)
        reused = min(len(blocks) * store.block, n - max(window, 1))
        store.stats.lookups += 1
        if reused > 0:
            store.stats.hits += 1
            store.load(runner.cache, slot, blocks, reused)
    tokens = torch.tensor(prompt_ids, dtype=torch.long, device=runner.device)  # [n]
    logits = None
    for start in range(reused, n, chunk):
        if on_chunk is not None:
            on_chunk()
        piece = tokens[start: start + chunk]
        batch = ForwardBatch(runner.cache, [slot], [start], len(piece), observer=observer)
        logits = runner.forward(piece[None], batch, last_only=True)[:, -1]
    runner.cache.set_length(slot, n)
    if store is not None:
        store.insert(runner.cache, slot, prompt_ids)
    if listener is not None:
        listener.prefill_done(slot, n, observer.queries if observer is not None else None)
    return logits, reused
