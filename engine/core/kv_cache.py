"""The engine-owned KV cache: preallocated once, one fixed-capacity slot per concurrent sequence.

Layout: `k` and `v` are each one tensor `[layers, slots, kv_heads, capacity, head_dim]`, so a slot's
keys for one layer and KV head are a contiguous `[capacity, head_dim]` block that attention reads
without copying. `lengths[slot]` is how many positions of that slot are committed; anything past it
is scratch that the next forward overwrites (speculative tokens, rejected drafts). Emptying, refilling
and rolling back a slot only changes its length: nothing is reallocated or concatenated after
construction. `origins[slot]` says where a slot's first positions came from (the prefix store's block
serials, `engine.core.shared_prefix`), so rows holding the same bits can be read once. This module
stores; it does not attend or decide what a draft may see.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, *, layers: int, slots: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.layers, self.slots, self.kv_heads = layers, slots, kv_heads
        self.head_dim, self.capacity = head_dim, capacity
        shape = (layers, slots, kv_heads, capacity, head_dim)
        # empty, not zeros: pages are touched as slots fill; nothing reads past a slot's length.
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, capacity, head_dim]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, capacity, head_dim]
        self.lengths = [0] * slots  # committed positions per slot
        self.high_water = [0] * slots  # the most positions each slot ever had committed
        # per slot: serials of the prefix-store blocks its first origin_block-token blocks were copied
        # from or into (those positions hold the store's bits); () for none
        self.origins: list[tuple[int, ...]] = [()] * slots
        self.origin_block = 0
        # full-cache forwards' K/V positions (per layer and KV head, summed over rows), and of those
        # the ones a row did not read itself because its group read them once (engine.core.shared_prefix)
        self.positions_read = 0
        self.positions_shared = 0

    @staticmethod
    def bytes_needed(*, layers: int, slots: int, kv_heads: int, head_dim: int, capacity: int,
                     dtype: torch.dtype) -> int:
        """slots x capacity x layers x 2 (K and V) x kv_heads x head_dim x bytes per element."""
        element = torch.empty((), dtype=dtype).element_size()
        return slots * capacity * layers * 2 * kv_heads * head_dim * element

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """One position of one slot: layers x 2 (K and V) x kv_heads x head_dim x element size."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.k.element_size()

    @property
    def touched_bytes(self) -> int:
        """The part of the allocation rows have used: each slot's most committed positions x bytes per token."""
        return sum(self.high_water) * self.bytes_per_token

    @property
    def device(self) -> torch.device:
        return self.k.device

    def clear(self, slot: int) -> None:
        """Empty a slot for a new sequence."""
        self.lengths[slot] = 0
        self.set_origin(slot, (), 0)

    def set_origin(self, slot: int, serials: tuple[int, ...], block: int) -> None:
        """Record that the slot's first len(serials) x block positions hold those store blocks' K/V."""
        if serials or self.origins[slot]:
            self.origins[slot] = tuple(serials)
            self.origin_block = block or self.origin_block

    def set_length(self, slot: int, length: int) -> None:
        """Commit (or roll back to) `length` positions of a slot; positions past it become scratch."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"slot {slot}: length {length} outside [0, {self.capacity}]")
        self.lengths[slot] = length
        if self.origins[slot] and length < len(self.origins[slot]) * self.origin_block:
            self.set_origin(slot, self.origins[slot][: length // self.origin_block], self.origin_block)
        if length > self.high_water[slot]:
            self.high_water[slot] = length

    def write(self, layer: int, slot_rows: torch.Tensor, positions: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new keys/values of one layer.

        slot_rows, positions: [B * T] slot and position of each new token (row-major over B, T).
        key, value: [B, kv_heads, T, head_dim] (post-RoPE, as transformers' attention receives them).
        """
        rows = key.transpose(1, 2).reshape(-1, self.kv_heads, self.head_dim)  # [B * T, kv_heads, head_dim]
        self.k[layer][slot_rows, :, positions] = rows.to(self.k.dtype)
        rows = value.transpose(1, 2).reshape(-1, self.kv_heads, self.head_dim)
        self.v[layer][slot_rows, :, positions] = rows.to(self.v.dtype)
