"""The guided draft view: the attention mass it is fed, and its selection, against brute force.

- Mass: `ForwardBatch.mass` from the torch path and from the fused kernel's `attend_cached_scores`
  equals the softmax probabilities of `reference_attention`'s masked attention, summed over each GQA
  group's query heads and the new tokens, and asking for it leaves the attention output unchanged.
- Selection: after prefill (SnapKV's pooled window scores) and after rounds (the verification mass,
  smoothed or not, raised to its `draft.successors` predecessors' or not), every row's view per layer
  and KV head is exactly sinks + the top `budget - sink - window` of [sink, L - window) by rank
  (score at or above `draft.floor` x the uniform share, else recency) + the newest positions, checked
  with loops over positions.
- Compact store: its kept entries hold the cache's K/V of exactly the kept positions after every
  re-selection, and a position that stays kept is not copied again.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import pooled, random_cache, window_attention_scores

from engine.config.loading import recipe_from_dict
from engine.config.schema import DraftConfig
from engine.core import kernels as cpu_kernels
from engine.core.attention import ForwardBatch, attend_full
from engine.errors import JobError
from engine.spec.compressors.guided import Guided

LAYERS, SLOTS, KV_HEADS, HEADS, D = 2, 3, 2, 4, 8
GROUP = HEADS // KV_HEADS


def filled_cache(capacity=400, seed=0, head_dim=D, layers=LAYERS):
    return random_cache(layers=layers, slots=SLOTS, kv_heads=KV_HEADS, head_dim=head_dim, capacity=capacity,
                        seed=seed)


# ----------------------------------------------------------------------------- the mass

def reference_mass(query, cache, layer, batch):
    """Loops over rows and KV heads: softmax over the row's visible positions, summed over group and tokens."""
    B, H, T, Dh = query.shape
    N = max(batch.ends)
    mass = torch.zeros(B, KV_HEADS, N, dtype=torch.float64)
    for b, (slot, start) in enumerate(zip(batch.slots, batch.starts)):
        for h in range(KV_HEADS):
            keys = cache.k[layer, slot, h].double()
            for qh in range(h * GROUP, (h + 1) * GROUP):
                for t in range(T):
                    visible = start + t + 1
                    logits = keys[:visible] @ query[b, qh, t].double() / math.sqrt(Dh)
                    mass[b, h, :visible] += torch.softmax(logits, dim=0)
    return mass


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("T", [1, 4])
def test_attention_mass_matches_the_softmax(monkeypatch, backend, T):
    cache = filled_cache(capacity=300, head_dim=32, layers=1)
    if backend == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    else:
        kernel = cpu_kernels.load()
        if kernel is None:
            pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?)")
    g = torch.Generator().manual_seed(T)
    batch_plain = ForwardBatch(cache, [2, 0, 1], [0, 63, 250], T)
    mass = torch.full((1, 3, KV_HEADS, 260), float("nan"))  # written in full, zeros past each row's end
    batch = ForwardBatch(cache, [2, 0, 1], [0, 63, 250], T, mass=mass)
    query = torch.randn(3, HEADS, T, 32, generator=g)
    out = attend_full(query, 0, batch, 32 ** -0.5)
    torch.testing.assert_close(out, attend_full(query, 0, batch_plain, 32 ** -0.5), atol=1e-5, rtol=1e-5)
    want = reference_mass(query, cache, 0, batch)
    got = mass[0].double()
    torch.testing.assert_close(got[..., :want.shape[-1]], want, atol=1e-5, rtol=1e-4)
    assert (got[..., want.shape[-1]:] == 0).all()
    # Each (row, KV head) receives the group's heads x T tokens worth of probability.
    torch.testing.assert_close(got.sum(-1), torch.full((3, KV_HEADS), float(GROUP * T), dtype=torch.float64))


# ----------------------------------------------------------------------------- the selection

