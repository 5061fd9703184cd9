"""Putting an output's rows back in input order with bounded memory: an external merge sort.

Rows carry their input row number (`index`; rows already in a finished output have none and sort
first, in their order). `sorted_chunks` cuts a stream of rows into runs sorted in memory, at most
`chunk_bytes` each (the last one stays in memory, the others are spilled to disk); `merge_runs` merges
any number of sorted runs, at most `fan_in` open at once (more are merged in passes, through spill
files). How a run is spilled and read back is the caller's (JSONL lines or Parquet batches); nothing
here knows a file format.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterable, Iterator

Item = tuple[int, Any]  # (sort key: the input row number, -1 for rows without one; the row)
Run = Callable[[], Iterator[Item]]  # a sorted run, iterated from its start on each call
Spill = Callable[[Iterator[Item]], Run]  # writes a sorted stream to disk, returns it as a run

FAN_IN = 64  # runs merged at once (each holds one read buffer)


def sort_key(index: int | None) -> int:
    return -1 if index is None else index


def _first(item: Item) -> int:
    return item[0]


def sorted_chunks(items: Iterable[Item], spill: Spill, *, chunk_bytes: int,
                  size: Callable[[Any], int]) -> list[Run]:
    """Sorted runs holding `items`: chunks of about `chunk_bytes` (as `size` counts a row)."""
    runs: list[Run] = []
    chunk: list[Item] = []
    held = 0
    for item in items:
        chunk.append(item)
        held += size(item[1])
        if held >= chunk_bytes:
            chunk.sort(key=_first)  # stable: equal keys keep their order
            runs.append(spill(iter(chunk)))
            chunk, held = [], 0
    if chunk:
        chunk.sort(key=_first)
        kept = chunk
        runs.append(lambda: iter(kept))
    return runs


def merge_runs(runs: list[Run], spill: Spill, *, fan_in: int = FAN_IN) -> Iterator[Item]:
    """All items of the sorted `runs`, sorted; equal keys keep the order of the runs they came from."""
    assert fan_in >= 2, "fan_in must be at least 2"
    while len(runs) > fan_in:
        runs = [spill(heapq.merge(*(run() for run in runs[i:i + fan_in]), key=_first))
                if len(runs[i:i + fan_in]) > 1 else runs[i] for i in range(0, len(runs), fan_in)]
    return heapq.merge(*(run() for run in runs), key=_first)
