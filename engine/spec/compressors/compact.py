"""A draft's own compact KV store: its kept positions plus a ring of the newest ones, in bfloat16.

When the kept part of a view does not depend on the query (StreamingLLM's sinks, SnapKV's chosen
prompt positions, the guided view between two rounds), a draft step reads at most `budget` known entries per row, layer and KV head. Read
through a list of positions from the float32 cache, that is a gather of full-precision rows; stored
here side by side in bfloat16 it is a stream of half the bytes, and on a 2-core CPU the draft's
attention over a 512-entry view costs about half as much (BENCHMARKS.md). This is MagicDec's
"small KV cache of the draft", kept in step with the target's:

- `fill` at the end of a slot's prefill: the kept positions (per layer and KV head, as the compressor
  chose them) and the newest prompt positions, copied from the cache.
- The lean draft forward (`engine.draft_forward`) writes the K/V of the tokens it drafts straight
  here, at `rows_for(positions)`.
- `copy_committed` (self-speculation): after a round, the newest `extra` positions up to the committed
  length are to come from the target cache, where verification wrote the target's own K/V (what the
  full-cache view would read). The copy waits until a draft next reads the slot (`sync`, when a view
  is made): under `gamma: auto` most rounds may be plain, and their K/V then go over in one copy of
  the positions a view can show, not one copy a round. A separate draft model keeps its own K/V: it
  wrote them while drafting.
- `refill` (a guided view, whose kept part changes every round): the kept entries whose position
  changed take that position's K/V from the cache.

Layout: k, v [layers, slots, kv_heads, S, D] with S = kept + ring; entries [0, kept) hold the kept
positions, entry kept + p % ring holds position p; `entry_pos` [slots, S] is the position each entry
holds (-1: empty). With `sinks` (StreamingLLM) kept entry p holds position p < kept, whoever writes
it (a prompt shorter than the sinks gets its later sinks from decoding); otherwise kept entries record
0 (their positions differ per layer and KV head, and precede every query). The ring holds
`budget + extra` positions (extra: the most tokens a round drafts past the committed length), so no
position a view may still show is overwritten. Only the float32-cache path reads positions lists;
this module neither chooses positions (compressors do) nor attends (the C++ kernel does).
"""

from __future__ import annotations

import torch

from engine.core.kv_cache import KVCache


