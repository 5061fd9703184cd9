"""The fused CPU kernels (engine/core/csrc) entry point by entry point, against slow, obviously-correct
references (the engine-level attention tests are tests/test_attention.py).

Every entry point is compared with a float64 reference that
masks explicitly and repeats K/V per query head; bfloat16 K/V are compared with a reference that
reads the same rounded values (`k.double()` of the bf16 tensor), so both dtypes use the same
tolerance: the kernels compute in float32 either way, the rounding of the inputs is shared.
Each attention test runs on the vector path (AVX2 / AVX-512, where compiled in) and the portable one.
"""
import hashlib
import math
from pathlib import Path

import pytest
import torch

from engine.cache_dir import file_lock

from engine.cache_dir import cache_root
from engine.core import kernels as cpu_kernels

W16_SOURCE = Path(__file__).with_name("kernels") / "prefill_w16_emulation.cpp"


def load_kernels():
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("no C++ compiler here: the fused CPU kernels cannot be built (the torch path is used)")
    return module


def load_w16_emulation():
    """cpu_prefill.cpp built with a 16-lane policy emulated on AVX2 (tests/kernels/prefill_w16_emulation.cpp):
    the AVX-512 prefill task's width-dependent logic, tested on a machine without AVX-512."""
    from torch.utils.cpp_extension import load

    csrc = cpu_kernels.SOURCES[0].parent
    key = hashlib.sha256(W16_SOURCE.read_bytes() + (csrc / "cpu_prefill.cpp").read_bytes()
                         + (csrc / "vector_math.h").read_bytes() + (csrc / "amx_tiles.h").read_bytes()
                         + cpu_kernels.cpu_flags().encode()).hexdigest()[:12]
    build = cache_root() / "torch_extensions" / f"magicdec_prefill_w16_{key}"
    build.mkdir(parents=True, exist_ok=True)
    with file_lock(build / "build.lock"):
        (build / "lock").unlink(missing_ok=True)
        return load(name=f"magicdec_prefill_w16_{key}", sources=[str(W16_SOURCE)], extra_include_paths=[str(csrc)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
                    build_directory=str(build), verbose=False)

ATOL = RTOL = 1e-5  # float32 accumulation over <= a few thousand keys stays well inside this
HEAD_DIMS = [16, 32, 40, 64, 80, 96, 128]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="session")
def kernels():
    return load_kernels()


@pytest.fixture(params=["vector", "portable"])
def path(request, kernels):
    compiled = kernels.use_vector_path(request.param == "vector")
    if request.param == "vector" and not compiled:
        pytest.skip("no vector path compiled in")
    yield request.param
    kernels.use_vector_path(True)


@pytest.fixture(params=["amx", "vector", "portable"])
def prefill_path(request, kernels):
    """The prefill task: on the AMX tile unit (head sizes that are multiples of 32), the vector task
    (AVX-512 or AVX2; other head sizes take it on the AMX path too), or the portable one."""
    previous = kernels.use_amx(True)
    if request.param == "amx" and not kernels.prefill_amx_in_use():
        kernels.use_amx(previous)
        pytest.skip("no AMX tiles here (the CPU or the build lacks AMX-BF16, or Linux did not lend them)")
    kernels.use_amx(request.param == "amx")
    compiled = kernels.use_vector_path(request.param != "portable")
    if request.param == "vector" and not compiled:
        kernels.use_amx(previous)
        pytest.skip("no vector path compiled in")
    yield request.param
    kernels.use_vector_path(True)
    kernels.use_amx(previous)


def close(out, ref):
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------------------------------
# Decode / verify / draft: attend_cached, attend_cached_scores, attend_positions, attend_entries.
# query [B, KVH, group * T, D] (head-major, token fastest), pre-scaled; row b's token t sees
# positions <= ends[b] - T + t.