@pytest.fixture(params=["kernel", "torch"])
def selection(request, monkeypatch):
    """Selection (and store refill) by the C++ op, or by the torch ops used where it is not built."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    elif cpu_kernels.load() is None:
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?)")
    return request.param


def rank(score, position, bar):
    """The rule's order: positions scoring at least the bar by score, above every faint one, which go by position."""
    return (1, score) if score >= bar else (0, position)


def guided_reference(scores, L, budget, sink, window, floor=0.0):
    """Per KV head: the positions the rule keeps (a set) and the candidate scores, by loops.

    scores: [kv_heads, >= L] (this row and layer, per-query probabilities). Returns (kept sets,
    candidates list, top count, kept_end, the bar under which positions go by recency)."""
    kept_end = max(L - window, 0)
    top = budget - sink - window
    candidates = list(range(sink, kept_end))
    bar = floor / kept_end if kept_end else 0.0
    sets = []
    for h in range(KV_HEADS):
        ranked = sorted(candidates, key=lambda p: rank(float(scores[h, p]), p, bar), reverse=True)
        sets.append(set(range(min(sink, kept_end))) | set(ranked[:top]))
    return sets, candidates, min(top, len(candidates)), kept_end, bar


def view_sets(view, layer, B):
    positions, valid = view.select(layer, torch.zeros(B, HEADS, 1, D))
    out = []
    for b in range(B):
        row = []
        for h in range(KV_HEADS):
            chosen = positions[b, h][valid[b, h]].tolist()
            assert len(chosen) == len(set(chosen)), "a position counted twice would distort the softmax"
            row.append(set(chosen))
        out.append(row)
    return out


def check_view(method, slot, L, scores, ends=None):
    """The view of `slot` for draft forwards ending at L.. against the rule; scores [layers, kv_heads, N]."""
    config = method.config
    for end in ends or [L, L + 3]:
        view = method.view([slot], [end])
        for layer in range(LAYERS):
            sets, candidates, top, kept_end, bar = guided_reference(scores[layer], L, config.budget, config.sink,
                                                                    config.window, config.floor)
            got = view_sets(view, layer, 1)[0]
            count = min(config.sink, kept_end) + top
            recent = set(range(max(kept_end, end - (config.budget - count)), end))
            for h in range(KV_HEADS):
                chosen = got[h] - recent
                assert set(range(min(config.sink, kept_end))) <= chosen
                assert len(chosen) == count and len(got[h]) <= config.budget
                ranks = {p: rank(float(scores[layer, h, p]), p, bar) for p in candidates}
                threshold = sorted(ranks.values(), reverse=True)[top - 1] if top else (2, 0.0)
                for p in chosen - set(range(config.sink)):
                    assert config.sink <= p < kept_end
                    # by score (equal to the threshold within rounding), or faint and at least as new
                    assert ranks[p] >= threshold or (ranks[p][0] == threshold[0] == 1
                                                     and ranks[p][1] >= threshold[1] - 1e-6), (p, ranks[p], threshold)
                assert recent <= got[h]


def snapkv_scores(queries, keys, prompt_len, window, kernel):
    """SnapKV's window scores (loops), average-pooled: the guided view's scores at prefill."""
    return torch.tensor([pooled(score, kernel) for score in window_attention_scores(queries, keys, prompt_len, window)])


def raised_by_loops(scores, successors):
    """scores [..., N] with each position's score raised to the highest of itself and the
    `successors` positions before it, by loops."""
    out = scores.clone()
    for p in range(scores.shape[-1]):
        for back in range(1, min(successors, p) + 1):
            out[..., p] = torch.maximum(out[..., p], scores[..., p - back])
    return out


