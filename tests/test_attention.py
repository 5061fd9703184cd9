"""Every attention backend against the plain masked reference, on ragged rows and mixed new-token counts."""

from __future__ import annotations

import os

import pytest
import torch

from engine.core import attention, kernels as cpu_kernels, sdpa_attention
from engine.core.attention import ForwardBatch, attend_cached_torch, attend_view, reference_attention
from engine.core.kv_cache import KVCache
from engine.core.prefill_attention import PrefillBatch, Segment, attend_segments_sdpa

HEADS, KV_HEADS, D = 6, 2, 32  # GQA group of 3


def make_cache(slots=5, capacity=96, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(layers=1, slots=slots, kv_heads=KV_HEADS, head_dim=D, capacity=capacity, dtype=dtype, device=device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    return cache


def expected(query, cache, batch, visible):
    """Reference over the slot's whole capacity with an explicit mask: visible(b, t, pos) -> bool."""
    B, H, T, _ = query.shape
    keys = cache.k[0][batch.slot_tensor]
    values = cache.v[0][batch.slot_tensor]
    S = cache.capacity
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for pos in range(S):
                mask[b, t, pos] = visible(b, t, pos)
    return reference_attention(query.float(), keys.float(), values.float(), mask, D ** -0.5)


def causal(batch):
    return lambda b, t, pos: pos <= batch.starts[b] + t


@pytest.mark.parametrize("T", [1, 4, 13])
def test_torch_backend_matches_reference(T):
    cache = make_cache()
    batch = ForwardBatch(cache, slots=[3, 0, 4], starts=[50, 0, 17], num_new=T)
    query = torch.randn(3, HEADS, T, D)
    out = attend_cached_torch(query, cache.k[0], cache.v[0], batch, D ** -0.5)
    torch.testing.assert_close(out, expected(query, cache, batch, causal(batch)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [[3, 0, 4], [1, 2, 3]])  # gathered rows, and a view of consecutive slots
@pytest.mark.parametrize("T", [1, 4, 13])
def test_sdpa_backend_matches_reference(slots, T):
    """The CUDA path without flash-attn; torch's SDPA runs on a CPU too, so it is checked here."""
    cache = make_cache()
    batch = ForwardBatch(cache, slots=slots, starts=[50, 0, 17], num_new=T)
    query = torch.randn(3, HEADS, T, D)
    out = sdpa_attention.attend_rows(query, cache.k[0], cache.v[0], batch.slots, batch.slot_tensor,
                                     batch.start_tensor, max(batch.ends), D ** -0.5)
    torch.testing.assert_close(out, expected(query, cache, batch, causal(batch)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start,T", [(0, 9), (30, 1), (41, 17)])
def test_sdpa_prefill_segment_matches_reference(start, T):
    cache = make_cache()
    batch = ForwardBatch(cache, slots=[2], starts=[start], num_new=T)
    query = torch.randn(1, HEADS, T, D)
    out = sdpa_attention.attend_segment(query[0], cache.k[0], cache.v[0], 2, start, D ** -0.5)
    torch.testing.assert_close(out[None], expected(query, cache, batch, causal(batch)), atol=1e-5, rtol=1e-5)


def test_sdpa_prefill_of_packed_segments_matches_reference():
    """CUDA's prefill loop (SDPA per segment), run here on a CPU: segments of several rows packed."""
    cache = make_cache()
    segments = [Segment(3, 50, 7), Segment(0, 0, 12), Segment(4, 17, 1)]
    query = torch.randn(1, HEADS, 20, D)
    out = attend_segments_sdpa(query, cache.k[0], cache.v[0], PrefillBatch(cache, segments), D ** -0.5)
    offset = 0
    for segment in segments:
        alone = ForwardBatch(cache, slots=[segment.slot], starts=[segment.start], num_new=segment.length)
        part = query[:, :, offset:offset + segment.length]
        torch.testing.assert_close(out[:, offset:offset + segment.length], expected(part, cache, alone, causal(alone)),
                                   atol=1e-5, rtol=1e-5)
        offset += segment.length


def test_the_cpu_kernel_is_built_wherever_a_compiler_exists():
    if not cpu_kernels.compiler_available() and os.environ.get("CI") != "true":
        pytest.skip("no C++ compiler on this machine: magicdec uses the torch attention path here")
    assert cpu_kernels.load() is not None, "the fused CPU kernel failed to build"


def _kernel():
    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?); the torch path is used")
    return kernel


def test_the_report_names_bfloat16_dot_products_where_a_bfloat16_prefill_takes_them():
    """`hardware.attention.prefill` says "bfloat16 dot products" exactly where the kernel would take a
    bfloat16 model's prefill onto them (never for a float32 cache), and not once they are switched off."""
    kernel = _kernel()
    cpu = torch.device("cpu")
    try:
        for allowed in (True, False):
            kernel.prefill_use_bf16_dot(allowed)
            named = "bfloat16 dot products" in attention.attention_paths(cpu, torch.bfloat16, 64)["prefill"]
            assert named == kernel.prefill_bf16_dot_in_use(64)
            assert "bfloat16 dot products" not in attention.attention_paths(cpu, torch.float32, 64)["prefill"]
        assert not kernel.prefill_bf16_dot_in_use(64)  # switched off
    finally:
        kernel.prefill_use_bf16_dot(True)


@pytest.fixture(params=["vector", "portable"])
def kernel(request):
    """The fused kernel with its AVX-512 task allowed, or forced onto the portable task."""
    kernel = _kernel()
    compiled = kernel.use_vector_path(request.param == "vector")
    if request.param == "vector" and not compiled:
        pytest.skip("this CPU has no AVX-512: only the portable task is built")
    yield kernel
    kernel.use_vector_path(True)


@pytest.mark.parametrize("T", [1, 2, 5, 16])
def test_fused_cpu_kernel_matches_reference(kernel, T):
    cache = make_cache(capacity=300)
    # Lengths around the kernel's 64-entry blocks, and a row whose new tokens start at 0.
    batch = ForwardBatch(cache, slots=[1, 4, 2, 0], starts=[0, 63, 64, 250], num_new=T)
    query = torch.randn(4, HEADS, T, D)
    out = attention.attend_cached_fused(kernel, query, cache.k[0], cache.v[0], batch, D ** -0.5)
    torch.testing.assert_close(out, expected(query, cache, batch, causal(batch)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])
def test_fused_cpu_kernel_head_sizes(kernel, head_dim):
    """Head sizes with an AVX-512 task (64, 128) and without one (16, 40: the portable task serves them)."""
    g = torch.Generator().manual_seed(head_dim)
    cache = KVCache(layers=1, slots=3, kv_heads=KV_HEADS, head_dim=head_dim, capacity=160, dtype=torch.float32,
                    device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    batch = ForwardBatch(cache, slots=[2, 0, 1], starts=[129, 5, 70], num_new=3)
    query = torch.randn(3, HEADS, 3, head_dim, generator=g)
    out = attention.attend_cached_fused(kernel, query, cache.k[0], cache.v[0], batch, head_dim ** -0.5)
    keys, values = cache.k[0][batch.slot_tensor], cache.v[0][batch.slot_tensor]
    position = torch.arange(cache.capacity)
    mask = position[None, None, :] <= (torch.tensor(batch.starts)[:, None] + torch.arange(3)[None, :])[..., None]
    want = reference_attention(query, keys, values, mask, head_dim ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def _view(batch, n=40, seed=3):
    """Random positions per (row, KV head) with some invalid entries, duplicates excluded."""
    g = torch.Generator().manual_seed(seed)
    B = len(batch.slots)
    positions = torch.zeros(B, KV_HEADS, n, dtype=torch.long)
    for b in range(B):
        for h in range(KV_HEADS):
            positions[b, h] = torch.randperm(batch.ends[b], generator=g)[:n] if batch.ends[b] >= n else \
                torch.cat([torch.arange(batch.ends[b]), torch.zeros(n - batch.ends[b], dtype=torch.long)])
    valid = torch.rand(B, KV_HEADS, n, generator=g) < 0.8
    for b in range(B):
        if batch.ends[b] < n:
            valid[b, :, batch.ends[b]:] = False
    return positions, valid


@pytest.mark.parametrize("fused", [False, "vector", "portable"])
@pytest.mark.parametrize("T", [1, 2])
def test_view_attention_matches_reference(request, fused, T):
    cache = make_cache(capacity=200)
    batch = ForwardBatch(cache, slots=[2, 0, 3], starts=[150, 20, 90], num_new=T)
    positions, valid = _view(batch)
    query = torch.randn(3, HEADS, T, D)
    if fused:
        kernel = _kernel()
        if not kernel.use_vector_path(fused == "vector") and fused == "vector":
            pytest.skip("this CPU has no AVX-512: only the portable task is built")
        request.addfinalizer(lambda: kernel.use_vector_path(True))
        out = attention.attend_cached_fused(kernel, query, cache.k[0], cache.v[0], batch, D ** -0.5, positions, valid)
    else:
        out = attend_view(query, cache.k[0], cache.v[0], batch, positions, valid, D ** -0.5)
    group = HEADS // KV_HEADS

    def visible_for_head(h):
        def visible(b, t, pos):
            listed = bool(((positions[b, h] == pos) & valid[b, h]).any())
            return listed and pos <= batch.starts[b] + t
        return visible

    # The reference takes one mask per row; compare one KV head's query heads at a time.
    for h in range(KV_HEADS):
        ref = expected(query, cache, batch, visible_for_head(h))
        heads = slice(h * group, (h + 1) * group)
        torch.testing.assert_close(out[:, :, heads], ref[:, :, heads], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
def test_fused_kernel_over_a_compact_store_matches_reference(kernel, dtype, T):
    """Every row of a small store, entry i holding the position listed for it (-1: empty), K/V in
    float32 or bfloat16 (the reference reads the same rounded values)."""
    g = torch.Generator().manual_seed(T)
    B, S = 3, 150  # entries cross the kernel's 64-entry blocks
    store = make_cache(slots=4, capacity=S, dtype=dtype, seed=T)
    slots, ends = torch.tensor([2, 0, 3]), torch.tensor([400, 90, 151])
    entry_pos = torch.stack([torch.randperm(int(e), generator=g)[:S] if e >= S else
                             torch.cat([torch.randperm(int(e), generator=g), torch.full((S - int(e),), -1)])
                             for e in ends])  # [B, S], distinct positions per row
    entry_pos[torch.rand(B, S, generator=g) < 0.2] = -1
    query = torch.randn(B, HEADS, T, D, generator=g)
    q = (query * D ** -0.5).reshape(B, KV_HEADS, (HEADS // KV_HEADS) * T, D)
    out = kernel.attend_entries(q, store.k[0], store.v[0], slots, ends, T, entry_pos)
    out = out.view(B, HEADS, T, D).transpose(1, 2)
    last = ends[:, None] - T + torch.arange(T)[None, :]  # [B, T]: each new token's position
    mask = (entry_pos[:, None, :] >= 0) & (entry_pos[:, None, :] <= last[..., None])  # [B, T, S]
    want = reference_attention(query, store.k[0][slots].float(), store.v[0][slots].float(), mask, D ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_cache_write_lands_at_each_rows_positions():
    cache = make_cache()
    batch = ForwardBatch(cache, slots=[4, 1], starts=[10, 3], num_new=2)
    key = torch.randn(2, KV_HEADS, 2, D)
    value = torch.randn(2, KV_HEADS, 2, D)
    cache.write(0, batch.write_slots, batch.write_positions, key, value)
    torch.testing.assert_close(cache.k[0, 4, :, 10:12], key[0])
    torch.testing.assert_close(cache.v[0, 1, :, 3:5], value[1])


def test_kv_cache_costs_exactly_its_formula():
    cache = KVCache(layers=30, slots=4, kv_heads=3, head_dim=64, capacity=100, dtype=torch.float32, device="cpu")
    formula = 4 * 100 * 30 * 2 * 3 * 64 * 4  # slots x capacity x layers x 2 x kv_heads x head_dim x bytes
    assert cache.nbytes == formula == KVCache.bytes_needed(layers=30, slots=4, kv_heads=3, head_dim=64,
                                                           capacity=100, dtype=torch.float32)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("T", [1, 4])
def test_cuda_backend_matches_reference(T):
    cache = make_cache(device="cuda", dtype=torch.bfloat16)
    batch = ForwardBatch(cache, slots=[3, 0, 4], starts=[50, 0, 17], num_new=T)
    query = torch.randn(3, HEADS, T, D, device="cuda", dtype=torch.bfloat16)
    out = attention.attend_full(query, 0, batch, D ** -0.5)  # flash-attn if installed, else torch's SDPA
    ref = expected(query.cpu(), _to_cpu(cache), _cpu_batch(batch), causal(batch))
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=3e-2, rtol=3e-2)


def _to_cpu(cache):
    copy = KVCache(layers=1, slots=cache.slots, kv_heads=KV_HEADS, head_dim=D, capacity=cache.capacity,
                   dtype=torch.float32, device="cpu")
    copy.k.copy_(cache.k.float().cpu())
    copy.v.copy_(cache.v.float().cpu())
    return copy


def _cpu_batch(batch):
    return ForwardBatch(_to_cpu(batch.cache), batch.slots, batch.starts, batch.num_new)