def reference_rows(q, keys, values, key_pos, key_ok, end, T):
    """q [KVH, R, D]; keys, values [KVH, E, D]; key_pos, key_ok [KVH, E]. Returns (out, probs [KVH, R, E])."""
    R = q.shape[1]
    last = end - T + torch.arange(R) % T  # [R]
    visible = key_ok[:, None, :] & (key_pos[:, None, :] <= last[None, :, None])  # [KVH, R, E]
    scores = torch.einsum("hrd,hed->hre", q.double(), keys.double())
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a row that sees nothing: zeros
    return torch.einsum("hre,hed->hrd", probs, values.double()), probs


def make_cache(slots, kv_heads, capacity, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv_heads, capacity, D, generator=g).to(dtype)
    v = torch.randn(slots, kv_heads, capacity, D, generator=g).to(dtype)
    return k, v


def make_query(B, kv_heads, group, T, D, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, kv_heads, group * T, D, generator=g) * D ** -0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("T,group", [(1, 3), (4, 3), (3, 1), (16, 2), (17, 1)])  # 17: masks per query row
def test_attend_cached(kernels, path, dtype, D, T, group):
    KVH, capacity = 2, 300
    k, v = make_cache(5, KVH, capacity, D, dtype)
    slots = torch.tensor([3, 0, 4, 1])
    ends = torch.tensor([T, 64 + T - 1, 130, capacity])  # block edges, a full cache
    q = make_query(len(slots), KVH, group, T, D)
    out = kernels.attend_cached(q, k, v, slots, ends, T)
    out2, mass = kernels.attend_cached_scores(q, k, v, slots, ends, T)
    assert mass.shape == (len(slots), KVH, int(ends.max()))
    for b, (slot, end) in enumerate(zip(slots.tolist(), ends.tolist())):
        pos = torch.arange(end).expand(KVH, end)
        ref, probs = reference_rows(q[b], k[slot, :, :end], v[slot, :, :end], pos, torch.ones_like(pos, dtype=torch.bool),
                                    end, T)
        close(out[b], ref)
        close(out2[b], ref)
        close(mass[b, :, :end], probs.sum(1))  # summed over the group's heads and the T tokens
        assert torch.all(mass[b, :, end:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_cached_scores_n_positions(kernels, path, dtype):
    """n_positions wider than every row's end: the tail is zero; each (row, KV head) sums to g * T."""
    D, KVH, group, T = 64, 3, 3, 4
    k, v = make_cache(2, KVH, 1000, D, dtype)
    slots, ends = torch.tensor([1, 0]), torch.tensor([777, 5])
    q = make_query(2, KVH, group, T, D)
    out, mass = kernels.attend_cached_scores(q, k, v, slots, ends, T, 1000)
    assert mass.shape == (2, KVH, 1000)
    close(mass.sum(-1), torch.full((2, KVH), float(group * T), dtype=torch.float64))
    assert torch.all(mass[0, :, 777:] == 0) and torch.all(mass[1, :, 5:] == 0)
    close(out, kernels.attend_cached(q, k, v, slots, ends, T).double())
    with pytest.raises(RuntimeError):
        kernels.attend_cached_scores(q, k, v, slots, ends, T, 700)  # below a row's end


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("T", [1, 4])
def test_attend_positions(kernels, path, dtype, D, T):
    KVH, group, capacity, N = 2, 3, 400, 150
    k, v = make_cache(3, KVH, capacity, D, dtype)
    slots, ends = torch.tensor([2, 0]), torch.tensor([390, 100])
    q = make_query(2, KVH, group, T, D)
    g = torch.Generator().manual_seed(7)
    positions = torch.stack([torch.stack([torch.randperm(int(e), generator=g)[:N] if e >= N else
                                          torch.randint(0, int(e), (N,), generator=g) for _ in range(KVH)])
                             for e in ends])  # [B, KVH, N]; row 1 lists repeats
    valid = torch.rand(2, KVH, N, generator=g) < 0.8
    positions[:, :, -1] = ends[:, None] - 1  # the newest position: only the last token sees it
    valid[:, :, -1] = True
    out = kernels.attend_positions(q, k, v, slots, ends, T, positions, valid)
    for b, (slot, end) in enumerate(zip(slots.tolist(), ends.tolist())):
        idx = positions[b]  # [KVH, N]
        keys = torch.stack([k[slot, h, idx[h]] for h in range(KVH)])
        values = torch.stack([v[slot, h, idx[h]] for h in range(KVH)])
        ref, _ = reference_rows(q[b], keys, values, idx, valid[b], end, T)
        close(out[b], ref)


def test_attend_positions_nothing_visible(kernels, path):
    """A query row that sees no valid entry gets zeros (not NaN)."""
    D, KVH, T = 64, 1, 1
    k, v = make_cache(1, KVH, 100, D, torch.float32)
    q = make_query(1, KVH, 2, T, D)
    positions = torch.zeros(1, KVH, 70, dtype=torch.int64)
    valid = torch.zeros(1, KVH, 70, dtype=torch.bool)
    out = kernels.attend_positions(q, k, v, torch.tensor([0]), torch.tensor([50]), T, positions, valid)
    assert torch.all(out == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("T", [1, 4])
def test_attend_entries(kernels, path, dtype, D, T):
    KVH, group, S = 2, 3, 90
    k, v = make_cache(3, KVH, S, D, dtype)
    slots, ends = torch.tensor([1, 2]), torch.tensor([5000, 40])
    q = make_query(2, KVH, group, T, D)
    g = torch.Generator().manual_seed(3)
    entry_pos = torch.stack([torch.randperm(int(e), generator=g)[:S] if e >= S else
                             torch.cat([torch.arange(int(e)), torch.full((S - int(e),), -1)]) for e in ends])
    entry_pos[0, 10] = ends[0] - 1  # the newest position
    entry_pos[0, 11] = -1  # an empty entry
    out = kernels.attend_entries(q, k, v, slots, ends, T, entry_pos)
    for b, (slot, end) in enumerate(zip(slots.tolist(), ends.tolist())):
        pos = entry_pos[b].expand(KVH, S)
        ref, _ = reference_rows(q[b], k[slot], v[slot], pos, pos >= 0, end, T)
        close(out[b], ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize("T", [1, 4])
def test_attend_entries_never_reads_a_block_outside_the_view(kernels, path, dtype, D, T):
    """A guided or SnapKV store shows its kept entries and a few ring entries: whole 64-entry blocks
    of the ring are hidden (empty, or holding positions past the row's end). Their K/V are NaN here,
    so an output equal to the reference over the shown entries means they were never read."""
    KVH, group, S, end = 2, 3, 256, 3000
    k, v = make_cache(2, KVH, S, D, dtype)
    g = torch.Generator().manual_seed(7)
    entry_pos = torch.randperm(end, generator=g)[:S][None].clone()  # [1, S]: row 0 in slot 1
    entry_pos[0, 64:128] = -1  # block 1: empty entries
    entry_pos[0, 128:192] = end + torch.arange(64)  # block 2: positions no query may see yet
    entry_pos[0, 200] = end - 1  # block 3 partly shown: the newest position
    hidden = torch.zeros(S, dtype=torch.bool)
    hidden[64:192] = True
    k[1, :, hidden], v[1, :, hidden] = float("nan"), float("nan")
    q = make_query(1, KVH, group, T, D)
    out = kernels.attend_entries(q, k, v, torch.tensor([1]), torch.tensor([end]), T, entry_pos)
    shown = ~hidden
    pos = entry_pos[0, shown].expand(KVH, -1)
    ref, _ = reference_rows(q[0], k[1][:, shown], v[1][:, shown], pos, pos >= 0, end, T)
    assert torch.isfinite(out).all()
    close(out[0], ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 40, 64, 128])
@pytest.mark.parametrize("T", [1, 5])
def test_attend_cached_shared_is_attend_cached_bit_for_bit(kernels, path, dtype, D, T):
    """Rows grouped by a prefix their slots hold alike: the same output bits as one task per row
    (groups of 3 and 2, a group whose own parts differ in length, and rows in no group)."""
    KVH, group, capacity = 2, 3, 400
    k, v = make_cache(7, KVH, capacity, D, dtype)
    slots = torch.tensor([6, 0, 3, 5, 1, 2, 4])
    ends = torch.tensor([200, 140 + T, 331, 129 + T, 200, 64 + T, 90])
    # the prefix of batch rows 0, 2, 4 (slots 6, 3, 1): 128 positions copied from slot 6; rows 1, 3
    # (slots 0, 5): 128 copied from slot 0; rows 5 and 6 share nothing
    for src, dst in ((6, 3), (6, 1), (0, 5)):
        k[dst, :, :128], v[dst, :, :128] = k[src, :, :128], v[src, :, :128]
    members = torch.tensor([0, 2, 4, 1, 3, 5, 6])
    offsets = torch.tensor([0, 3, 5, 6, 7])
    shared = torch.tensor([128, 128, 0, 0])
    q = make_query(len(slots), KVH, group, T, D)
    out = kernels.attend_cached_shared(q, k, v, slots, ends, T, members, offsets, shared)
    assert torch.equal(out, kernels.attend_cached(q, k, v, slots, ends, T))
    for b, (slot, end) in enumerate(zip(slots.tolist(), ends.tolist())):  # and right, not only alike
        pos = torch.arange(end).expand(KVH, end)
        ref, _ = reference_rows(q[b], k[slot, :, :end], v[slot, :, :end], pos, torch.ones_like(pos, dtype=torch.bool),
                                end, T)
        close(out[b], ref)


def test_attend_cached_shared_reads_the_first_members_prefix(kernels):
    """Where the group task applies it really reads the shared blocks from the group's first slot:
    a second member whose own copy is garbage still gets the right answer."""
    if not kernels.shares_prefix_reads(64):
        pytest.skip("this CPU's kernel has no vector task for head size 64, so no group task that reads a prefix once")
    KVH, T = 1, 1
    k, v = make_cache(2, KVH, 256, 64, torch.float32)
    k[1, :, :192], v[1, :, :192] = k[0, :, :192], v[0, :, :192]
    slots, ends = torch.tensor([0, 1]), torch.tensor([200, 230])
    q = make_query(2, KVH, 3, T, 64)
    right = kernels.attend_cached(q, k, v, slots, ends, T)
    k[1, :, :192] = float("nan")
    v[1, :, :192] = float("nan")
    out = kernels.attend_cached_shared(q, k, v, slots, ends, T, torch.tensor([0, 1]), torch.tensor([0, 2]),
                                       torch.tensor([192]))
    assert torch.equal(out, right)


def test_attend_cached_shared_rejects_bad_groups(kernels):
    k, v = make_cache(2, 1, 256, 16, torch.float32)
    q = make_query(2, 1, 2, 1, 16)
    slots, ends = torch.tensor([0, 1]), torch.tensor([100, 100])
    for members, offsets, shared, why in (([0, 1], [0, 2], [32], "multiples of 64"),
                                          ([0, 1], [0, 2], [128], "precede"),
                                          ([0, 0], [0, 2], [64], "once"),
                                          ([0, 1], [0, 1], [64], "offsets")):
        with pytest.raises(RuntimeError, match=why):
            kernels.attend_cached_shared(q, k, v, slots, ends, 1, torch.tensor(members), torch.tensor(offsets),
                                         torch.tensor(shared))


# --------------------------------------------------------------------------------------------------
# Chunked prefill: prefill_attention over packed segments.

def reference_prefill(q, k, v, seg_slot, seg_start, seg_offset, seg_len, scale):
    N, H, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(N, H, D, dtype=torch.float64)
    for slot, start, offset, length in zip(seg_slot.tolist(), seg_start.tolist(), seg_offset.tolist(), seg_len.tolist()):
        if length == 0:
            continue
        end = start + length
        keys = k[slot, :, :end].double().repeat_interleave(group, dim=0)  # [H, end, D]
        values = v[slot, :, :end].double().repeat_interleave(group, dim=0)
        qs = q[offset:offset + length].double().transpose(0, 1) * scale  # [H, length, D]
        scores = qs @ keys.transpose(1, 2)  # [H, length, end]
        mask = torch.arange(end)[None, :] > (start + torch.arange(length))[:, None]  # causal
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out[offset:offset + length] = (probs @ values).transpose(0, 1)
    return out


def segments(lengths, starts, slots, gaps=None):
    offsets, at = [], 0
    for i, length in enumerate(lengths):
        at += gaps[i] if gaps else 0
        offsets.append(at)
        at += length
    as_t = lambda x: torch.tensor(x, dtype=torch.int64)
    return as_t(slots), as_t(starts), as_t(offsets), as_t(lengths), at


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_prefill_ragged(kernels, prefill_path, dtype, D):
    """Ragged segments (lengths 1, 7, 64, 65, 200; starts 0, 63, 64, 1000) in different slots."""
    H, KVH = 6, 2
    k, v = make_cache(4, KVH, 1300, D, dtype)
    seg_slot, seg_start, seg_offset, seg_len, N = segments([1, 7, 64, 65, 200], [0, 63, 64, 1000, 1000],
                                                           [0, 1, 2, 3, 1])
    q = torch.randn(N, H, D, generator=torch.Generator().manual_seed(5))
    scale = D ** -0.5
    out = kernels.prefill_attention(q, k, v, seg_slot, seg_start, seg_offset, seg_len, scale)
    close(out, reference_prefill(q, k, v, seg_slot, seg_start, seg_offset, seg_len, scale))


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (14, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_groups(kernels, prefill_path, heads, kv_heads, dtype):
    """GQA group sizes 3, 1, 8, 7 (tiles of 32, 96, 12, 13 tokens: full and ragged register tiles)."""
    D = 64
    k, v = make_cache(2, kv_heads, 700, D, dtype)
    seg_slot, seg_start, seg_offset, seg_len, N = segments([130, 33, 1], [500, 0, 699], [1, 0, 0])
    q = torch.randn(N, heads, D, generator=torch.Generator().manual_seed(6))
    out = kernels.prefill_attention(q, k, v, seg_slot, seg_start, seg_offset, seg_len, 0.1)
    close(out, reference_prefill(q, k, v, seg_slot, seg_start, seg_offset, seg_len, 0.1))


@pytest.mark.parametrize("D", [1, 8, 20, 136, 256])
def test_prefill_other_head_sizes(kernels, prefill_path, D):
    """Head sizes outside 16..128 or not multiples of 16 (vector path where D % 8 == 0)."""
    H, KVH = 4, 2
    k, v = make_cache(2, KVH, 300, D, torch.bfloat16)
    seg_slot, seg_start, seg_offset, seg_len, N = segments([60, 40], [150, 3], [1, 0])
    q = torch.randn(N, H, D, generator=torch.Generator().manual_seed(8))
    out = kernels.prefill_attention(q, k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5)
    close(out, reference_prefill(q, k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5))


def test_prefill_uncovered_tokens_and_empty_segments(kernels, prefill_path):
    """Tokens between segments come out as zeros; an empty segment is allowed."""
    D, H, KVH = 32, 4, 2
    k, v = make_cache(2, KVH, 200, D, torch.float32)
    seg_slot, seg_start, seg_offset, seg_len, N = segments([10, 0, 5], [20, 3, 0], [0, 1, 1], gaps=[2, 0, 3])
    q = torch.randn(N + 4, H, D)
    out = kernels.prefill_attention(q, k, v, seg_slot, seg_start, seg_offset, seg_len, 0.2)
    close(out, reference_prefill(q, k, v, seg_slot, seg_start, seg_offset, seg_len, 0.2))
    assert torch.all(out[:2] == 0) and torch.all(out[12:15] == 0) and torch.all(out[20:] == 0)


def test_prefill_matches_decode(kernels, prefill_path):
    """A one-token segment is a decode step: prefill_attention agrees with attend_cached."""
    D, H, KVH, end = 64, 9, 3, 777
    k, v = make_cache(2, KVH, 1000, D, torch.bfloat16)
    q = torch.randn(1, H, D)
    out = kernels.prefill_attention(q, k, v, torch.tensor([1]), torch.tensor([end - 1]), torch.tensor([0]),
                                    torch.tensor([1]), D ** -0.5)
    dq = (q * D ** -0.5).reshape(1, KVH, H // KVH, D)  # [B, KVH, group * T, D] with T = 1
    dec = kernels.attend_cached(dq, k, v, torch.tensor([1]), torch.tensor([end]), 1)
    close(out, dec.reshape(1, H, D).double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [32, 64, 40])
def test_prefill_rows_do_not_depend_on_the_split(kernels, prefill_path, dtype, D):
    """A query row's output is the same bits whichever forward, segment or tile it comes in (what keeps a
    prompt's prefill, with or without prefix reuse or packing, the same): 300 tokens of one slot in one
    segment, then the first 299 of them as segments of 1, 45, 130 and 123 tokens at their positions,
    packed in another order with another slot's segment between them."""
    H, KVH = 9, 3
    k, v = make_cache(3, KVH, 600, D, dtype)
    q = torch.randn(300, H, D, generator=torch.Generator().manual_seed(11))
    one = kernels.prefill_attention(q, k, v, *segments([300], [200], [2])[:4], D ** -0.5)
    other = torch.randn(17, H, D, generator=torch.Generator().manual_seed(12))
    packed = torch.cat([q[176:299], other, q[0:1], q[1:46], q[46:176]])
    seg_slot, seg_start, seg_offset, seg_len, _ = segments([123, 17, 1, 45, 130], [376, 50, 200, 201, 246],
                                                           [2, 0, 2, 2, 2])
    out = kernels.prefill_attention(packed, k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5)
    again = torch.cat([out[140:141], out[141:186], out[186:316], out[0:123]])
    assert torch.equal(again, one[:299])


@pytest.fixture
def bf16_dot(kernels):
    """The bfloat16 dot-product prefill task allowed (the default), restored after the test."""
    kernels.prefill_use_bf16_dot(True)
    yield kernels
    kernels.prefill_use_bf16_dot(True)


@pytest.mark.parametrize("heads,kv_heads,D", [(9, 3, 64), (6, 2, 16), (8, 1, 32), (6, 2, 48), (4, 4, 128),
                                              (4, 2, 80), (4, 2, 40)])
def test_prefill_bfloat16_query(bf16_dot, heads, kv_heads, D):
    """A bfloat16 query over a bfloat16 cache (a bfloat16 model's prefill). Where the bfloat16 dot-product
    task takes it, only the probabilities are rounded (to bfloat16), so each output is within 2^-8 of the
    largest |V| entry of the float64 reference, and it is not the widened query's float32 result (the
    task ran); elsewhere (no AVX512-BF16, AMX tiles, head sizes not multiples of 16) the query is widened
    exactly and the result is the float32 query's, bit for bit."""
    kernels = bf16_dot
    k, v = make_cache(4, kv_heads, 1300, D, torch.bfloat16)
    seg_slot, seg_start, seg_offset, seg_len, N = segments([1, 7, 64, 65, 200], [0, 63, 64, 1000, 1000],
                                                           [0, 1, 2, 3, 1])
    q = torch.randn(N, heads, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = kernels.prefill_attention(q, k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5)
    widened = kernels.prefill_attention(q.float(), k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5)
    assert out.dtype == torch.float32  # whatever the query's dtype
    if not kernels.prefill_bf16_dot_in_use(D):
        assert torch.equal(out, widened)
        return
    ref = reference_prefill(q.float(), k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5)
    bound = 2 ** -8 * v.float().abs().max().item() + ATOL
    assert (out.double() - ref).abs().max().item() <= bound
    assert not torch.equal(out, widened)
    kernels.prefill_use_bf16_dot(False)  # the switch: the widened query's path again
    assert torch.equal(kernels.prefill_attention(q, k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5),
                       widened)


@pytest.mark.parametrize("D", [32, 64, 80])
def test_prefill_bfloat16_rows_do_not_depend_on_the_split(bf16_dot, D):
    """test_prefill_rows_do_not_depend_on_the_split for a bfloat16 query over a bfloat16 cache (the
    dot-product task where it runs): the same bits whichever forward, segment or tile a row comes in."""
    kernels = bf16_dot
    H, KVH = 9, 3
    k, v = make_cache(3, KVH, 600, D, torch.bfloat16)
    q = torch.randn(300, H, D, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    one = kernels.prefill_attention(q, k, v, *segments([300], [200], [2])[:4], D ** -0.5)
    other = torch.randn(17, H, D, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    packed = torch.cat([q[176:299], other, q[0:1], q[1:46], q[46:176]])
    seg_slot, seg_start, seg_offset, seg_len, _ = segments([123, 17, 1, 45, 130], [376, 50, 200, 201, 246],
                                                           [2, 0, 2, 2, 2])
    out = kernels.prefill_attention(packed, k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5)
    again = torch.cat([out[140:141], out[141:186], out[186:316], out[0:123]])
    assert torch.equal(again, one[:299])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 32, 64, 80, 96, 128])
def test_prefill_w16_emulation(kernels, dtype, D):
    """The prefill task instantiated with a 16-lane policy (the AVX-512 path's tiling), emulated on AVX2."""
    if "avx2" not in kernels.vector_isa():
        pytest.skip("the emulation needs AVX2 + FMA")
    w16 = load_w16_emulation()
    H, KVH = 6, 2
    k, v = make_cache(4, KVH, 1300, D, dtype)
    seg_slot, seg_start, seg_offset, seg_len, N = segments([1, 7, 64, 65, 200], [0, 63, 64, 1000, 1000],
                                                           [0, 1, 2, 3, 1])
    q = torch.randn(N, H, D, generator=torch.Generator().manual_seed(5))
    out = w16.prefill_attention(q, k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5)
    close(out, reference_prefill(q, k, v, seg_slot, seg_start, seg_offset, seg_len, D ** -0.5))


def reference_tail_mass(q, k, seg_slot, seg_start, seg_offset, seg_len, seg_tail, mass_len, scale):
    """[S, KVH, mass_len] float64: the softmax each segment's last seg_tail tokens put on every position,
    summed over those tokens and each KV head's group of query heads (causal)."""
    KVH = k.shape[1]
    group = q.shape[1] // KVH
    mass = torch.zeros(len(seg_slot), KVH, mass_len, dtype=torch.float64)
    for s, (slot, start, offset, length, tail) in enumerate(zip(seg_slot.tolist(), seg_start.tolist(),
                                                                 seg_offset.tolist(), seg_len.tolist(),
                                                                 seg_tail.tolist())):
        end = start + length
        for t in range(length - tail, length):  # token t of the segment sees positions <= start + t
            seen = start + t + 1
            keys = k[slot, :, :seen].double().repeat_interleave(group, dim=0)  # [H, seen, D]
            probs = torch.softmax((q[offset + t].double()[:, None, :] * scale * keys).sum(-1), dim=-1)  # [H, seen]
            mass[s, :, :seen] += probs.view(KVH, group, seen).sum(dim=1)
    assert mass.shape[-1] >= max(a + b for a, b in zip(seg_start.tolist(), seg_len.tolist()))
    return mass


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [32, 64, 128])
def test_prefill_tail_mass_on_amx(kernels, dtype, D):
    """prefill_attention_mass: the outputs are prefill_attention's bits, and each segment's tail (SnapKV's
    observation window, here 0, 32, all 7 and 150 tokens: a tail longer than an AMX task of 128 tokens is
    still one task) gets the attention mass its tokens put on every position, against float64."""
    previous = kernels.use_amx(True)
    try:
        if not kernels.prefill_mass_on_amx(D):
            pytest.skip("no AMX tiles here (the CPU or the build lacks AMX-BF16, or Linux did not lend them)")
        H, KVH = 9, 3
        k, v = make_cache(3, KVH, 2600, D, dtype)
        seg_slot, seg_start, seg_offset, seg_len, N = segments([100, 45, 7, 300], [500, 2000, 0, 2200], [0, 1, 2, 2])
        seg_tail = torch.tensor([0, 32, 7, 150])
        q = torch.randn(N, H, D, generator=torch.Generator().manual_seed(13))
        mass_len = 2510 + 3  # beyond every end: zeros there
        out, mass = kernels.prefill_attention_mass(q, k, v, seg_slot, seg_start, seg_offset, seg_len, seg_tail,
                                                   mass_len, D ** -0.5)
        assert torch.equal(out, kernels.prefill_attention(q, k, v, seg_slot, seg_start, seg_offset, seg_len,
                                                          D ** -0.5))
        torch.testing.assert_close(mass.double(), reference_tail_mass(q, k, seg_slot, seg_start, seg_offset,
                                                                      seg_len, seg_tail, mass_len, D ** -0.5),
                                   atol=1e-5, rtol=1e-5)
        assert torch.all(mass[0] == 0)  # no tail, no mass
    finally:
        kernels.use_amx(previous)


def test_prefill_rejects_bad_segments(kernels):
    k, v = make_cache(1, 1, 100, 16, torch.float32)
    q = torch.randn(10, 2, 16)
    one = lambda x: torch.tensor([x])
    with pytest.raises(RuntimeError):  # beyond the cache
        kernels.prefill_attention(q, k, v, one(0), one(95), one(0), one(10), 1.0)
    with pytest.raises(RuntimeError):  # beyond the token axis
        kernels.prefill_attention(q, k, v, one(0), one(0), one(5), one(10), 1.0)
    with pytest.raises(RuntimeError):  # slot out of range
        kernels.prefill_attention(q, k, v, one(1), one(0), one(0), one(10), 1.0)


# --------------------------------------------------------------------------------------------------
# The draft's element-wise ops (cpu_draft_ops.cpp; bound in cpu_attention.cpp).

def test_residual_rms_norm(kernels):
    x = torch.randn(5, 48)
    delta = torch.randn(5, 48)
    w = torch.randn(48)
    x_ref = x.double() + delta.double()
    ref = x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    out = kernels.residual_rms_norm(x, delta, w, 1e-6)
    close(x, x_ref)  # updated in place
    close(out, ref)
    out2 = kernels.residual_rms_norm(x, None, w, 1e-6)
    close(out2, ref)


def test_silu_mul(kernels):
    gu = torch.randn(3, 4, 64)
    g, u = gu.double().chunk(2, dim=-1)
    close(kernels.silu_mul(gu), torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write(kernels, dtype):
    B, T, H, KV, D, cap = 2, 3, 6, 2, 16, 20
    qkv = torch.randn(B, T, (H + 2 * KV) * D)
    angle = torch.rand(B, T, D // 2) * math.pi
    cos = torch.cat([angle.cos(), angle.cos()], -1)
    sin = torch.cat([angle.sin(), angle.sin()], -1)
    k = torch.zeros(3, KV, cap, D, dtype=dtype)
    v = torch.zeros(3, KV, cap, D, dtype=dtype)
    slots = torch.tensor([2, 0])
    rows = torch.tensor([[0, 1, 2], [7, 8, 19]])
    query = kernels.rope_write(qkv, cos, sin, k, v, slots, rows, H, KV)

    def rotate(x):  # x [..., D], rotate-half RoPE
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return x * cos.double()[:, :, None] + torch.cat([-x2, x1], -1) * sin.double()[:, :, None]

    heads = qkv.double().view(B, T, H + 2 * KV, D)
    q_ref = rotate(heads[:, :, :H])  # [B, T, H, D]
    group = H // KV
    close(query, q_ref.view(B, T, KV, group, D).permute(0, 2, 3, 1, 4).reshape(B, KV, group * T, D))
    k_ref = rotate(heads[:, :, H:H + KV])
    v_ref = heads[:, :, H + KV:]
    # bfloat16 stores round to nearest: within half an ulp, 2^-8 relative, of the exact value
    tol = dict(atol=ATOL, rtol=RTOL) if dtype == torch.float32 else dict(atol=1e-6, rtol=2 ** -8)
    for b in range(B):
        for t in range(T):
            torch.testing.assert_close(k[slots[b], :, rows[b, t]].double(), k_ref[b, t], **tol)
            torch.testing.assert_close(v[slots[b], :, rows[b, t]].double(), v_ref[b, t], **tol)
