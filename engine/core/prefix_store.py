"""Computed prompt-prefix KV, kept by token blocks so that rows sharing a prefix compute it once.

Many rows of a batch job share their long part (a document asked several questions, RAG passages,
a chat template's system header). A row's prompt is cut into blocks of `block` tokens; block i is
keyed by the chain of token ids before and in it (so a block only matches after the same prefix),
never by text. After a row's prefill its full blocks are copied from its cache slot into a bounded
pool here; a later row whose prompt starts with the same blocks gets their K/V copied into its own
slot and computes only the rest (`engine.core.prefill`). Copying costs a few milliseconds for
thousands of tokens, against seconds to compute them, and keeps every slot's K/V contiguous for the
attention kernels (sharing blocks in place would need paged attention everywhere).

The pool holds `capacity` tokens (`batch.prefix_cache` tokens; the memory check counts it), allocated
once and touched as it fills; when full, the least recently used blocks are evicted (a block is
always used at least as recently as the blocks after it in a chain, so chains shrink from the end).
This module stores and finds; it does not decide what to compute.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from engine.core.kv_cache import KVCache


@dataclasses.dataclass
class _Block:
    index: int  # its row in the pool
    tokens: tuple[int, ...]  # checked on every match (the chain key is a hash)
    parent: int | None  # the chain key of the block before it
    serial: int  # unique per block ever stored: which bits a slot copied (engine.core.shared_prefix)


@dataclasses.dataclass
class StoreStats:
    lookups: int = 0  # rows that asked
    hits: int = 0  # rows that reused at least one block
    tokens_reused: int = 0  # prompt tokens whose K/V came from here
    peak_blocks: int = 0  # most blocks held at once


class PrefixStore:
    """Prefix K/V for one cache geometry (layers, KV heads, head size, dtype), shared by its slots."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, block: int, capacity: int):
        """block: tokens per block; capacity: tokens the pool holds (rounded down to whole blocks)."""
        assert block >= 1 and capacity >= block, "a store holds at least one block"
        self.block = block
        self.max_blocks = capacity // block
        self.geometry = (layers, kv_heads, head_dim, dtype)
        shape = (self.max_blocks, layers, kv_heads, block, head_dim)
        # empty, not zeros: the pool is touched block by block as it fills.
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [blocks, layers, kv_heads, block, head_dim]
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.blocks: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # chain key -> block, LRU first
        self.free = list(range(self.max_blocks - 1, -1, -1))
        self.stats = StoreStats()
        self.serials = 0  # blocks stored so far

    @classmethod
    def for_cache(cls, cache: KVCache, *, block: int, capacity: int) -> "PrefixStore":
        """A store of `capacity` tokens for the rows of `cache` (same geometry and device)."""
        return cls(layers=cache.layers, kv_heads=cache.kv_heads, head_dim=cache.head_dim, dtype=cache.k.dtype,
                   device=cache.device, block=block, capacity=capacity)

    @staticmethod
    def bytes_needed(*, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block: int,
                     capacity: int) -> int:
        return 2 * (capacity // block) * layers * kv_heads * block * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // (self.max_blocks * self.block)

    def fits(self, cache: KVCache) -> bool:
        return self.geometry == (cache.layers, cache.kv_heads, cache.head_dim, cache.k.dtype)

    def _chain(self, ids: list[int], count: int):
        """(key, parent key, tokens) of the first `count` full blocks of ids."""
        parent = None
        for i in range(count):
            tokens = tuple(ids[i * self.block: (i + 1) * self.block])
            key = hash((parent, tokens))
            yield key, parent, tokens
            parent = key

    def _stored(self, ids: list[int]) -> list[tuple[int, _Block]]:
        """(chain key, block) of the stored blocks that `ids` starts with, in order (LRU untouched)."""
        found = []
        for key, _, tokens in self._chain(ids, len(ids) // self.block):
            block = self.blocks.get(key)
            if block is None or block.tokens != tokens:
                break
            found.append((key, block))
        return found

    def match(self, ids: list[int]) -> list[_Block]:
        """The stored blocks that `ids` starts with, in order (marked as just used)."""
        found = self._stored(ids)
        for key, _ in reversed(found):  # the first block ends up the most recently used
            self.blocks.move_to_end(key)
        return [block for _, block in found]

    def stored_blocks(self, ids: list[int]) -> int:
        """How many full blocks `ids` starts with are stored (without marking them used)."""
        return len(self._stored(ids))

    def load(self, cache: KVCache, slot: int, blocks: list[_Block], length: int) -> None:
        """Copy the K/V of positions [0, length) (length <= blocks x block) into `slot` of `cache`."""
        for i, block in enumerate(blocks):
            start = i * self.block
            if start >= length:
                break
            n = min(self.block, length - start)
            cache.k[:, slot, :, start:start + n] = self.k[block.index, :, :, :n]  # [layers, kv_heads, n, D]
            cache.v[:, slot, :, start:start + n] = self.v[block.index, :, :, :n]
        self.stats.tokens_reused += length

    def insert(self, cache: KVCache, slot: int, ids: list[int]) -> dict[int, int]:
        """Keep every full block of `ids` (cached in `slot` at positions 0..len-1) not yet stored;
        returns {block number in ids: serial} of the blocks copied from the slot."""
        written = {}
        chain = list(self._chain(ids, len(ids) // self.block))
        for i, (key, parent, tokens) in enumerate(chain):
            block = self.blocks.get(key)
            if block is not None and block.tokens == tokens:
                continue
            index = self._allocate(protect={k for k, _, _ in chain[:i]})
            if index is None:
                break  # the pool is full of this very chain
            start = i * self.block
            self.k[index] = cache.k[:, slot, :, start:start + self.block]
            self.v[index] = cache.v[:, slot, :, start:start + self.block]
            if block is not None:  # a hash collision with other tokens: replace it
                self.free.append(block.index)
            self.serials += 1
            self.blocks[key] = _Block(index, tokens, parent, self.serials)
            written[i] = self.serials
        for key, _, _ in reversed(chain):
            if key in self.blocks:
                self.blocks.move_to_end(key)
        self.stats.peak_blocks = max(self.stats.peak_blocks, len(self.blocks))
        return written

    def _allocate(self, protect: set[int]) -> int | None:
        if self.free:
            return self.free.pop()
        for key in self.blocks:  # least recently used first
            if key not in protect:
                return self.blocks.pop(key).index
        return None
