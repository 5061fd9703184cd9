"""Attention over the engine's KV cache, registered with transformers as `attn_implementation="magicdec"`.

transformers' model classes still run every projection, RoPE, MLP and norm; for each layer they hand
this module the new tokens' q/k/v (after RoPE). Here the new k/v are written into the engine's
`KVCache` at each row's own positions, and the queries attend either to everything the row has
cached (the target) or to a draft's compressed view of it (a `DraftView`, chosen by a compressor).
What to attend to travels in a `ForwardBatch` passed as a keyword argument to `model(...)`, which
transformers forwards untouched to this function.

Backends (all held against `reference_attention` in the tests):
- `attend_cached_fused`: CPU, float32 or bfloat16 K/V (float32 arithmetic), up to `FUSED_MAX_NEW` new
  tokens (decode, verify): the C++ kernel of `engine/core/csrc`, one pass over each row's K/V with an
  online softmax (AVX-512, AVX2 or portable tasks, as compiled for this CPU). Rows whose slots hold
  the same prompt-prefix K/V (prefix reuse; `engine.core.shared_prefix`) read it once per group
  (`attend_cached_shared`, the same output bits).
- `attend_cached_torch`: any device; per row, the query heads of a GQA group are folded into the
  query axis so one matmul reads that group's K/V straight from the cache (no copy, no repeat).
- `attend_cached_flash`: CUDA with flash-attn installed, `flash_attn_with_kvcache` with per-row
  `cache_seqlens` and `cache_batch_idx`; without it, `engine.core.sdpa_attention` (torch's fused SDPA,
  every row in one call).
- `attend_view`: the draft's compressed view: gathers the selected positions (budget-sized, small)
  and attends to them with an explicit mask.
- a `PrefillBatch` (prompt chunks of several rows packed along the token axis) goes to
  `engine.core.prefill_attention`.
A forward over the whole cache may also ask for each position's attention mass (`ForwardBatch.mass`,
the guided draft's scores, from the verification pass): on CPU the fused kernel's
`attend_cached_scores` returns it from its one pass over K/V; elsewhere (CUDA, whose flash-attn path
cannot return it, or no compiled kernel) the torch path computes it from its explicit softmax.
This module does not choose positions (compressors do) nor run models (the engine does).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from engine.core import kernels as cpu_kernels
from engine.core import sdpa_attention, shared_prefix
from engine.core.kv_cache import KVCache
from engine.core.prefill_attention import PrefillBatch, attend_prefill

ATTN_NAME = "magicdec"
FUSED_MAX_NEW = 16  # new tokens per row the decode kernel takes (prefill chunks go through PrefillBatch)
BATCH_KWARG = "magicdec_batch"

try:  # optional CUDA fast path
    from flash_attn import flash_attn_with_kvcache  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_with_kvcache = None


class DraftView(Protocol):
    """Which cached positions a draft forward may read, per row and KV head, for one layer."""

    def select(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query: [B, heads, T, head_dim]. Returns positions [B, kv_heads, N] (long) and valid [B, kv_heads, N]."""


