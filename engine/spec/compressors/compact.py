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

Layout: k, v [layers, slots, kv_heads, S, D]; slot b's entries [0, ring_start[b]) hold its kept
positions, entry ring_start[b] + p % (S - ring_start[b]) holds position p (its ring); `entry_pos`
[slots, S] is the position each entry holds (-1: empty). With `sinks` (StreamingLLM) kept entry p
holds position p < kept, whoever writes it (a prompt shorter than the sinks gets its later sinks from
decoding); otherwise kept entries record 0 (their positions differ per layer and KV head, and precede
every query). A ring must hold the newest positions its view may still show, `budget - kept count`,
plus `extra` (the most tokens a round drafts past the committed length), so that none of them is
overwritten:
- by default S = kept + budget + extra and every slot's ring starts at `kept` (StreamingLLM, whose
  sinks sit at their own positions);
- with `ring_per_slot` (SnapKV, guided) S = budget + extra and a slot's ring starts right after its
  own kept count: half the store at budget 1,024, and a draft step's scan over it half as long
  (BENCHMARKS.md sections 36-38). SnapKV's kept count is fixed at prefill; a guided view's grows
  while a row is shorter than the budget, and then `move_ring` starts the ring after the new count
  and fills it again from the cache.
Only the float32-cache path reads positions lists; this module neither chooses positions
(compressors do) nor attends (the C++ kernel does).
"""

from __future__ import annotations

import torch

from engine.core.kv_cache import KVCache


class CompactStore:
    """One compressor's store for every slot; see the module docstring for the layout."""

    def __init__(self, cache: KVCache, *, kept: int, budget: int, extra: int, copy_committed: bool,
                 sinks: bool = False, ring_per_slot: bool = False, dtype: torch.dtype = torch.bfloat16):
        """kept: entries reserved for kept positions (the most a slot keeps); extra: speculative
        positions beyond the view; sinks: the kept positions are 0 .. kept - 1 (StreamingLLM);
        ring_per_slot: each slot's ring starts after the kept count its `fill` gives (until a `move_ring`)."""
        assert not (sinks and ring_per_slot), "sinks sit at their own positions, before a ring of budget + extra"
        self.cache = cache
        self.kept, self.budget = kept, budget
        self.extra = extra
        self.copy_from_cache = copy_committed
        self.sinks = sinks
        self.ring_per_slot = ring_per_slot
        size = self.entries(kept=kept, budget=budget, extra=extra, ring_per_slot=ring_per_slot)
        shape = (cache.layers, cache.slots, cache.kv_heads, size, cache.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=cache.device)  # [layers, slots, kv_heads, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=cache.device)
        self.entry_pos = torch.full((cache.slots, size), -1, dtype=torch.long, device=cache.device)  # [slots, S]
        self.ring_start = torch.full((cache.slots,), kept, dtype=torch.long, device=cache.device)  # [slots]
        self.stale: dict[int, tuple[int, int]] = {}  # slot -> positions [start, length) not copied yet

    @staticmethod
    def entries(*, kept: int, budget: int, extra: int, ring_per_slot: bool = False) -> int:
        """S, the entries a slot has: its ring after at most `kept` kept ones never shows more than
        budget - (kept count) positions at once, plus the round's extra."""
        return budget + extra if ring_per_slot else kept + budget + extra

    @classmethod
    def bytes_needed(cls, *, layers: int, slots: int, kv_heads: int, head_dim: int, kept: int, budget: int,
                     extra: int, ring_per_slot: bool = False, dtype: torch.dtype = torch.bfloat16) -> int:
        size = cls.entries(kept=kept, budget=budget, extra=extra, ring_per_slot=ring_per_slot)
        return 2 * layers * slots * kv_heads * size * head_dim * dtype.itemsize

    def ring_of(self, slot: int) -> int:
        """How many positions the slot's ring holds."""
        return self.k.shape[3] - int(self.ring_start[slot])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def rows_for(self, positions: torch.Tensor, slots: torch.Tensor | int) -> torch.Tensor:
        """The entry of each position (int64 positions of any shape, slots broadcasting with them, e.g.
        [B, T] and [B, 1]): its sink entry, or its slot's ring's."""
        start = self.ring_start[slots]
        rows = start + positions % (self.k.shape[3] - start)
        return torch.where(positions < self.kept, positions, rows) if self.sinks else rows

    def fill(self, slot: int, kept: torch.Tensor, recent_start: int, length: int) -> None:
        """A slot's prefill is cached: store its kept positions kept [layers, kv_heads, n] (n <= self.kept)
        and the positions [recent_start, length)."""
        layers, kv_heads, n = kept.shape
        self.entry_pos[slot] = -1
        self.stale.pop(slot, None)
        if self.ring_per_slot:
            self.ring_start[slot] = n
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
        self._copy(slot, max(recent_start, length - self.ring_of(slot)), length)

    def move_ring(self, slot: int, kept_count: int, length: int) -> None:
        """(`ring_per_slot`, self-speculation) The slot's kept count is now kept_count (a guided view of a
        row shorter than the budget keeps more positions as it grows): its ring starts after them, and
        takes the committed positions a view can show, [length - (budget - kept_count), length), from the
        cache. Called between rounds, when no draft token of the slot is past `length`."""
        assert self.ring_per_slot and self.copy_from_cache
        self.ring_start[slot] = kept_count
        self.entry_pos[slot, kept_count:] = -1
        self.stale.pop(slot, None)
        self._copy(slot, self._oldest_shown(slot, length), length)

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
        ring positions, a ring of its own budget - kept count: no more are copied, so that none lands on
        an entry the round's drafts took). Older ones stay as they are, hidden; so do the entries a round drafts into
        (positions >= length, ring entries of positions < length - budget), whichever comes first."""
        for slot in slots:
            due = self.stale.pop(slot, None)
            if due is not None:
                start, length = due
                self._copy(slot, max(start, self._oldest_shown(slot, length)), length)

    def _oldest_shown(self, slot: int, length: int) -> int:
        """The oldest committed position a view of the slot can show once `length` are committed: at
        most `budget` ring positions, and no more than its ring holds beside a round's `extra`."""
        return max(length - min(self.budget, self.ring_of(slot) - self.extra), 0)

    def _copy(self, slot: int, start: int, length: int) -> None:
        """Positions [start, length) of the cache into their entries (start >= length - the slot's ring)."""
        if length > start:
            positions = torch.arange(start, length, device=self.k.device)  # [n]
            rows = self.rows_for(positions, slot)
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
        self.ring_start[slot] = self.kept
        self.stale.pop(slot, None)

    def visible(self, slots: torch.Tensor, ends: torch.Tensor, kept_count: torch.Tensor,
                kept_end: torch.Tensor) -> torch.Tensor:
        """The position each entry shows to rows whose newest token is at ends - 1, else -1: [B, S].

        The same rule as `compose_view`: the first kept_count kept entries, and the newest
        budget - kept_count positions at or after kept_end.
        """
        pos = self.entry_pos.index_select(0, slots)  # [B, S]
        entry = torch.arange(pos.shape[1], device=pos.device)[None, :]  # [1, S]
        in_ring = entry >= self.ring_start.index_select(0, slots)[:, None]  # [B, S]
        kept_shown = ~in_ring & (entry < kept_count[:, None]) & (pos >= 0) & (pos < ends[:, None])
        lowest = torch.maximum(kept_end, ends - (self.budget - kept_count))  # [B]
        ring_shown = in_ring & (pos >= lowest[:, None]) & (pos < ends[:, None])
        return torch.where(kept_shown | ring_shown, pos, torch.full_like(pos, -1))
