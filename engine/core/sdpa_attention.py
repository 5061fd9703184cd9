"""Attention over the engine's KV cache through torch's fused `scaled_dot_product_attention`: the CUDA
path when flash-attn is not installed, for decode/verify forwards (every row at once) and prefill
segments (one segment at a time).

The query heads of a GQA group are folded into the query axis ([B, kv_heads, group * T, D], token
fastest), so SDPA sees as many query heads as K/V heads and reads each K/V head once, with no repeat.
Which cache positions each query sees goes in a boolean mask (a row's own prefix, causal among its new
tokens); with a mask SDPA picks its memory-efficient kernel, one pass over K/V with an online softmax,
instead of the per-row matmul + softmax of the torch path, which on an H200 ran decode at ~5% of the
read bandwidth (BENCHMARKS section 22). It does not return attention mass (the guided draft's scores
come from the torch path) and it is not used on CPUs (the fused C++ kernels are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_rows(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, slots: list[int],
                slot_tensor: torch.Tensor, starts: torch.Tensor, longest: int, scale: float) -> torch.Tensor:
    """Each row's T new tokens over its cached prefix, all rows in one SDPA call.

    query: [B, heads, T, D]; k_layer, v_layer: [slots, kv_heads, capacity, D]; slots / slot_tensor: the
    rows' cache slots ([B]); starts: [B] long, the position of each row's first new token (its K/V are
    already cached); longest: the largest start + T (given, not read from `starts`, which would wait for
    the device in every layer). Returns [B, T, heads, D].
    """
    B, _, T, _ = query.shape
    first = slots[0]
    if slots == list(range(first, first + B)):  # consecutive slots: a view of the cache, no copy
        k, v = k_layer[first:first + B, :, :longest], v_layer[first:first + B, :, :longest]
    else:  # [B, kv_heads, longest, D], only the positions some row reads
        k, v = k_layer[slot_tensor, :, :longest], v_layer[slot_tensor, :, :longest]
    token_pos = starts[:, None] + torch.arange(T, device=query.device)  # [B, T]
    return _attend(query, k, v, token_pos, scale)


def attend_segment(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, slot: int, start: int,
                   scale: float) -> torch.Tensor:
    """One prefill segment: its T tokens (positions start .. start + T - 1, K/V cached) over the slot's
    prefix. query: [heads, T, D]. Returns [T, heads, D]."""
    end = start + query.shape[1]
    token_pos = torch.arange(start, end, device=query.device)[None]  # [1, T]
    k, v = k_layer[slot:slot + 1, :, :end], v_layer[slot:slot + 1, :, :end]  # [1, kv_heads, end, D]
    return _attend(query[None], k, v, token_pos, scale)[0]


def _attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_pos: torch.Tensor,
            scale: float) -> torch.Tensor:
    """query: [B, heads, T, D]; k, v: [B, kv_heads, L, D] (position p at index p); token_pos: [B, T] each
    new token's position. Folds each GQA group's heads into the query axis (token fastest), masks every
    folded query to the positions at or before its own, and unfolds: returns [B, T, heads, D]."""
    B, H, T, D = query.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = H // kv_heads
    keys = torch.arange(length, device=query.device)  # [L]
    visible = keys[None, None, :] <= token_pos[:, :, None]  # [B, T, L]
    mask = visible[:, None].expand(B, group, T, length).reshape(B, 1, group * T, length)
    q = query.reshape(B, kv_heads, group * T, D)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=scale)  # [B, kv_heads, group * T, D]
    return out.reshape(B, H, T, D).transpose(1, 2)