@pytest.mark.parametrize("successors", [0, 3])
@pytest.mark.parametrize("floor", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("smoothing", [0.0, 0.5])
def test_selection_follows_prefill_then_each_round(selection, smoothing, floor, successors):
    cache = filled_cache(seed=1)
    config = DraftConfig(method="guided", budget=40, sink=4, window=6, kernel_size=3, smoothing=smoothing,
                         floor=floor, successors=successors)
    method = Guided(config, cache, HEADS)
    g = torch.Generator().manual_seed(2)
    prompts = {0: 120, 2: 32}  # a long prompt, and one whose candidates fit the budget
    state = {}
    for slot, n in prompts.items():
        observed = torch.randn(LAYERS, HEADS, config.window, D, generator=g)
        method.prefill_done(slot, n, observed)
        scores = torch.stack([snapkv_scores(observed[layer], cache.k[layer, slot], n, config.window, 3)
                              for layer in range(LAYERS)]) / (GROUP * config.window)
        check_view(method, slot, n + 1, scores)
        state[slot] = (scores, n)
    # Rounds: verification masses for both rows at once; row 2 crosses the budget on the way.
    for round_ in range(10):
        gamma = 1 + round_ % 3
        lengths = {slot: n for slot, (_, n) in state.items()}
        N = max(lengths.values()) + gamma + 1
        mass = torch.rand(LAYERS, 2, KV_HEADS, N, generator=g) ** 4  # peaked, like attention
        committed = {slot: n + 1 + int(torch.randint(0, gamma + 1, (1,), generator=g)) for slot, n in lengths.items()}
        slots = list(prompts)
        method.observe_mass(mass, [0, 1], slots, [committed[s] + 1 for s in slots], [committed[s] for s in slots],
                            gamma + 1)
        for b, slot in enumerate(slots):
            this = mass[:, b] / (GROUP * (gamma + 1))
            previous, _ = state[slot]
            want = this.clone()
            if smoothing:
                old = torch.zeros_like(this)
                width = min(previous.shape[-1], N)
                old[..., :width] = previous[..., :width]
                want = smoothing * old + (1 - smoothing) * this
                want[..., committed[slot]:] = 0  # rejected drafts' positions start again
            # Rounds rank by the raised scores; the smoothed scores carried on are the unraised ones.
            check_view(method, slot, committed[slot] + 1, raised_by_loops(want, successors))
            state[slot] = (want, committed[slot])
    assert int(method.kept_count[2]) == config.budget - config.window  # row 2 now fills its kept part
    if floor:  # the bar is met by some positions and missed by others: both orders were exercised
        scores, n = state[0]
        bar = floor / (n + 1 - config.window)
        assert (scores[..., config.sink:n + 1 - config.window] >= bar).any()
        assert (scores[..., config.sink:n + 1 - config.window] < bar).any()


def test_kernel_selection_with_ties_and_any_pivot_hint():
    """The C++ op against a sort by loops: ties go to the lowest positions, and the previous round's
    threshold (the pivot hint: far too high, far too low, none) never changes the result."""
    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?)")
    g = torch.Generator().manual_seed(7)
    layers, B, H, N, sink, top, slots_n = 2, 3, 2, 90, 3, 20, 4
    scores = torch.randint(0, 6, (layers, B, H, N), generator=g).float()  # many ties
    slots = torch.tensor([3, 0, 2])
    kept_end = torch.tensor([90, 15, 60])  # row 1: fewer candidates than `top` (keeps them all)
    for hint_value in (0.0, 1e-3, 2.0, 1e6):
        kept = torch.full((layers, slots_n, H, sink + top), -7, dtype=torch.long)
        hint = torch.full((layers, B, H), hint_value)
        changed = kernel.guided_select(scores, slots, kept_end, torch.zeros(B, dtype=torch.long), kept, hint,
                                       1.0, 0.0, sink, top, 0, None, None, None, None)
        assert changed == 0  # no store given
        for layer in range(layers):
            for b in range(B):
                end = int(kept_end[b])
                for h in range(H):
                    ranked = sorted(range(sink, end), key=lambda p: (-float(scores[layer, b, h, p]), p))
                    count = sink + min(top, end - sink)
                    want = list(range(sink)) + sorted(ranked[:top])
                    assert kept[layer, int(slots[b]), h, :count].tolist() == want
                    assert (kept[layer, int(slots[b]), h, count:] == -7).all()
                    if end - sink > top:  # the hint now holds this round's threshold
                        assert float(hint[layer, b, h]) == float(scores[layer, b, h, ranked[top - 1]])


