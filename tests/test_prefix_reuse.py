"""Shared-prefix reuse: the store holds what it should and never more, and reusing a prefix's K/V never
changes what a row generates (every draft method, self and separate drafts, greedy and seeded sampling,
rows of one document in different batches), while the prefill computes only what was not shared."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config.loading import recipe_from_dict
from engine.core.kv_cache import KVCache
from engine.core.prefix_store import PrefixStore
from engine.core.sequence import Request
from engine.spec.decoder import build_engine

BLOCK = 16


def filled_cache(slots=3, capacity=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(layers=2, slots=slots, kv_heads=2, head_dim=8, capacity=capacity, dtype=torch.float32,
                    device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def test_a_stored_prefix_is_found_by_its_tokens_and_copied_exactly():
    cache = filled_cache()
    store = PrefixStore.for_cache(cache, block=BLOCK, capacity=10 * BLOCK)
    ids = list(range(100, 100 + 5 * BLOCK + 7))  # 5 full blocks and a partial one
    store.insert(cache, 0, ids)
    assert len(store.blocks) == 5  # the partial block is not stored
    other = ids[: 3 * BLOCK] + [7] * 40  # the same first 3 blocks, then different tokens
    blocks = store.match(other)
    assert len(blocks) == 3
    assert store.match([1] + ids[1:]) == []  # a different first token: nothing matches
    store.load(cache, 2, blocks, 3 * BLOCK - 5)  # a partial last block is fine
    n = 3 * BLOCK - 5
    assert torch.equal(cache.k[:, 2, :, :n], cache.k[:, 0, :, :n])
    assert torch.equal(cache.v[:, 2, :, :n], cache.v[:, 0, :, :n])
    assert store.stats.tokens_reused == n


def test_a_block_matches_only_after_the_same_prefix():
    cache = filled_cache()
    store = PrefixStore.for_cache(cache, block=BLOCK, capacity=10 * BLOCK)
    a = [1] * BLOCK + [2] * BLOCK
    store.insert(cache, 0, a)
    assert len(store.match([3] * BLOCK + [2] * BLOCK)) == 0  # block 2 alone, after another block 1


def test_the_store_never_grows_past_its_bound_and_evicts_chains_from_their_end():
    cache = filled_cache(slots=1)
    store = PrefixStore.for_cache(cache, block=BLOCK, capacity=4 * BLOCK + 5)  # 4 blocks
    rng = random.Random(0)
    for round_ in range(30):
        ids = [rng.randrange(500) for _ in range(rng.randrange(1, 7) * BLOCK)]
        store.insert(cache, 0, ids)
        assert len(store.blocks) <= store.max_blocks == 4
        assert len(store.blocks) + len(store.free) == store.max_blocks
        indices = [b.index for b in store.blocks.values()]
        assert len(set(indices)) == len(indices), "two blocks in one pool row"
        # every stored block's chain is stored too: eviction never orphans a later block
        for block in store.blocks.values():
            assert block.parent is None or block.parent in store.blocks
    assert store.stats.peak_blocks == 4
    doc = [9] * (3 * BLOCK)
    store.insert(cache, 0, doc)
    store.insert(cache, 0, [7] * BLOCK)  # the store is now doc's 3 blocks and this one
    store.insert(cache, 0, [8] * BLOCK)  # needs one block: the least recently used is doc's last
    assert len(store.match(doc)) == 2 and len(store.match([7] * BLOCK)) == 1


def test_a_prompt_longer_than_the_store_keeps_what_fits():
    cache = filled_cache(slots=1, capacity=300)
    store = PrefixStore.for_cache(cache, block=BLOCK, capacity=3 * BLOCK)
    ids = list(range(10 * BLOCK))
    store.insert(cache, 0, ids)
    assert len(store.match(ids)) == 3


# ------------------------------------------------------------------ end to end on a tiny model

def documents_and_questions(seed=4, docs=3, questions=4):
    """Rows that share long prefixes (documents) with their own endings (questions), shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d in range(docs):
        doc = torch.randint(3, 500, (int(torch.randint(90, 170, (1,), generator=g)),), generator=g).tolist()
        for q in range(questions):
            question = torch.randint(3, 500, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            rows.append(doc + question)
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order]


def recipe(method, *, reuse, temperature=0.0, size=2, lookahead=256):
    return recipe_from_dict({
        "model": "tiny",
        "draft": {"method": method, "budget": 48, "sink": 4, "window": 8, "subspaces": 4, "bits": 4,
                  "linear_dtype": "same"},
        "spec": {"gamma": 3},
        "batch": {"size": size, "prefill_chunk": 32, "prefix_reuse": reuse, "prefix_block": BLOCK,
                  "prefix_cache": 4096, "lookahead": lookahead},
        "sampling": {"max_new_tokens": 12, "temperature": temperature, "seed": 5}})


def generate(engine, prompts):
    results = {r.request.index: r for r in engine.run(Request(i, f"row{i}", p, 12) for i, p in enumerate(prompts))}
    return [results[i].token_ids for i in range(len(prompts))]


def ideal_reuse(prompts, block=BLOCK):
    """Prompt tokens an ideal store saves: each row's longest block-aligned prefix shared with an
    earlier-admitted row (at least its last token computed). Admission is in token order here."""
    seen: list[list[int]] = []
    total = 0
    for p in sorted(prompts):
        best = 0
        for q in seen:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n // block * block)
        total += min(best, len(p) - 1)
        seen.append(p)
    return total