class CompactStore:
    """One compressor's store for every slot; see the module docstring for the layout."""

    def __init__(self, cache: KVCache, *, kept: int, budget: int, extra: int, copy_committed: bool,
                 sinks: bool = False, dtype: torch.dtype = torch.bfloat16):
        """kept: entries reserved for kept positions; extra: speculative positions beyond the view;
        sinks: the kept positions are 0 .. kept - 1 (StreamingLLM)."""
        self.cache = cache
        self.kept, self.budget = kept, budget
        self.ring = budget + extra
        self.extra = extra
        self.copy_from_cache = copy_committed
        self.sinks = sinks
        size = kept + self.ring
        shape = (cache.layers, cache.slots, cache.kv_heads, size, cache.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=cache.device)  # [layers, slots, kv_heads, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=cache.device)
        self.entry_pos = torch.full((cache.slots, size), -1, dtype=torch.long, device=cache.device)  # [slots, S]
        self.stale: dict[int, tuple[int, int]] = {}  # slot -> positions [start, length) not copied yet

    @staticmethod
    def bytes_needed(*, layers: int, slots: int, kv_heads: int, head_dim: int, kept: int, budget: int,
                     extra: int, dtype: torch.dtype = torch.bfloat16) -> int:
        return 2 * layers * slots * kv_heads * (kept + budget + extra) * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def rows_for(self, positions: torch.Tensor) -> torch.Tensor:
        """The entry of each position (any shape of int64 positions): its sink entry, or the ring's."""
        rows = self.kept + positions % self.ring
        return torch.where(positions < self.kept, positions, rows) if self.sinks else rows

    def fill(self, slot: int, kept: torch.Tensor, recent_start: int, length: int) -> None:
        """A slot's prefill is cached: store its kept positions kept [layers, kv_heads, n] (n <= self.kept)
        and the positions [recent_start, length)."""
        layers, kv_heads, n = kept.shape
        self.entry_pos[slot] = -1
        self.stale.pop(slot, None)
        if n:
            # whole K/V rows by index_select (a row copy each; an element-wise gather took several times longer)
            device, D = kept.device, self.cache.head_dim
            layer = torch.arange(layers, device=device)[:, None, None]  # [layers, 1, 1]
            head = torch.arange(kv_heads, device=device)[None, :, None]  # [1, kv_heads, 1]
            source = self._cache_rows(layer, slot, head, kept)  # [layers, kv_heads, n]
            for store, full in ((self.k, self.cache.k), (self.v, self.cache.v)):
                rows = full.view(-1, D).index_select(0, source.reshape(-1))  # [layers * kv_heads * n, D]
                store[:, slot, :, :n] = rows.view(layers, kv_heads, n, D)
            self.entry_pos[slot, :n] = torch.arange(n, device=self.k.device) if self.sinks else 0
        self._copy(slot, max(recent_start, length - self.ring), length)

    def copy_committed(self, slot: int, length: int) -> None:
        """The slot committed positions up to `length`: the target's K/V of the round's ones (a round
        verifies at most `extra` positions) are due, copied at the slot's next `sync`."""
        if self.copy_from_cache:
            start = max(length - self.extra, 0)
            if slot in self.stale:
                start = min(start, self.stale[slot][0])
            self.stale[slot] = (start, length)

    def sync(self, slots: list[int]) -> None:
        """Copy what `copy_committed` left due for these slots, in one copy per slot: the due positions
        a view can still show (a draft reads at ends > length, and shows at most the newest `budget`
        ring positions). Older ones stay as they are, hidden; so do the entries a round drafts into
        (positions >= length, ring entries of positions < length - budget), whichever comes first."""
        for slot in slots:
            due = self.stale.pop(slot, None)
            if due is not None:
                start, length = due
                self._copy(slot, max(start, length - self.budget, 0), length)

    def _copy(self, slot: int, start: int, length: int) -> None:
        """Positions [start, length) of the cache into their entries (start >= length - ring)."""
        if length > start:
            positions = torch.arange(start, length, device=self.k.device)  # [n]
            rows = self.rows_for(positions)
            self.k[:, slot, :, rows] = self.cache.k[:, slot, :, start:length].to(self.k.dtype)
            self.v[:, slot, :, rows] = self.cache.v[:, slot, :, start:length].to(self.v.dtype)
            self.entry_pos[slot, rows] = positions

    def refill(self, layer: torch.Tensor, slot: torch.Tensor, head: torch.Tensor, entry: torch.Tensor,
               position: torch.Tensor) -> None:
        """Kept entries whose position changed (a guided view): entry `entry[i]` of (layer[i], slot[i],
        head[i]) takes the cache's K/V at `position[i]` (all [n] int64, entry < kept)."""
        cache = self.cache
        D, S = cache.head_dim, self.k.shape[3]
        plane = (layer * cache.slots + slot) * cache.kv_heads + head  # [n]: (layer, slot, head) block
        source = self._cache_rows(layer, slot, head, position)  # [n]
        target = plane * S + entry  # [n] rows of the store viewed as [-1, D]
        for store, full in ((self.k, cache.k), (self.v, cache.v)):
            store.view(-1, D).index_copy_(0, target, full.view(-1, D).index_select(0, source).to(store.dtype))

    def _cache_rows(self, layer, slot, head, position) -> torch.Tensor:
        """The rows of the cache viewed as [-1, D] that hold (layer, slot, KV head, position) (int64
        tensors or ints, broadcast together)."""
        cache = self.cache
        return ((layer * cache.slots + slot) * cache.kv_heads + head) * cache.capacity + position

    def release(self, slot: int) -> None:
        self.entry_pos[slot] = -1
        self.stale.pop(slot, None)

    def visible(self, slots: torch.Tensor, ends: torch.Tensor, kept_count: torch.Tensor,
                kept_end: torch.Tensor) -> torch.Tensor:
        """The position each entry shows to rows whose newest token is at ends - 1, else -1: [B, S].

        The same rule as `compose_view`: the first kept_count kept entries, and the newest
        budget - kept_count positions at or after kept_end.
        """
        pos = self.entry_pos.index_select(0, slots)  # [B, S]
        kept, ring = pos[:, : self.kept], pos[:, self.kept:]
        kept_shown = ((torch.arange(self.kept, device=pos.device)[None, :] < kept_count[:, None])
                      & (kept >= 0) & (kept < ends[:, None]))
        lowest = torch.maximum(kept_end, ends - (self.budget - kept_count))  # [B]
        ring_shown = (ring >= lowest[:, None]) & (ring < ends[:, None])
        shown = torch.cat([kept_shown, ring_shown], dim=1)
        return torch.where(shown, pos, torch.full_like(pos, -1))