def test_short_rows_read_everything(selection):
    cache = filled_cache(seed=3)
    config = DraftConfig(method="guided", budget=40, sink=4, window=6)
    method = Guided(config, cache, HEADS)
    method.prefill_done(1, 3, torch.randn(LAYERS, HEADS, 3, D))  # shorter than the sinks
    for end in (4, 5, 40):
        assert view_sets(method.view([1], [end]), 0, 1)[0] == [set(range(end))] * KV_HEADS


def test_compact_store_refills_only_what_changed(selection):
    cache = filled_cache(seed=4)
    config = DraftConfig(method="guided", budget=40, sink=4, window=6)
    method = Guided(config, cache, HEADS)
    assert method.enable_compact(extra=5, copy_committed=True)
    assert not Guided(config, cache, HEADS).enable_compact(extra=5, copy_committed=False), \
        "a separate draft reads its whole cache each round: no store"
    g = torch.Generator().manual_seed(5)
    method.prefill_done(0, 200, torch.randn(LAYERS, HEADS, config.window, D, generator=g))
    cache.set_length(0, 200)
    store = method.compact

    def holds_the_kept_positions():
        count = int(method.kept_count[0])
        for layer in range(LAYERS):
            for h in range(KV_HEADS):
                positions = method.kept[layer, 0, h, :count]
                assert len(set(positions.tolist())) == count
                assert torch.equal(store.k[layer, 0, h, :count], cache.k[layer, 0, h, positions].to(store.k.dtype))
                assert torch.equal(store.v[layer, 0, h, :count], cache.v[layer, 0, h, positions].to(store.v.dtype))

    holds_the_kept_positions()
    mass = torch.rand(LAYERS, 1, KV_HEADS, 204, generator=g) ** 4
    for _ in range(2):  # the same scores twice: the second selection copies nothing
        before = method.changed_entries
        method.committed(0, 202)
        method.observe_mass(mass, [0], [0], [203], [202], 4)
        holds_the_kept_positions()
    assert method.changed_entries == before
    # A shift of the scores moves part of the selection: only the moved entries are copied.
    shifted = torch.roll(mass, 1, dims=-1)
    before = method.changed_entries
    method.observe_mass(shifted, [0], [0], [203], [202], 4)
    holds_the_kept_positions()
    moved = method.changed_entries - before
    assert 0 < moved < LAYERS * KV_HEADS * (config.budget - config.sink - config.window)


def test_recipe_keys_are_validated():
    base = {"model": "tiny", "draft": {"method": "guided", "budget": 48, "sink": 16, "window": 32}}
    with pytest.raises(JobError, match="draft.budget"):
        recipe_from_dict(base)
    for bad in (1.0, -0.1):
        with pytest.raises(JobError, match="draft.smoothing"):
            recipe_from_dict({"model": "tiny", "draft": {"method": "guided", "smoothing": bad}})
    assert recipe_from_dict({"model": "tiny", "draft": {"method": "guided", "smoothing": 0.3}}).draft.smoothing == 0.3
    for bad in (-1.0, float("nan")):
        with pytest.raises(JobError, match="draft.floor"):
            recipe_from_dict({"model": "tiny", "draft": {"method": "guided", "floor": bad}})
    assert recipe_from_dict({"model": "tiny", "draft": {"method": "guided", "floor": 0}}).draft.floor == 0
    for bad in (0, -2, 1.5):
        with pytest.raises(JobError, match="draft.reselect_every"):
            recipe_from_dict({"model": "tiny", "draft": {"method": "guided", "reselect_every": bad}})
    every = recipe_from_dict({"model": "tiny", "draft": {"method": "guided", "reselect_every": 4}}).draft.reselect_every
    assert every == 4
    with pytest.raises(JobError, match="draft.successors"):
        recipe_from_dict({"model": "tiny", "draft": {"method": "guided", "successors": -1}})
    assert recipe_from_dict({"model": "tiny", "draft": {"method": "guided", "successors": 2}}).draft.successors == 2