CASES = [("none", "self")] + [(m, kind) for m in ("streamingllm", "snapkv", "pqcache") for kind in ("self", "separate")]


@pytest.mark.parametrize("method,draft_kind", CASES, ids=["-".join(c) for c in CASES])
def test_greedy_output_is_the_same_with_and_without_reuse(tiny_pair, method, draft_kind):
    loaded, draft_model = tiny_pair
    draft = draft_model if draft_kind == "separate" else None
    prompts = documents_and_questions()
    off = build_engine(recipe(method, reuse=False), loaded, draft)
    on = build_engine(recipe(method, reuse=True), loaded, draft)
    assert generate(on, prompts) == generate(off, prompts)
    total = sum(len(p) for p in prompts)
    assert off.stats.prefill_tokens == total and off.stats.prefill_tokens_reused == 0
    assert on.stats.prefill_tokens + on.stats.prefill_tokens_reused == total
    # 2 slots, 12 rows: a document's rows run in different batches and still reuse its prefix.
    reused = on.stats.prefill_tokens_reused
    window = 8 if method == "snapkv" else 0  # SnapKV's observation window is always the row's own
    assert ideal_reuse(prompts) - window * len(prompts) <= reused <= ideal_reuse(prompts)
    if draft is not None:  # the separate draft's cache reuses its own prefixes too
        assert on.decoder.prefill_targets[1].store.stats.tokens_reused > 0


def test_bfloat16_greedy_output_is_the_same_with_and_without_reuse_and_draft():
    """A bfloat16 model (its decode GEMMs on the CPU's bfloat16 dot products where it has them, its
    prefill chunks on torch's): reuse on and off, plain and SnapKV (whose reused prefixes stop before
    each row's own observation window, so its rows' prefill chunks hold other rows than plain's) write
    the same tokens."""
    from conftest import make_tiny

    loaded, _ = make_tiny(3)
    loaded.model.to(torch.bfloat16)
    loaded.dtype = torch.bfloat16
    prompts = documents_and_questions()
    plain_off = generate(build_engine(recipe("none", reuse=False), loaded), prompts)
    assert generate(build_engine(recipe("none", reuse=True), loaded), prompts) == plain_off
    assert generate(build_engine(recipe("snapkv", reuse=True), loaded), prompts) == plain_off
    assert generate(build_engine(recipe("snapkv", reuse=False), loaded), prompts) == plain_off


def test_rows_sharing_a_header_compute_each_document_once(tiny_pair):
    """Every row starts with the same 2-block header (a chat template's) and then its document: once
    the store holds the header, a document's rows must still wait for the wave after its first row's,
    not compute the document side by side with it (8 slots: a wave has room for them)."""
    loaded, _ = tiny_pair
    header = [3 + (7 * i) % 497 for i in range(2 * BLOCK)]
    prompts = [header + p for p in documents_and_questions(seed=8)]
    off = build_engine(recipe("none", reuse=False, size=8), loaded)
    on = build_engine(recipe("none", reuse=True, size=8), loaded)
    assert generate(on, prompts) == generate(off, prompts)
    assert on.stats.prefill_tokens_reused == ideal_reuse(prompts)


def test_seeded_sampling_is_the_same_with_and_without_reuse(tiny_pair):
    loaded, _ = tiny_pair
    prompts = documents_and_questions(seed=6)
    off = generate(build_engine(recipe("streamingllm", reuse=False, temperature=0.8), loaded), prompts)
    on = generate(build_engine(recipe("streamingllm", reuse=True, temperature=0.8), loaded), prompts)
    assert on == off


def test_a_row_too_long_for_its_slot_is_still_an_error_with_reuse(tiny_pair):
    loaded, _ = tiny_pair
    rec = recipe_from_dict({**recipe("none", reuse=True).to_dict(), "batch": {
        **recipe("none", reuse=True).to_dict()["batch"], "max_len": 64}})
    engine = build_engine(rec, loaded)
    results = list(engine.run([Request(0, "a", list(range(3, 100)), 4), Request(1, "b", list(range(3, 40)), 4)]))
    by_id = {r.request.id: r for r in results}
    assert by_id["a"].finish_reason == "error" and "batch.max_len" in by_id["a"].error
    assert by_id["b"].finish_reason != "error"


@pytest.mark.real_model
def test_real_model_shared_prefix_prompts_give_the_same_text(real_model):
    import inspect
    import textwrap

    tokenizer = real_model.tokenizer
    document = inspect.getsource(textwrap)[:2400]
    prompts = [tokenizer(document + f"\n# Question: {q}\n# Answer:")["input_ids"]
               for q in ("What does dedent do?", "What does wrap return?", "Who wrote this module?")]
    base = {"batch": {"size": 2, "max_len": 1024, "prefix_block": 32}, "sampling": {"max_new_tokens": 12},
            "draft": {"method": "streamingllm", "budget": 128}}
    off = build_engine(recipe_from_dict({**base, "batch": {**base["batch"], "prefix_reuse": False}}), real_model)
    on = build_engine(recipe_from_dict(base), real_model)
    assert generate(on, prompts) == generate(off, prompts)
    assert on.stats.prefill_tokens_reused >= 2 * (len(tokenizer(document)["input_ids"]) // 32 * 32 - 32)