@dataclasses.dataclass
class ForwardBatch:
    """Per-forward metadata shared by every layer: where each row's new tokens go and what they see.

    Every row carries the same number `num_new` of new tokens; row b's tokens occupy positions
    `starts[b] .. starts[b] + num_new - 1` of cache slot `slots[b]`.
    """

    cache: KVCache
    slots: list[int]
    starts: list[int]
    num_new: int
    view: DraftView | None = None  # None: attend to all cached positions (causal among the new ones)
    write_kv: bool = True
    # With view None: [layers, B, kv_heads, N] float32, N >= every row's end; each layer writes
    # mass[layer, b, h, p] = the softmax probability position p gets, summed over KV head h's query
    # heads and the new tokens (0 for p >= ends[b]). The guided draft's scores.
    mass: torch.Tensor | None = None

    def __post_init__(self) -> None:
        device = self.cache.device
        T = self.num_new
        self.slot_tensor = torch.tensor(self.slots, dtype=torch.long, device=device)  # [B]
        self.start_tensor = torch.tensor(self.starts, dtype=torch.long, device=device)  # [B]
        offsets = torch.arange(T, dtype=torch.long, device=device)
        self.positions = self.start_tensor[:, None] + offsets[None, :]  # [B, T] position of each new token
        self.write_slots = self.slot_tensor.repeat_interleave(T)  # [B * T]
        self.write_positions = self.positions.reshape(-1)  # [B * T]
        self.ends = [s + T for s in self.starts]  # exclusive end of each row's visible range
        for slot, end in zip(self.slots, self.ends):
            if end > self.cache.capacity:
                raise ValueError(f"slot {slot}: position {end - 1} beyond cache capacity {self.cache.capacity}")
        if self.mass is not None:
            assert self.view is None, "attention mass comes from a forward over the whole cache"
            assert self.mass.shape[-1] >= max(self.ends), "the mass buffer must cover every row's positions"
        self._groups: shared_prefix.PrefixGroups | None | bool = False  # False: not asked yet

    def prefix_groups(self) -> shared_prefix.PrefixGroups | None:
        """This forward's rows grouped by the prefix K/V they hold alike (None: no two rows share
        any); asked once per forward, which is then counted in the cache's read tallies."""
        if self._groups is False:
            cache = self.cache
            origins = [cache.origins[slot] for slot in self.slots]
            self._groups = None
            if shared_prefix.enabled() and sum(1 for o in origins if o) >= 2:
                self._groups = shared_prefix.group_rows(origins, cache.origin_block, self.starts,
                                                        cache.device)
            cache.positions_read += sum(self.ends)
            if self._groups is not None:
                cache.positions_shared += self._groups.positions_saved
        return self._groups


def magicdec_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature; returns ([B, T, heads, head_dim], None)."""
    batch: ForwardBatch | PrefillBatch | None = kwargs.get(BATCH_KWARG)
    if batch is None:
        raise RuntimeError("the magicdec attention needs a ForwardBatch: call the model through the engine")
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = batch.cache
    if batch.write_kv:
        cache.write(layer, batch.write_slots, batch.write_positions, key, value)
    if isinstance(batch, PrefillBatch):
        kernel = cpu_kernel_for(query, cache)
        return attend_prefill(kernel, query, cache.k[layer], cache.v[layer], batch, layer, scale), None
    if batch.view is not None:
        positions, valid = batch.view.select(layer, query)
        if _fused_ok(query, cache) and (kernel := cpu_kernels.load()) is not None:
            out = attend_cached_fused(kernel, query, cache.k[layer], cache.v[layer], batch, scale,
                                      positions, valid)
        else:
            out = attend_view(query, cache.k[layer], cache.v[layer], batch, positions, valid, scale)
    else:
        out = attend_full(query, layer, batch, scale)
    return out, None


def attend_full(query: torch.Tensor, layer: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Every row's new tokens over its whole cached prefix, by the best backend here; with
    `batch.mass`, also that layer's attention mass. query: [B, heads, T, D] -> [B, T, heads, D]."""
    cache = batch.cache
    k_layer, v_layer = cache.k[layer], cache.v[layer]
    mass = batch.mass[layer] if batch.mass is not None else None  # [B, kv_heads, N]
    if mass is None and query.is_cuda:
        if flash_attn_with_kvcache is not None:
            return attend_cached_flash(query, k_layer, v_layer, batch, scale)
        return sdpa_attention.attend_rows(query, k_layer, v_layer, batch.slots, batch.slot_tensor,
                                          batch.start_tensor, max(batch.ends), scale)
    if _fused_ok(query, cache) and (kernel := cpu_kernels.load()) is not None:
        if mass is None and kernel.shares_prefix_reads(cache.head_dim) and (groups := batch.prefix_groups()):
            return attend_cached_fused(kernel, query, k_layer, v_layer, batch, scale, groups=groups)
        return attend_cached_fused(kernel, query, k_layer, v_layer, batch, scale, mass=mass)
    return attend_cached_torch(query, k_layer, v_layer, batch, scale, mass=mass)


