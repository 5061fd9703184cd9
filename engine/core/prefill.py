"""Prefill: admitted rows' prompts into their cache slots, packed into forwards of `chunk` tokens.

`prefill_rows` caches the prompts of several rows (one admission wave) in one model's cache: with a
`PrefixStore`, each row's longest stored prefix is copied in instead of computed (never the last
token, whose logits start the row, nor a listener's observation window, which must be the row's own
queries); the rest of every row is cut into segments and packed along the token axis, `chunk` tokens
per forward (a row's prompt in consecutive segments, in order), so the linear layers run at a large M
whatever the rows' lengths; then each row's full blocks are stored for later rows. A `SlotListener` (a
draft's compressor) may ask for the queries of the prompt's last `observe_window` positions (SnapKV's
observation window), which a `QueryWindow` captures as the forwards pass, together with those
queries' attention mass over the prompt where the attention backend returns it (the fused kernel and
the torch path do; the listener then needs no second pass), and is told when a slot's prompt is
cached. Rows whose prompts share a prefix should not be in one wave (the scheduler splits waves so),
or they compute it twice. This module knows nothing of speculation or scheduling.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import torch

from engine.core.prefill_attention import PrefillBatch, Segment
from engine.core.prefix_store import PrefixStore
from engine.core.runner import ModelRunner


class SlotListener(Protocol):
    """What follows a cache slot's life (a draft's KV compressor): prompt cached, tokens committed, freed."""

    observe_window: int  # trailing prompt queries it needs at prefill (0: none)

    def prefill_done(self, slot: int, prompt_len: int, observed: torch.Tensor | None,
                     mass: torch.Tensor | None = None) -> None:
        """observed: [layers, heads, window, head_dim] (the last `window` prompt queries) or None; mass:
        [layers, kv_heads, prompt_len] float32, their softmax attention on each position summed over the
        window and each GQA group's heads, when the prefill computed it (else None)."""

    def committed(self, slot: int, length: int) -> None: ...

    def release(self, slot: int) -> None: ...


class QueryWindow:
    """Captures, during one row's prefill, the queries of its positions >= observe_from (all layers),
    and the attention mass they put on the prompt where the backend hands it over (`add_mass`)."""

    def __init__(self, layers: int, heads: int, kv_heads: int, window: int, head_dim: int, observe_from: int,
                 device: torch.device, dtype: torch.dtype):
        self.observe_from = observe_from
        self.queries = torch.zeros(layers, heads, window, head_dim, dtype=dtype, device=device)
        self.mass_shape = (layers, kv_heads, observe_from + window)
        self._mass: torch.Tensor | None = None  # [layers, kv_heads, prompt_len] float32, allocated on first use
        self.mass_tokens = [0] * layers  # window tokens whose mass each layer has added

    def add_mass(self, layer: int, mass: torch.Tensor, tokens: int) -> None:
        """mass: [kv_heads, end] of `tokens` window tokens, the last at position end - 1."""
        if self._mass is None:
            self._mass = torch.zeros(self.mass_shape, dtype=torch.float32, device=mass.device)
        self._mass[layer, :, :mass.shape[-1]] += mass
        self.mass_tokens[layer] += tokens

    @property
    def mass(self) -> torch.Tensor | None:
        """[layers, kv_heads, prompt_len]: the whole window's mass, if every layer saw all of it."""
        window = self.queries.shape[2]
        return self._mass if all(n == window for n in self.mass_tokens) else None

    def observe(self, layer: int, query: torch.Tensor, start: int) -> None:
        """query: [heads, T, head_dim] of positions start .. start + T - 1."""
        lo = max(self.observe_from, start)
        hi = start + query.shape[1]
        if lo < hi:
            self.queries[layer, :, lo - self.observe_from: hi - self.observe_from] = query[:, lo - start: hi - start]


@dataclasses.dataclass
class RowPrefill:
    """One row of a wave: its slot and prompt, and what its prefill found and produced."""

    slot: int
    prompt_ids: list[int]
    reused: int = 0  # prompt tokens copied from the prefix store
    origin: list[int] = dataclasses.field(default_factory=list)  # serials of the store blocks its first blocks hold
    logits: torch.Tensor | None = None  # [vocab] of the prompt's last position
    window: QueryWindow | None = None


def prefill_rows(runner: ModelRunner, rows: list[RowPrefill], chunk: int, listener: SlotListener | None = None,
                 store: PrefixStore | None = None, *, on_chunk: Callable[[], None] | None = None) -> None:
    """Cache every row's prompt in its slot (see the module docstring); fills each row's `logits` and `reused`.

    on_chunk: called before each packed forward (an observer's chance to look at the clock)."""
    cache = runner.cache
    for row in rows:
        n = len(row.prompt_ids)
        window = min(listener.observe_window, n) if listener is not None else 0
        if window:
            row.window = QueryWindow(runner.layers, runner.heads, cache.kv_heads, window, runner.head_dim,
                                     n - window, runner.device, runner.loaded.dtype)
        cache.clear(row.slot)
        if store is not None:
            blocks = store.match(row.prompt_ids)
            row.reused = max(min(len(blocks) * store.block, n - max(window, 1)), 0)
            store.stats.lookups += 1
            if row.reused:
                store.stats.hits += 1
                store.load(cache, row.slot, blocks, row.reused)
            row.origin = [block.serial for block in blocks[: row.reused // store.block]]
    for pack in _packs(rows, chunk):
        if on_chunk is not None:
            on_chunk()
        segments = [Segment(row.slot, start, length, row.window) for row, start, length in pack]
        tokens = torch.tensor([t for row, start, length in pack for t in row.prompt_ids[start:start + length]],
                              dtype=torch.long, device=runner.device)  # [N]
        logits = runner.prefill(tokens, PrefillBatch(cache, segments))  # [S, vocab]
        for (row, start, length), last in zip(pack, logits):
            if start + length == len(row.prompt_ids):
                row.logits = last
    for row in rows:
        n = len(row.prompt_ids)
        cache.set_length(row.slot, n)
        if store is not None:
            written = store.insert(cache, row.slot, row.prompt_ids)
            while len(row.origin) in written:  # blocks the store now holds from this very slot
                row.origin.append(written[len(row.origin)])
            cache.set_origin(row.slot, tuple(row.origin), store.block)
        if listener is not None:
            if row.window is None:
                listener.prefill_done(row.slot, n, None)
            else:
                listener.prefill_done(row.slot, n, row.window.queries, mass=row.window.mass)


def _packs(rows: list[RowPrefill], chunk: int):
    """Forwards of at most `chunk` tokens: lists of (row, start, length), each row's tokens in order."""
    pack, room = [], chunk
    for row in rows:
        start, n = row.reused, len(row.prompt_ids)
        while start < n:
            length = min(room, n - start)
            pack.append((row, start, length))
            start += length
            room -= length
            if room == 0:
                yield pack
                pack, room = [], chunk
    if pack:
        yield pack


def shared_blocks(a: list[int], b: list[int], block: int) -> int:
    """How many full blocks two prompts start with in common."""
    count, most = 0, min(len(a), len(b)) // block
    while count < most and a[count * block:(count + 1) * block] == b[count * block:(count + 1) * block]:
        count += 1
    return count
