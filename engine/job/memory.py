"""Will the job fit in memory? Checked from the model's config before any weights are loaded.

The KV cache is the big allocation (slots x capacity x layers x 2 x kv_heads x head_dim x bytes,
see `KVCache.bytes_needed`); the weights come on top, and the prefix store of each model's cache
(`batch.prefix_cache` tokens of K/V, `engine.core.prefix_store`), the draft's lower-precision copy of
its linear weights (`engine.spec.draft.gemms`) when it has one (int8 from a GGUF model's own panels
makes none), the GGUF blocks a float32 CPU model
keeps for its few-row GEMMs (`engine.models.gguf_blocks`), the panels a bfloat16 CPU model's
linears are multiplied from on a CPU with AVX512-BF16 (`engine.core.linear.bf16_linear`), and the lean
CPU draft's compact bf16 store of its StreamingLLM/SnapKV/guided view
(`engine.spec.compressors.compact`). If they do not fit in what the device has free, the job stops
with one line that says so and names the largest `batch.size` that fits. This module only
estimates; it allocates nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config.schema import Recipe, round_scratch, slot_capacity
from engine.core.kernels import bf16_gemm_wanted, int8_panels_wanted
from engine.core.kv_cache import KVCache
from engine.core.prefix_store import PrefixStore
from engine.errors import JobError
from engine.models.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS
from engine.models.loading import model_shapes, resolve_device, resolve_dtype
from engine.models.registry import source_gguf
from engine.models.shapes import linear_params, shape_name, weight_bytes
from engine.spec.compressors.compact import CompactStore
from engine.spec.compressors.registry import COMPRESSORS
from engine.spec.draft.gemms import INT8, resolve_linear_dtype

HEADROOM = 0.9  # leave 10% of the free memory for activations, the allocator and the rest


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not block


def compact_bytes(recipe: Recipe, shapes: dict, slots: int, device: torch.device) -> int:
    """The lean CPU draft's compact store (StreamingLLM, SnapKV, guided), counted whenever it may be used."""
    d = recipe.draft
    method = COMPRESSORS.get(d.method)
    if device.type != "cpu" or method is None or not method.compact_store:
        return 0
    return CompactStore.bytes_needed(layers=shapes["layers"], slots=slots, kv_heads=shapes["kv_heads"],
                                     head_dim=shapes["head_dim"], kept=method.kept_entries(d), budget=d.budget,
                                     extra=round_scratch(recipe), ring_per_slot=method.compact_ring_per_slot)


def kv_bytes(recipe: Recipe, shapes: dict, slots: int, dtype: torch.dtype, tp: int) -> int:
    _, capacity = slot_capacity(recipe, shapes["max_context"])
    kv_heads = -(-shapes["kv_heads"] // tp)  # the largest shard under tensor parallelism
    return KVCache.bytes_needed(layers=shapes["layers"], slots=slots, kv_heads=kv_heads,
                                head_dim=shapes["head_dim"], capacity=capacity, dtype=dtype)


def prefix_store_bytes(recipe: Recipe, shapes: dict, dtype: torch.dtype, tp: int) -> int:
    """The prefix store of one model's cache (`batch.prefix_cache` tokens), with prefix reuse on."""
    b = recipe.batch
    if not b.prefix_reuse:
        return 0
    kv_heads = -(-shapes["kv_heads"] // tp)
    return PrefixStore.bytes_needed(layers=shapes["layers"], kv_heads=kv_heads, head_dim=shapes["head_dim"],
                                    dtype=dtype, block=b.prefix_block, capacity=b.prefix_cache)


def gguf_blocks_bytes(spec: str, shapes: dict, device: torch.device, dtype: torch.dtype) -> int:
    """At most what a GGUF model's kept blocks take: every linear weight and the lm_head in Q8_0, the
    largest format kept (1.06 bytes a weight), for a float32 CPU model converted from a GGUF."""
    if device.type != "cpu" or dtype != torch.float32 or shape_name(spec) is not None or source_gguf(spec) is None:
        return 0
    return linear_params(shapes) * max(BLOCK_BYTES.values()) // BLOCK_WEIGHTS


def bf16_panels_bytes(shapes: dict, device: torch.device, dtype: torch.dtype) -> int:
    """At most what a bfloat16 CPU model's weight panels take (a second bfloat16 copy of every linear
    weight and the lm_head), where its decode GEMMs take them (`kernels.bf16_gemm_wanted`). Under
    tensor parallelism the sharded layers keep none, but which stay whole depends on DeepSpeed, so
    every rank is charged the whole model's (an upper bound)."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not bf16_gemm_wanted():
        return 0
    return linear_params(shapes) * 2


def check_memory(recipe: Recipe, *, tp: int = 1) -> int:
    """Raise JobError if KV cache + weights exceed the free memory; returns the bytes needed."""
    device = resolve_device(recipe.device)
    dtype = resolve_dtype(recipe.dtype, device)
    element = torch.empty((), dtype=dtype).element_size()
    speculative = recipe.draft.method != "none"
    models = [recipe.model] + ([recipe.draft.model] if speculative and recipe.draft.model else [])
    shapes = [model_shapes(m) for m in models]
    slots = recipe.batch.size
    # The draft's lower-precision copy of its linear layers and lm_head (engine.spec.draft.gemms), if any.
    draft_dtype = resolve_linear_dtype(recipe.draft.linear_dtype, dtype, device) if speculative else None
    draft_copy = linear_params(shapes[-1]) * draft_dtype.itemsize // tp if draft_dtype else 0
    if draft_dtype == INT8 and gguf_blocks_bytes(models[-1], shapes[-1], device, dtype) and int8_panels_wanted():
        draft_copy = 0  # int8 from the model's own GGUF panels, counted in `blocks` below: no copy

    stores = sum(prefix_store_bytes(recipe, s, dtype, tp) for s in shapes)  # independent of the batch size
    blocks = sum(gguf_blocks_bytes(m, s, device, dtype) + bf16_panels_bytes(s, device, dtype)
                 for m, s in zip(models, shapes))

    def need(n: int) -> int:
        return (draft_copy + stores + blocks + compact_bytes(recipe, shapes[-1], n, device)
                + sum(kv_bytes(recipe, s, n, dtype, tp) + weight_bytes(s, element) // tp for s in shapes))

    total = need(slots)
    free = available_bytes(device)
    if total > HEADROOM * free:
        fits = 0
        while fits < slots and need(fits + 1) <= HEADROOM * free:
            fits += 1
        gib = 2 ** 30
        hint = f"batch.size {fits} fits" if fits else "lower batch.max_len or use a smaller dtype"
        if stores:
            hint += f" (the prefix store takes {stores / gib:.1f} GiB: batch.prefix_cache)"
        raise JobError(f"batch.size {slots} x batch.max_len needs {total / gib:.1f} GiB (KV cache + weights"
                       f"{' + prefix store' if stores else ''}) but {device.type} has {free / gib:.1f} GiB free; {hint}")
    return total
