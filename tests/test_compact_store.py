"""The draft's compact store shows exactly what the compressor's view of the full cache shows.

Brute force: rounds of a self-speculating row are simulated on a random cache (the draft writes its
tokens into the store, verification rewrites the cache, a random number of drafts is accepted; runs
of plain rounds in between, whose copies into the store wait until a draft reads it), and
at every draft step the positions the store shows must be the view's positions (`compose_view`), with
the K/V of committed positions equal to the cache's (in bfloat16) and those of the round's own drafts
equal to what the draft wrote. A guided view re-selects its kept part from a random
verification mass after every round, so its kept entries change (the refill). The lean forward
reading the store is held to transformers' forward over the full-cache view in test_draft_forward.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.config.schema import DraftConfig
from engine.core.kv_cache import KVCache
from engine.spec.compressors.guided import Guided
from engine.spec.compressors.snapkv import SnapKV
from engine.spec.compressors.streamingllm import StreamingLLM

LAYERS, SLOTS, KV_HEADS, HEADS, D = 2, 3, 2, 4, 8
EXTRA = 5  # gamma_max 4, plus the pending token


def make(method: str, budget: int, copy: bool = True, sink: int = 4):
    g = torch.Generator().manual_seed(0)
    cache = KVCache(layers=LAYERS, slots=SLOTS, kv_heads=KV_HEADS, head_dim=D, capacity=4000,
                    dtype=torch.float32, device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    config = DraftConfig(method=method, budget=budget, sink=sink, window=6)
    compressor = {"streamingllm": StreamingLLM, "snapkv": SnapKV, "guided": Guided}[method](config, cache, HEADS)
    assert compressor.enable_compact(extra=EXTRA, copy_committed=copy)
    return cache, compressor


def shown(compressor, slot: int, end: int, layer: int, head: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """position -> (K, V) the store shows a query whose newest token is at end - 1."""
    store = compressor.compact
    view = compressor.view([slot], [end])
    entries = view.compact_entries()[0]  # [S]
    kept_positions = view.kept_for_layer(layer)[0, head]  # the kept entries' real positions
    out = {}
    for entry, pos in enumerate(entries.tolist()):
        if pos < 0:
            continue
        real = int(kept_positions[entry]) if entry < int(store.ring_start[slot]) else pos
        assert real not in out, "a position shown twice would distort the softmax"
        out[real] = (store.k[layer, slot, head, entry], store.v[layer, slot, head, entry])
    return out


def reference(compressor, slot: int, end: int, layer: int, head: int) -> set[int]:
    positions, valid = compressor.view([slot], [end]).select(layer, torch.zeros(1, HEADS, 1, D))
    return set(positions[0, head][valid[0, head]].tolist())


# draft: whose committed K/V the store holds, the target's ("self") or a separate draft's own. A
# separate guided draft keeps no store (test_guided.py checks it refuses one), so it is not a case here.
@pytest.mark.parametrize("method,budget,sink,draft", [
    (method, budget, sink, draft)
    for method, budget, sink in [("streamingllm", 24, 4), ("streamingllm", 24, 0), ("streamingllm", 200, 4),
                                 ("snapkv", 24, 4), ("guided", 24, 4)]
    for draft in ("self", "separate") if not (method == "guided" and draft == "separate")])
@pytest.mark.parametrize("prompt_len", [3, 15, 150])
def test_store_shows_the_view_through_rounds(method, budget, sink, prompt_len, draft):
    cache, compressor = make(method, budget, copy=draft == "self", sink=sink)
    g = torch.Generator().manual_seed(prompt_len)
    slot = 1
    observed = torch.randn(LAYERS, HEADS, min(6, prompt_len), D, generator=g) if method != "streamingllm" else None
    compressor.prefill_done(slot, prompt_len, observed)
    cache.set_length(slot, prompt_len)
    store, committed = compressor.compact, prompt_len
    drafted = {}  # position -> the K/V the draft wrote there
    for _ in range(40):
        if draft == "self" and int(torch.randint(0, 3, (1,), generator=g)) == 0:
            # Plain rounds (`gamma: auto` not speculating): the store is not read, its copies wait.
            plain = int(torch.randint(1, 3 * budget, (1,), generator=g))
            for _ in range(min(plain, cache.capacity - committed - 2 * EXTRA)):
                cache.k[:, slot, :, committed] = torch.randn(LAYERS, KV_HEADS, D, generator=g)
                cache.v[:, slot, :, committed] = torch.randn(LAYERS, KV_HEADS, D, generator=g)
                committed += 1
                cache.set_length(slot, committed)
                compressor.committed(slot, committed)
        gamma = int(torch.randint(1, EXTRA, (1,), generator=g))
        if draft == "self":
            drafted = {}  # committed positions hold the target's K/V, from the cache
        # The draft writes each token's K/V into the store, then attends. A separate draft model first
        # recomputes its newest committed position (as the engine's rounds do).
        first = committed - 1 if draft == "separate" else committed
        for position in range(first, committed + gamma):
            row = int(store.rows_for(torch.tensor(position), slot))
            store.entry_pos[slot, row] = position
            k, v = torch.randn(2, LAYERS, KV_HEADS, D, generator=g).to(store.k.dtype)
            store.k[:, slot, :, row], store.v[:, slot, :, row] = k, v
            drafted[position] = (k, v)
            end = position + 1
            for layer in range(LAYERS):
                for head in range(KV_HEADS):
                    seen = shown(compressor, slot, end, layer, head)
                    assert set(seen) == reference(compressor, slot, end, layer, head)
                    for pos, (k_seen, v_seen) in seen.items():
                        if pos in drafted:
                            want = drafted[pos][0][layer, head], drafted[pos][1][layer, head]
                        else:
                            assert pos < (committed if draft == "self" else prompt_len)
                            want = cache.k[layer, slot, head, pos], cache.v[layer, slot, head, pos]
                        assert torch.equal(k_seen, want[0].to(store.k.dtype))
                        assert torch.equal(v_seen, want[1].to(store.v.dtype))
        # Verification rewrites gamma + 1 positions with the target's K/V; the row keeps a + 1 of them.
        written = slice(committed, committed + gamma + 1)
        cache.k[:, slot, :, written] = torch.randn(LAYERS, KV_HEADS, gamma + 1, D, generator=g)
        cache.v[:, slot, :, written] = torch.randn(LAYERS, KV_HEADS, gamma + 1, D, generator=g)
        verified_end = committed + gamma + 1
        committed += int(torch.randint(0, gamma + 1, (1,), generator=g)) + 1
        cache.set_length(slot, committed)
        compressor.committed(slot, committed)
        if method == "guided":  # the round's verification mass moves the kept part
            mass = torch.rand(LAYERS, 1, KV_HEADS, verified_end, generator=g) ** 4
            compressor.observe_mass(mass, [0], [slot], [committed + 1], [committed], gamma + 1)


def test_release_empties_the_slot():
    cache, compressor = make("streamingllm", 24)
    compressor.prefill_done(0, 50, None)
    assert (compressor.compact.entry_pos[0] >= 0).sum() == 24 + 0  # 4 sinks + 20 newest... all shown
    compressor.release(0)
    assert (compressor.compact.entry_pos[0] < 0).all()


def test_methods_whose_kept_part_follows_the_query_have_no_store():
    from engine.spec.compressors.pqcache import PQCache

    cache, _ = make("streamingllm", 24)
    pq = PQCache(DraftConfig(method="pqcache", budget=64, sink=4, window=8, subspaces=4, bits=4), cache, HEADS)
    assert not pq.enable_compact(extra=EXTRA, copy_committed=True) and pq.compact is None