def attention_paths(device: torch.device, cache_dtype: torch.dtype, head_dim: int | None = None) -> dict[str, str]:
    """Which backend serves decode/verify, draft views and prefill chunks here (for the job report), so
    that nothing falls back to a slow path unseen. head_dim: the model's (says whether a bfloat16 model's
    prefill takes the kernel's bfloat16 dot products)."""
    if device.type == "cuda":
        decode = "flash-attn" if flash_attn_with_kvcache is not None else "torch SDPA (no flash-attn installed)"
        return {"decode": decode, "draft_view": "torch gather", "prefill": "torch SDPA per segment"}
    kernel = cpu_kernels.load() if cache_dtype in KERNEL_CACHE_DTYPES else None
    if kernel is None:
        why = "no compiled CPU kernel" if cache_dtype in KERNEL_CACHE_DTYPES else f"{cache_dtype} cache"
        return {"decode": f"torch ({why})", "draft_view": f"torch gather ({why})", "prefill": f"torch ({why})"}
    isa = kernel.vector_isa()
    prefill = f"fused CPU prefill kernel ({isa}"
    if kernel.prefill_amx_in_use():
        prefill += ", AMX tiles for head sizes that are multiples of 32"
    elif cache_dtype == torch.bfloat16 and head_dim is not None and kernel.prefill_bf16_dot_in_use(head_dim):
        prefill += "; bfloat16 dot products"
    prefill += ")"
    return {"decode": f"fused CPU kernel ({isa})", "draft_view": f"fused CPU kernel ({isa})", "prefill": prefill}


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, magicdec_attention)


_register()


KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16)  # what the fused CPU kernels read (float32 math)


def cpu_kernel_for(query: torch.Tensor, cache: KVCache):
    """The fused CPU kernels where they can attend `query` over `cache` here (a CPU, a cache dtype they
    read, a build), else None."""
    return cpu_kernels.load() if query.device.type == "cpu" and cache.k.dtype in KERNEL_CACHE_DTYPES else None


def _fused_ok(query: torch.Tensor, cache: KVCache) -> bool:
    return query.device.type == "cpu" and cache.k.dtype in KERNEL_CACHE_DTYPES and query.shape[2] <= FUSED_MAX_NEW


