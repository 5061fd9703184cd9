"""Which rows of a forward hold the same prompt-prefix K/V, bit for bit, so attention reads it once.

With prefix reuse, rows of one document copy that document's K/V from the same `PrefixStore` blocks
(or are the row those blocks were copied from). Decoding is bound by reading the KV cache, and
such rows read the same bytes each step, once per row. Here a forward's rows are grouped so that
the fused CPU kernel (`attend_cached_shared`) reads each group's shared blocks once per KV head for
all the group's query rows, then each row's own remainder; per query row the arithmetic is the
ordinary kernel's, block for block, so the outputs are the same bits.

Which bits are the same is known from where they came from, never assumed from equal tokens (two
computations of one prefix may round differently): each slot records the serials of the store blocks
its first positions hold (`KVCache.origins`, set by `engine.core.prefill`); two rows share j blocks
iff their first j serials agree. Each row joins the group of the deepest prefix it shares with any
other row of the forward. `MAGICDEC_SHARED_READS=0` turns the grouping off (to measure both ways).
This module groups rows; it neither stores K/V nor attends.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

KERNEL_BLOCK = 64  # the kernel's online-softmax block: shared lengths are multiples of it
SWITCH = "MAGICDEC_SHARED_READS"


@dataclasses.dataclass(frozen=True)
class PrefixGroups:
    """A forward's rows by shared prefix, as `attend_cached_shared` takes them (int64 tensors)."""

    members: torch.Tensor  # [B] batch row indices, group by group (a group's first row's slot is read)
    offsets: torch.Tensor  # [groups + 1] group g = members[offsets[g]:offsets[g + 1]]
    shared: torch.Tensor  # [groups] positions [0, shared[g]) hold the same K/V in every slot of group g
    positions_saved: int  # K/V positions (per layer and KV head) a group's other rows no longer read


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


@functools.lru_cache(maxsize=1024)
def _chain(origin: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(depth, key of the serials up to that depth) for each depth of a row's origins: a row's origins
    stay the same while it decodes, so each is chained once, not once per forward."""
    key, chain = 0, []
    for depth, serial in enumerate(origin, start=1):
        key = hash((key, serial))
        chain.append((depth, key))
    return tuple(chain)


def group_rows(origins: list[tuple[int, ...]], block: int, starts: list[int],
               device: torch.device | str = "cpu") -> PrefixGroups | None:
    """Groups of the rows whose `origins` (per row: the store-block serials of its first blocks of
    `block` tokens) agree on a prefix; None when no two rows share one. starts[b]: row b's first new
    position (shared positions stay below it)."""
    B = len(origins)
    chains = [_chain(origin) for origin in origins]  # per row: [(depth, cumulative key)]
    count: dict[tuple[int, int], int] = {}
    for chain in chains:
        for node in chain:
            count[node] = count.get(node, 0) + 1
    groups: dict[tuple[int, int], list[int]] = {}
    singles = []
    for row, chain in enumerate(chains):
        deepest = next((node for node in reversed(chain) if count[node] >= 2), None)
        if deepest is None:
            singles.append(row)
        else:
            groups.setdefault(deepest, []).append(row)
    members, offsets, shared = [], [0], []
    saved = 0
    for (depth, _), rows in groups.items():
        leader = origins[rows[0]]
        same = [r for r in rows if origins[r][:depth] == leader[:depth]]  # exact, whatever the hash
        singles += [r for r in rows if r not in same]
        length = min(depth * block, min(starts[r] for r in same)) // KERNEL_BLOCK * KERNEL_BLOCK
        if len(same) < 2 or length == 0:
            singles += same
            continue
        members += same
        offsets.append(len(members))
        shared.append(length)
        saved += (len(same) - 1) * length
    if not shared:
        return None
    for row in singles:
        members.append(row)
        offsets.append(len(members))
        shared.append(0)
    assert sorted(members) == list(range(B))

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return PrefixGroups(tensor(members), tensor(offsets), tensor(shared), saved)
