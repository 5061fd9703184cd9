"""What every draft KV compressor shares: its life cycle and how a draft's view is assembled.

A compressor watches a `KVCache` (the target's, for self-speculation, or a separate draft model's)
and decides which `budget` positions per row, layer and KV head a draft forward reads. Every method
here splits that budget into a *kept* part chosen from the older positions (sinks, SnapKV's top
scores, PQCache's retrieved keys, the guided view's top attention mass) and a *recent* part: the newest positions, which slides as tokens
are generated. `compose_view` turns both into the `[B, kv_heads, budget]` positions that
`attention.attend_view` gathers. Compressors select positions; they never copy or own K/V.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from engine.config.schema import DraftConfig
from engine.core.kv_cache import KVCache
from engine.spec.compressors.compact import CompactStore


def compose_view(kept: torch.Tensor, kept_count: torch.Tensor, kept_end: torch.Tensor,
                 ends: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept positions followed by the most recent ones, `budget` in all, without overlap.

    kept: [B, kv_heads, K] chosen positions (only the first kept_count[b] of row b are used; all
    below kept_end[b]); kept_count, kept_end, ends: [B]. Row b's recent part is
    [max(kept_end[b], ends[b] - (budget - kept_count[b])), ends[b]).
    Returns positions and valid, both [B, kv_heads, budget].
    """
    B, kv_heads, K = kept.shape
    column = torch.arange(budget, device=kept.device)  # [budget]
    if K < budget:
        kept = torch.nn.functional.pad(kept, (0, budget - K))
    else:
        kept = kept[..., :budget]
    count = kept_count[:, None]  # [B, 1]
    recent = ends[:, None] - budget + column[None, :]  # [B, budget]: column j >= count holds this
    is_kept = column[None, :] < count  # [B, budget]
    positions = torch.where(is_kept[:, None, :], kept, recent[:, None, :])  # [B, kv_heads, budget]
    valid = is_kept | (recent >= kept_end[:, None])  # [B, budget]
    positions = torch.where(valid[:, None, :], positions, torch.zeros_like(positions))
    return positions, valid[:, None, :].expand(B, kv_heads, budget)


class SelectionTimer:
    """Accumulates the wall time a compressor spends choosing positions (PQCache's search cost)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Compressor(ABC):
    """Base class: per-slot state is set at prefill, updated as tokens commit, dropped on release."""

    name = "base"
    observe_window = 0  # how many trailing prompt queries the prefill must hand over (SnapKV)
    compact_store = False  # whether its view can live in a `CompactStore` (kept part fixed per slot)
    compact_sinks = False  # ...whose kept entry i holds position i (StreamingLLM's sinks)
    compact_ring_per_slot = False  # ...with a ring per slot after its kept count (SnapKV, guided)
    wants_mass = False  # whether it re-selects from a full-cache forward's attention mass (`observe_mass`)
    compact: CompactStore | None = None  # the draft's own bf16 store, when enabled (`enable_compact`)

    def __init__(self, config: DraftConfig, cache: KVCache, num_heads: int):
        self.config = config
        self.cache = cache
        self.budget = config.budget
        self.num_heads = num_heads  # query heads (local to this rank under tensor parallelism)
        self.timer = SelectionTimer()

    @staticmethod
    def kept_entries(config: DraftConfig) -> int:
        """Entries a compact store reserves for kept positions (methods with `compact_store`)."""
        return 0

    def enable_compact(self, *, extra: int, copy_committed: bool) -> bool:
        """Keep the draft's view in a `CompactStore` (before any prefill); False if the method cannot
        (its kept part depends on the query).

        extra: the most positions a round writes past the committed length (gamma_max + 1);
        copy_committed: True for self-speculation (committed K/V come from the target cache).
        """
        if not self.compact_store:
            return False
        self.compact = CompactStore(self.cache, kept=self.kept_entries(self.config), budget=self.budget,
                                    extra=extra, copy_committed=copy_committed, sinks=self.compact_sinks,
                                    ring_per_slot=self.compact_ring_per_slot)
        return True

    def prefill_done(self, slot: int, prompt_len: int, observed: torch.Tensor | None,
                     mass: torch.Tensor | None = None) -> None:
        """The slot's prompt is cached. observed: [layers, heads, window, head_dim] or None; mass:
        [layers, kv_heads, prompt_len], the window's attention mass when the prefill computed it."""

    def committed(self, slot: int, length: int) -> None:
        """The slot now has `length` committed positions (after a round or a rollback)."""
        if self.compact is not None:
            self.compact.copy_committed(slot, length)

    def release(self, slot: int) -> None:
        """The slot's sequence finished."""
        if self.compact is not None:
            self.compact.release(slot)

    def observes_round(self) -> bool:
        """Asked once per speculative round, before its full-cache forward: whether that forward should
        return its attention mass for a re-selection (never, but for `wants_mass` methods)."""
        return self.wants_mass

    def new_mass(self, rows: int, positions: int) -> torch.Tensor:
        """(`wants_mass` methods) a buffer for `ForwardBatch.mass`: [layers, rows, kv_heads, positions]."""
        raise NotImplementedError

    def observe_mass(self, mass: torch.Tensor, rows: list[int], slots: list[int], ends: list[int],
                     committed: list[int], tokens: int) -> None:
        """(`wants_mass` methods) the attention mass of a forward over the whole cache, after it."""
        raise NotImplementedError

    @abstractmethod
    def view(self, slots: list[int], ends: list[int]):
        """The positions a draft forward may read; row b's newest token is at ends[b] - 1."""


class FixedKeptView:
    """A view whose kept part does not depend on the query: StreamingLLM and SnapKV."""

    def __init__(self, kept_for_layer, kept_count: torch.Tensor, kept_end: torch.Tensor,
                 ends: torch.Tensor, budget: int, timer: SelectionTimer, layer_invariant: bool,
                 slots: torch.Tensor | None = None, compact: CompactStore | None = None):
        self.kept_for_layer = kept_for_layer  # layer -> [B, kv_heads, K]
        self.kept_count, self.kept_end, self.ends = kept_count, kept_end, ends
        self.budget = budget
        self.timer = timer
        self.layer_invariant = layer_invariant
        self._cached = None
        self.slots = slots  # [B], with a compact store
        self.compact = compact  # the same view held in the draft's own store (read by the lean forward)
        if compact is not None:
            compact.sync(slots.tolist())  # committed K/V still due go in before the draft reads or writes

    def compact_entries(self) -> torch.Tensor:
        """The position each compact-store entry shows each row (-1: hidden): [B, S]."""
        with self.timer:
            return self.compact.visible(self.slots, self.ends, self.kept_count, self.kept_end)

    def select(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_invariant and self._cached is not None:
            return self._cached
        with self.timer:
            selected = compose_view(self.kept_for_layer(layer), self.kept_count, self.kept_end,
                                    self.ends, self.budget)
        if self.layer_invariant:
            self._cached = selected
        return selected
