"""Attention for prefill: the prompt chunks of several rows packed along one token axis.

A `PrefillBatch` is one forward of `Segment`s: segment s carries `length` consecutive prompt tokens of
the row in cache slot `slot`, from cache position `start`; the segments are concatenated along the token
axis (transformers sees a batch of one sequence of N tokens, each with its own position id), so the
linear layers run at M = N whatever the rows. Each segment's tokens attend to their slot's cached
positions before `start` plus the segment itself, causally; every K/V row is read once per GQA group.

Backends (held against the masked reference in the tests): the fused CPU kernel's `prefill_attention`
(a tiled online softmax that never builds the [heads, tokens, context] score matrix), torch's SDPA per
segment on CUDA (`engine.core.sdpa_attention`), and a torch path per segment (the query heads of a
group folded into the query axis, one matmul against the slot's K read in place) for other devices or
without the kernel. This module does not decide what to prefill.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from engine.core import sdpa_attention
from engine.core.kv_cache import KVCache


class WindowObserver(Protocol):
    """Receives the queries of a segment (SnapKV's observation window is the prompt's last tokens)."""

    def observe(self, layer: int, query: torch.Tensor, start: int) -> None:
        """query: [heads, length, head_dim] of the segment's tokens, the first at position `start`."""


@dataclasses.dataclass
class Segment:
    slot: int
    start: int  # cache position of the segment's first token
    length: int
    observer: WindowObserver | None = None


class PrefillBatch:
    """Per-forward metadata of a packed prefill (see the module docstring)."""

    write_kv = True
    view = None

    def __init__(self, cache: KVCache, segments: list[Segment]):
        self.cache = cache
        self.segments = segments
        device = cache.device
        lengths = [s.length for s in segments]
        self.num_new = sum(lengths)
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets
        for s in segments:
            if s.start + s.length > cache.capacity:
                raise ValueError(f"slot {s.slot}: position {s.start + s.length - 1} beyond cache capacity "
                                 f"{cache.capacity}")
        self.write_positions = torch.cat([torch.arange(s.start, s.start + s.length, device=device)
                                          for s in segments])  # [N]
        self.write_slots = torch.cat([torch.full((s.length,), s.slot, dtype=torch.long, device=device)
                                      for s in segments])  # [N]
        self.positions = self.write_positions[None, :]  # [1, N]: RoPE positions of the packed tokens
        self.seg_slot = torch.tensor([s.slot for s in segments], dtype=torch.long, device=device)  # [S]
        self.seg_start = torch.tensor([s.start for s in segments], dtype=torch.long, device=device)  # [S]
        self.seg_offset = torch.tensor(offsets, dtype=torch.long, device=device)  # [S]
        self.seg_len = torch.tensor(lengths, dtype=torch.long, device=device)  # [S]
        self.last_indices = self.seg_offset + self.seg_len - 1  # [S]: each segment's last token


def attend_prefill(kernel, query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                   batch: PrefillBatch, layer: int, scale: float) -> torch.Tensor:
    """query: [1, heads, N, D] (transformers' layout after RoPE); returns [1, N, heads, D].

    kernel: the fused CPU kernel module (None: the torch path). The segments' K/V are already cached.
    """
    for segment, offset in zip(batch.segments, batch.offsets):
        if segment.observer is not None:
            segment.observer.observe(layer, query[0, :, offset:offset + segment.length], segment.start)
    if kernel is not None:
        q = query[0].transpose(0, 1).float().contiguous()  # [N, heads, D], token-major
        out = kernel.prefill_attention(q, k_layer, v_layer, batch.seg_slot, batch.seg_start, batch.seg_offset,
                                       batch.seg_len, scale)  # [N, heads, D] float32
        return out[None].to(query.dtype)
    if query.is_cuda:  # torch's fused SDPA: one pass over K/V, no [group * T, end] scores in memory
        return attend_segments_sdpa(query, k_layer, v_layer, batch, scale)
    return attend_segments_torch(query, k_layer, v_layer, batch, scale)


def attend_segments_sdpa(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                         batch: PrefillBatch, scale: float) -> torch.Tensor:
    """CUDA without the CPU kernel: one SDPA call per segment. query: [1, heads, N, D]; returns [1, N, heads, D]."""
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    for segment, offset in zip(batch.segments, batch.offsets):
        out[0, offset:offset + segment.length] = sdpa_attention.attend_segment(
            query[0, :, offset:offset + segment.length], k_layer, v_layer, segment.slot, segment.start, scale)
    return out


def attend_segments_torch(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                          batch: PrefillBatch, scale: float) -> torch.Tensor:
    """The torch path, one segment at a time. query: [1, heads, N, D]; k_layer, v_layer: [slots, kv_heads,
    capacity, D]. Returns [1, N, heads, D]."""
    _, H, N, D = query.shape
    kv_heads = k_layer.shape[1]
    group = H // kv_heads
    out = query.new_empty(1, N, H, D)
    for segment, offset in zip(batch.segments, batch.offsets):
        T, end = segment.length, segment.start + segment.length
        q = (query[0, :, offset:offset + T] * scale).reshape(kv_heads, group * T, D)  # [kv_heads, group * T, D]
        k = k_layer[segment.slot, :, :end]  # [kv_heads, end, D], a view of the cache
        v = v_layer[segment.slot, :, :end]
        scores = torch.matmul(q, k.transpose(-1, -2).to(q.dtype))  # [kv_heads, group * T, end]
        if T > 1:  # new token t may not see new tokens after it
            causal = torch.ones(T, T, dtype=torch.bool, device=query.device).triu_(1)  # [T, T]
            scores.view(kv_heads, group, T, end)[..., end - T:].masked_fill_(causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, v.to(q.dtype))  # [kv_heads, group * T, D]
        out[0, offset:offset + T] = o.view(H, T, D).transpose(0, 1)
    return out
