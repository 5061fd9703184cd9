"""Attention for prefill: the prompt chunks of several rows packed along one token axis.

A `PrefillBatch` is one forward of `Segment`s: segment s carries `length` consecutive prompt tokens of
the row in cache slot `slot`, from cache position `start`; the segments are concatenated along the token
axis (transformers sees a batch of one sequence of N tokens, each with its own position id), so the
linear layers run at M = N whatever the rows. Each segment's tokens attend to their slot's cached
positions before `start` plus the segment itself, causally; every K/V row is read once per GQA group.

A segment may carry a `WindowObserver` (a row whose draft wants SnapKV's observation window, the
prompt's last tokens): it receives the queries of the segment's tokens in that window and, where the
backend has them in hand, the attention mass those tokens' softmax puts on each cached position (per
KV head, summed over the GQA group and the tokens), so the draft's prefill-time selection costs no
second pass over the prompt. With the fused kernel on AMX tiles, `prefill_attention_mass` attends every
token and returns the tails' mass from the same pass (each tail a task of its own); elsewhere a
segment's window tokens (its tail) are attended by the decode kernel's `attend_cached_scores`, which
returns that mass, and its other tokens by `prefill_attention` (where a bfloat16 model's prefill runs on
the kernel's bfloat16 dot products, every token by `prefill_attention` and the tails' mass alone from the
decode kernel, so that a row's prefill rounds the same whatever draft listens); the torch path sums its
own softmax; SDPA gives no mass (the draft computes it).

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

    observe_from: int  # the window's first position: only tokens at or after it are observed

    def observe(self, layer: int, query: torch.Tensor, start: int) -> None:
        """query: [heads, length, head_dim] of the segment's tokens, the first at position `start`."""

    def add_mass(self, layer: int, mass: torch.Tensor, tokens: int) -> None:
        """mass: [kv_heads, end] float32, the softmax attention `tokens` window tokens (the last of them
        at position end - 1) put on each position, summed over those tokens and each group's heads."""


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
        self.ends = [s.start + s.length for s in segments]  # each segment's end in its slot (exclusive)
        # Each segment's tail: its tokens in its observer's window (0 without an observer).
        self.tails = [max(s.start + s.length - max(s.observer.observe_from, s.start), 0)
                      if s.observer is not None else 0 for s in segments]
        self.tail_groups: dict[int, list[int]] = {}  # tail length -> the segments with that tail
        for index, tail in enumerate(self.tails):
            if tail:
                self.tail_groups.setdefault(tail, []).append(index)
        if self.tail_groups:  # the kernel's prefill pass then takes every segment's head only (or,
            # where its AMX task returns the mass, every token, the tails as tasks of their own)
            self.seg_head_len = torch.tensor([n - t for n, t in zip(lengths, self.tails)], dtype=torch.long,
                                             device=device)  # [S]
            self.seg_tail = torch.tensor(self.tails, dtype=torch.long, device=device)  # [S]


def attend_prefill(kernel, query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                   batch: PrefillBatch, layer: int, scale: float) -> torch.Tensor:
    """query: [1, heads, N, D] (transformers' layout after RoPE); returns [1, N, heads, D].

    kernel: the fused CPU kernel module (None: the torch path). The segments' K/V are already cached.
    """
    for segment, offset in zip(batch.segments, batch.offsets):
        if segment.observer is not None:
            segment.observer.observe(layer, query[0, :, offset:offset + segment.length], segment.start)
    if kernel is not None:
        D = query.shape[-1]
        if batch.tail_groups and kernel.prefill_mass_on_amx(D):
            q = query[0].transpose(0, 1).float().contiguous()  # [N, heads, D], token-major
            return _attend_with_tail_mass(kernel, q, k_layer, v_layer, batch, layer, scale)[None].to(query.dtype)
        # A bfloat16 model's query stays bfloat16 where the kernel multiplies it on bfloat16 dot products.
        bf16_dot = query.dtype == k_layer.dtype == torch.bfloat16 and kernel.prefill_bf16_dot_in_use(D)
        q = query[0].transpose(0, 1)  # [N, heads, D], token-major
        q = (q if bf16_dot else q.float()).contiguous()
        # On bfloat16 dot products the tails take the prefill task too (rounded as the rest of the prompt,
        # so a row's prefill is the same whatever draft listens), and the decode kernel gives only their mass.
        head_len = batch.seg_head_len if batch.tail_groups and not bf16_dot else batch.seg_len
        out = kernel.prefill_attention(q, k_layer, v_layer, batch.seg_slot, batch.seg_start, batch.seg_offset,
                                       head_len, scale)  # [N, heads, D] float32 (tails: zeros, filled below)
        for tail, members in batch.tail_groups.items():
            _attend_tails(kernel, query, k_layer, v_layer, batch, layer, scale, tail, members,
                          None if bf16_dot else out)
        return out[None].to(query.dtype)
    if query.is_cuda:  # torch's fused SDPA: one pass over K/V, no [group * T, end] scores in memory
        return attend_segments_sdpa(query, k_layer, v_layer, batch, scale)
    return attend_segments_torch(query, k_layer, v_layer, batch, layer, scale)