def attend_cached_fused(kernel, query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                        batch: ForwardBatch, scale: float, positions: torch.Tensor | None = None,
                        valid: torch.Tensor | None = None, mass: torch.Tensor | None = None,
                        groups: shared_prefix.PrefixGroups | None = None) -> torch.Tensor:
    """The fused C++ kernel, over the whole cached prefix or over listed positions ([B, kv_heads, N]).

    Same contract as `attend_cached_torch` / `attend_view`: returns [B, T, heads, D]. mass (whole
    prefix only): [B, kv_heads, N] filled from the kernel's `attend_cached_scores`, the same pass.
    groups (whole prefix only): rows that read their shared prefix once per group.
    """
    B, H, T, D = query.shape
    kv_heads = k_layer.shape[1]
    q = (query.float() * scale).reshape(B, kv_heads, (H // kv_heads) * T, D)  # heads of a group, token fastest
    ends = batch.start_tensor + T
    if mass is not None:
        out, scores = kernel.attend_cached_scores(q, k_layer, v_layer, batch.slot_tensor, ends, T, mass.shape[-1])
        mass.copy_(scores)  # scores: [B, kv_heads, N]
    elif groups is not None:
        out = kernel.attend_cached_shared(q, k_layer, v_layer, batch.slot_tensor, ends, T, groups.members,
                                          groups.offsets, groups.shared)
    elif positions is None:
        out = kernel.attend_cached(q, k_layer, v_layer, batch.slot_tensor, ends, T)
    else:
        out = kernel.attend_positions(q, k_layer, v_layer, batch.slot_tensor, ends, T,
                                      positions.contiguous(), valid.contiguous())
    return out.view(B, H, T, D).transpose(1, 2).to(query.dtype)  # out: [B, kv_heads, group * T, D]


def attend_cached_torch(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                        batch: ForwardBatch, scale: float, mass: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each row's new tokens over its own cached prefix (ragged lengths, no padding).

    query: [B, heads, T, head_dim]; k_layer, v_layer: [slots, kv_heads, capacity, head_dim].
    mass: None, or [B, kv_heads, N] to fill with each position's probability summed over the group's
    query heads and the T tokens (zeros past a row's end). Returns [B, T, heads, head_dim].
    """
    B, H, T, D = query.shape
    kv_heads = k_layer.shape[1]
    group = H // kv_heads
    out = query.new_empty(B, T, H, D)
    causal = None
    if T > 1:  # new token t may not see new tokens after it
        causal = torch.ones(T, T, dtype=torch.bool, device=query.device).triu_(1)  # [T, T]
    for row, (slot, end) in enumerate(zip(batch.slots, batch.ends)):
        q = (query[row] * scale).reshape(kv_heads, group * T, D)  # [kv_heads, group * T, D]
        k = k_layer[slot, :, :end]  # [kv_heads, end, D], a view of the cache
        v = v_layer[slot, :, :end]
        scores = torch.matmul(q, k.transpose(-1, -2))  # [kv_heads, group * T, end]
        if causal is not None:
            scores.view(kv_heads, group, T, end)[..., end - T:].masked_fill_(causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        if mass is not None:
            mass[row, :, :end] = probs.sum(dim=1)  # [kv_heads, end]
            mass[row, :, end:] = 0
        o = torch.matmul(probs.to(v.dtype), v)  # [kv_heads, group * T, D]
        out[row] = o.view(H, T, D).transpose(0, 1)
    return out


def attend_cached_flash(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                        batch: ForwardBatch, scale: float) -> torch.Tensor:
    """flash-attn's kvcache kernel; the new K/V are already in the cache, so cache_seqlens = ends.

    Its cache layout is [slots, capacity, kv_heads, D]; ours is [slots, kv_heads, capacity, D], which
    transposes into it as a strided view (flash-attn takes the head and row strides as given).
    """
    q = query.transpose(1, 2)  # [B, T, heads, D]
    seqlens = torch.tensor(batch.ends, dtype=torch.int32, device=query.device)
    out = flash_attn_with_kvcache(
        q, k_layer.transpose(1, 2), v_layer.transpose(1, 2),
        cache_seqlens=seqlens, cache_batch_idx=batch.slot_tensor.to(torch.int32),
        softmax_scale=scale, causal=True)
    return out  # [B, T, heads, D]


def attend_view(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: ForwardBatch,
                positions: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention restricted to selected positions (a draft's compressed KV).

    positions, valid: [B, kv_heads, N]. A position is visible to new token t of row b if it is valid and
    not after that token's own position. Returns [B, T, heads, D].
    """
    B, H, T, D = query.shape
    slots, kv_heads, capacity, _ = k_layer.shape
    group = H // kv_heads
    N = positions.shape[-1]
    base = (batch.slot_tensor[:, None] * kv_heads + torch.arange(kv_heads, device=query.device)) * capacity
    flat = (base[:, :, None] + positions).reshape(-1)  # [B * kv_heads * N]
    k = k_layer.reshape(-1, D).index_select(0, flat).view(B, kv_heads, N, D)
    v = v_layer.reshape(-1, D).index_select(0, flat).view(B, kv_heads, N, D)
    q = (query * scale).reshape(B, kv_heads, group * T, D)
    scores = torch.matmul(q, k.transpose(-1, -2)).view(B, kv_heads, group, T, N)
    query_pos = batch.positions[:, None, None, :, None]  # [B, 1, 1, T, 1]
    visible = valid[:, :, None, None, :] & (positions[:, :, None, None, :] <= query_pos)
    scores = scores.masked_fill(~visible, float("-inf")).view(B, kv_heads, group * T, N)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    o = torch.matmul(probs, v)  # [B, kv_heads, group * T, D]
    return o.view(B, H, T, D).transpose(1, 2)


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain masked attention, the slow obviously-correct yardstick for every backend.

    query: [B, heads, T, D]; keys, values: [B, kv_heads, S, D]; mask: [B, T, S] (True = may attend).
    K/V are repeated per query head explicitly. Returns [B, T, heads, D].
    """
    B, H, T, D = query.shape
    group = H // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()  # [B, heads, S, D]
    v = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("bhtd,bhsd->bhts", query.float(), k) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bhsd->bthd", probs, v).to(query.dtype)