def _attend_with_tail_mass(kernel, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                           batch: PrefillBatch, layer: int, scale: float) -> torch.Tensor:
    """Every token by the AMX prefill task, each segment's tail with its mass from the same pass
    (`prefill_attention_mass`); each observer gets its tail's mass. q: [N, heads, D]; returns [N, heads, D]."""
    out, mass = kernel.prefill_attention_mass(q, k_layer, v_layer, batch.seg_slot, batch.seg_start, batch.seg_offset,
                                              batch.seg_len, batch.seg_tail, max(batch.ends), scale)  # mass: [S, kv_heads, max end]
    for index, (segment, end) in enumerate(zip(batch.segments, batch.ends)):
        if tail := batch.tails[index]:
            segment.observer.add_mass(layer, mass[index, :, :end], tail)
    return out


def _attend_tails(kernel, query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: PrefillBatch,
                  layer: int, scale: float, tail: int, members: list[int], out: torch.Tensor | None) -> None:
    """The last `tail` tokens of each listed segment, attended with their mass by the decode kernel's
    `attend_cached_scores` (token t of the tail sees positions up to end - tail + t, the causal rule) and
    written into out [N, heads, D] (float32; None: the outputs are computed elsewhere); each segment's
    observer gets its mass."""
    H, D = query.shape[1], query.shape[3]
    kv_heads = k_layer.shape[1]
    segments = [batch.segments[i] for i in members]
    firsts = [batch.offsets[i] + s.length - tail for i, s in zip(members, segments)]  # tails' first tokens
    ends = [batch.ends[i] for i in members]
    q = torch.stack([query[0, :, first:first + tail] for first in firsts])  # [B, heads, tail, D]
    # [B, kv_heads, group * tail, D]: heads of a group, token fastest (the kernel's row order)
    q = (q.float() * scale).reshape(len(members), kv_heads, (H // kv_heads) * tail, D).contiguous()
    slots = torch.tensor([s.slot for s in segments], dtype=torch.long)  # [B]
    o, mass = kernel.attend_cached_scores(q, k_layer, v_layer, slots, torch.tensor(ends, dtype=torch.long), tail,
                                          max(ends))  # o: [B, kv_heads, group * tail, D]; mass: [B, kv_heads, max end]
    o = o.view(len(members), H, tail, D).transpose(1, 2)  # [B, tail, heads, D]
    for b, (segment, first, end) in enumerate(zip(segments, firsts, ends)):
        if out is not None:
            out[first:first + tail] = o[b]
        segment.observer.add_mass(layer, mass[b, :, :end], tail)


def attend_segments_sdpa(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                         batch: PrefillBatch, scale: float) -> torch.Tensor:
    """CUDA without the CPU kernel: one SDPA call per segment. query: [1, heads, N, D]; returns [1, N, heads, D]."""
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    for segment, offset in zip(batch.segments, batch.offsets):
        out[0, offset:offset + segment.length] = sdpa_attention.attend_segment(
            query[0, :, offset:offset + segment.length], k_layer, v_layer, segment.slot, segment.start, scale)
    return out


def attend_segments_torch(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                          batch: PrefillBatch, layer: int, scale: float) -> torch.Tensor:
    """The torch path, one segment at a time. query: [1, heads, N, D]; k_layer, v_layer: [slots, kv_heads,
    capacity, D]. Returns [1, N, heads, D]; segments with an observer hand it their window tokens' mass."""
    _, H, N, D = query.shape
    kv_heads = k_layer.shape[1]
    group = H // kv_heads
    out = query.new_empty(1, N, H, D)
    for index, (segment, offset) in enumerate(zip(batch.segments, batch.offsets)):
        T, end = segment.length, segment.start + segment.length
        q = (query[0, :, offset:offset + T] * scale).reshape(kv_heads, group * T, D)  # [kv_heads, group * T, D]
        k = k_layer[segment.slot, :, :end]  # [kv_heads, end, D], a view of the cache
        v = v_layer[segment.slot, :, :end]
        scores = torch.matmul(q, k.transpose(-1, -2).to(q.dtype))  # [kv_heads, group * T, end]
        if T > 1:  # new token t may not see new tokens after it
            causal = torch.ones(T, T, dtype=torch.bool, device=query.device).triu_(1)  # [T, T]
            scores.view(kv_heads, group, T, end)[..., end - T:].masked_fill_(causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # [kv_heads, group * T, end]
        if tail := batch.tails[index]:  # the observer's window tokens: their mass, over them and the group
            segment.observer.add_mass(layer, probs.view(kv_heads, group, T, end)[:, :, T - tail:].sum(dim=(1, 2)),
                                      tail)
        o = torch.matmul(probs.to(q.dtype), v.to(q.dtype))  # [kv_heads, group * T, D]
        out[0, offset:offset + T] = o.view(H, T, D).transpose(0, 1)
    return out
