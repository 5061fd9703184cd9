"""Each compressor's selection equals a brute-force implementation of its rule."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny, pooled, random_cache, random_prompts, window_attention_scores

from engine.config.schema import DraftConfig
from engine.spec.compressors.pqcache import PQCache, kmeans, nearest
from engine.spec.compressors.snapkv import SnapKV
from engine.spec.compressors.streamingllm import StreamingLLM

LAYERS, SLOTS, KV_HEADS, HEADS, D = 2, 3, 2, 4, 8


def filled_cache(capacity=400, seed=0):
    return random_cache(layers=LAYERS, slots=SLOTS, kv_heads=KV_HEADS, head_dim=D, capacity=capacity, seed=seed)


def view_sets(view, layer, query, B):
    positions, valid = view.select(layer, query)
    return [[set(positions[b, h][valid[b, h]].tolist()) for h in range(KV_HEADS)] for b in range(B)]


def no_duplicates(view, layer, query):
    positions, valid = view.select(layer, query)
    for b in range(positions.shape[0]):
        for h in range(KV_HEADS):
            chosen = positions[b, h][valid[b, h]].tolist()
            assert len(chosen) == len(set(chosen)), "a position counted twice would distort the softmax"


# ----------------------------------------------------------------------------- StreamingLLM

def streaming_reference(end, budget, sink):
    if end <= budget:
        return set(range(end))
    return set(range(sink)) | set(range(end - (budget - sink), end))


@pytest.mark.parametrize("budget,sink", [(16, 4), (64, 0), (32, 31)])
def test_streamingllm_keeps_sinks_and_the_newest(budget, sink):
    cache = filled_cache()
    method = StreamingLLM(DraftConfig(method="streamingllm", budget=budget, sink=sink), cache, HEADS)
    ends = [3, budget, budget + 1, 377]
    view = method.view([0, 1, 2, 0], ends)
    query = torch.zeros(4, HEADS, 1, D)
    for b, end in enumerate(ends):
        for h in range(KV_HEADS):
            assert view_sets(view, 0, query, 4)[b][h] == streaming_reference(end, budget, sink)
    no_duplicates(view, 0, query)


# ----------------------------------------------------------------------------- SnapKV

def snapkv_reference(queries, keys, prompt_len, window, kernel, pooling):
    """Loops: softmax of each window query (causal), summed over window and group heads, pooled over
    the positions before the window. Returns the pooled score of every candidate position, per KV head.
    """
    return [pooled(score[: prompt_len - window], kernel, pooling)
            for score in window_attention_scores(queries, keys, prompt_len, window)]


def is_top(chosen: set[int], scores: list[float], keep: int) -> bool:
    """`chosen` is a top-`keep` set of `scores` (ties and float32-vs-float64 noise at the cut allowed)."""
    count = min(keep, len(scores))
    threshold = sorted(scores, reverse=True)[count - 1]
    return len(chosen) == count and all(scores[j] >= threshold - 1e-6 for j in chosen)


@pytest.mark.parametrize("head_dim,window,prompt_len", [(8, 6, 120), (64, 32, 300), (64, 20, 40), (64, 1, 65)])
def test_prompt_window_scores_in_one_kernel_call_match_the_loops(head_dim, window, prompt_len):
    """The kernel's attention mass of the window's queries (every layer in one call) is the brute-force
    loop's softmax summed over window and group heads, for every layer and KV head."""
    from engine.core import kernels
    from engine.spec.compressors.snapkv import prompt_window_scores

    if kernels.load() is None:
        pytest.skip("the fused CPU kernel is not built here (no compiler): the layer loop is the only path")
    cache = random_cache(layers=3, slots=SLOTS, kv_heads=KV_HEADS, head_dim=head_dim, capacity=800, seed=3)
    observed = torch.randn(3, HEADS, window, head_dim, generator=torch.Generator().manual_seed(4))
    slot = 1
    got = prompt_window_scores(observed, cache, slot, prompt_len)  # [layers, kv_heads, prompt_len]
    assert got.shape == (3, KV_HEADS, prompt_len)
    for layer in range(3):
        want = window_attention_scores(observed[layer], cache.k[layer, slot, :, :prompt_len], prompt_len, window)
        for h in range(KV_HEADS):
            assert torch.allclose(got[layer, h].double(), torch.tensor(want[h], dtype=torch.float64),
                                  rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_snapkv_selection_matches_brute_force(pooling):
    cache = filled_cache(seed=1)
    budget, window, kernel = 40, 6, 5
    method = SnapKV(DraftConfig(method="snapkv", budget=budget, window=window, kernel_size=kernel,
                                pooling=pooling), cache, HEADS)
    g = torch.Generator().manual_seed(2)
    prompt_lens = {0: 120, 2: 30}  # one long prompt, one shorter than the budget
    for slot, n in prompt_lens.items():
        observed = torch.randn(LAYERS, HEADS, window, D, generator=g)
        method.prefill_done(slot, n, observed)
        for layer in range(LAYERS):
            keys = cache.k[layer, slot, :, :n]
            scores = snapkv_reference(observed[layer], keys, n, window, kernel, pooling)
            count = int(method.kept_count[slot])
            for h in range(KV_HEADS):
                assert is_top(set(method.kept[layer, slot, h, :count].tolist()), scores[h], budget - window)
    # The draft view: kept positions + the newest `window` (sliding as tokens are generated).
    query = torch.zeros(2, HEADS, 1, D)
    for end in (120, 121, 150):
        view = method.view([0, 2], [end, 30 + end - 120])
        for layer in range(LAYERS):
            sets = view_sets(view, layer, query, 2)
            for h in range(KV_HEADS):
                kept = set(method.kept[layer, 0, h, :budget - window].tolist())
                assert sets[0][h] == kept | set(range(end - window, end))
                # Short prompt: all of its 24 pre-window positions are kept, the rest of the budget
                # goes to the newest positions (so the draft reads everything while it fits).
                short_end = 30 + end - 120
                assert sets[1][h] == set(range(24)) | set(range(max(24, short_end - (budget - 24)), short_end))
            no_duplicates(view, layer, query)


# ----------------------------------------------------------------------------- PQCache

@pytest.fixture(params=["kernel-vector", "kernel-portable", "torch"])
def nearest_backend(request, monkeypatch):
    """PQCache's nearest centroids by the C++ op, its vector or portable steps (skipped where it cannot
    be built, or has no vector steps), or by torch."""
    from engine.core import kernels

    if request.param == "torch":
        monkeypatch.setattr(kernels, "load", lambda: None)
        yield "torch"
        return
    kernel = kernels.load()
    if kernel is None:
        pytest.skip("the fused CPU kernel is not built here (no compiler): torch is the only path")
    compiled = kernel.use_vector_path(request.param == "kernel-vector")
    try:
        if request.param == "kernel-vector" and not compiled:
            pytest.skip("no vector instructions compiled in here: the portable steps are the kernel")
        yield "kernel"
    finally:
        kernel.use_vector_path(True)


def test_kmeans_codes_are_the_nearest_centroids(nearest_backend):
    g = torch.Generator().manual_seed(3)
    points = torch.randn(3, 200, 4, generator=g)
    centroids = kmeans(points, 16, iters=5, sample=128)
    codes = nearest(points, centroids, chunk=37)
    for s in range(3):
        for i in range(200):
            distances = ((centroids[s] - points[s, i]) ** 2).sum(-1)
            assert torch.isclose(distances[codes[s, i]], distances.min())
    # Lloyd steps lower the quantisation error compared with the initial centroids.
    init = points[:, torch.linspace(0, 199, 16).round().long()]
    err = lambda c: ((points - c.gather(1, nearest(points, c)[..., None].expand(-1, -1, 4))) ** 2).sum()
    assert err(centroids) < err(init)


@pytest.mark.parametrize("groups,n,d,count", [(2, 700, 4, 256), (3, 5, 3, 20), (1, 33, 8, 7)])
def test_nearest_centroid_matches_brute_force(nearest_backend, groups, n, d, count):
    """Codes against the distances themselves (float64), for centroid counts below, at and off the
    kernel's 16-lane blocks, and with a tie: of two equal centroids the kernel takes the lower index."""
    g = torch.Generator().manual_seed(n)
    points = torch.randn(groups, n, d, generator=g)
    centroids = torch.randn(groups, count, d, generator=g)
    centroids[:, -1] = centroids[:, 0]  # a tie: the lower index wins
    codes = nearest(points, centroids)
    assert codes.shape == (groups, n) and codes.dtype == torch.long
    distances = ((points.double()[:, :, None, :] - centroids.double()[:, None, :, :]) ** 2).sum(-1)  # [G, n, C]
    chosen = distances.gather(2, codes[..., None])[..., 0]
    assert torch.allclose(chosen, distances.min(dim=2).values, rtol=1e-5, atol=1e-5)
    if nearest_backend == "kernel":  # its tie rule (a matmul may round two equal columns apart)
        assert (codes != count - 1).all()


def test_pqcache_retrieval_matches_brute_force():
    cache = filled_cache(seed=4)
    config = DraftConfig(method="pqcache", budget=48, sink=4, window=8, subspaces=4, bits=3, kmeans_iters=4)
    method = PQCache(config, cache, HEADS)
    prompt = {0: 300, 1: 200}
    for slot, n in prompt.items():
        method.prefill_done(slot, n, None)
    method.committed(0, 304)  # ten generated tokens committed after the prompt, in two rounds...
    method.committed(0, 310)  # ...whose codes are computed when a view reads the slot
    g = torch.Generator().manual_seed(5)
    query = torch.randn(2, HEADS, 1, D, generator=g)
    ends = [311, 201]
    view = method.view([0, 1], ends)
    group, sub = HEADS // KV_HEADS, D // config.subspaces
    retrieve = config.budget - config.sink - config.window
    for layer in range(LAYERS):
        sets = view_sets(view, layer, query, 2)
        for b, slot in enumerate([0, 1]):
            end = ends[b]
            for h in range(KV_HEADS):
                q = query[b, h * group:(h + 1) * group, 0].sum(0)  # the group's summed query
                scores = {}
                for pos in range(config.sink, end - config.window):
                    code = method.codes[layer, slot, h, pos].long()
                    total = 0.0
                    for m in range(config.subspaces):
                        centroid = method.centroids[layer, slot, h, m, code[m]]
                        total += float(q[m * sub:(m + 1) * sub] @ centroid)
                    scores[pos] = total
                fixed = set(range(config.sink)) | set(range(end - config.window, end))
                assert fixed <= sets[b][h]
                candidates = sorted(scores)
                retrieved = {candidates.index(p) for p in sets[b][h] - fixed}
                assert is_top(retrieved, [scores[p] for p in candidates], retrieve)
        no_duplicates(view, layer, query)
    # Codes of committed generated tokens use the prompt's centroids.
    keys = cache.k[0, 0, :, 300:310].view(KV_HEADS, 10, config.subspaces, sub).permute(0, 2, 1, 3)
    want_codes = nearest(keys, method.centroids[0, 0]).permute(0, 2, 1)
    assert torch.equal(method.codes[0, 0, :, 300:310].long(), want_codes)


def test_pqcache_reads_everything_below_the_budget():
    cache = filled_cache(seed=6)
    method = PQCache(DraftConfig(method="pqcache", budget=48, sink=4, window=8, subspaces=4, bits=3), cache, HEADS)
    method.prefill_done(0, 30, None)
    view = method.view([0], [31])
    assert view_sets(view, 0, torch.zeros(1, HEADS, 1, D), 1)[0] == [set(range(31))] * KV_HEADS


# ----------------------------------------------------------------------------- SnapKV's mass from the prefill

class RecordingSnapKV(SnapKV):
    """SnapKV that keeps what the prefill handed it (the window's queries and attention mass)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.handed = {}

    def prefill_done(self, slot, prompt_len, observed, mass=None):
        self.handed[slot] = (observed.clone(), None if mass is None else mass.clone())
        super().prefill_done(slot, prompt_len, observed, mass=mass)


@pytest.fixture
def amx_allowed(request):
    """Whether the fused kernels may use the AMX tile unit in this test (restored after)."""
    from engine.core import kernels

    module = kernels.load()
    previous = module.use_amx(request.param) if module is not None else None
    yield request.param
    if module is not None:
        module.use_amx(previous)


@pytest.mark.parametrize("backend,amx_allowed", [("kernel", True), ("kernel", False), ("torch", True)],
                         indirect=["amx_allowed"], ids=["kernel-amx", "kernel-no-amx", "torch"])
@pytest.mark.parametrize("chunk", [7, 40, 1000])
def test_prefill_hands_snapkv_the_window_mass_of_its_own_attention(tiny, backend, amx_allowed, chunk, monkeypatch):
    """The packed prefill attends each row's observation window with its attention mass (the AMX prefill
    task's tail tasks, the decode kernel's tail pass without AMX, or the torch path's softmax), windows
    cut across forwards at `chunk` tokens: the rows' logits still match transformers, the mass handed over
    is the brute-force window score of every layer, and SnapKV's kept positions are a top set of the
    brute-force rule."""
    from engine.core import attention, kernels
    from engine.core.prefill import RowPrefill, prefill_rows
    from engine.core.runner import ModelRunner

    if backend == "kernel" and kernels.load() is None:
        pytest.skip("the fused CPU kernel is not built here (no compiler)")
    loaded, reference = tiny
    if backend == "kernel" and amx_allowed:  # the AMX task takes head sizes that are multiples of 32
        loaded, reference = make_tiny(0, hidden_size=128, num_attention_heads=4)
        if not kernels.load().prefill_mass_on_amx(loaded.model.config.head_dim):
            pytest.skip("no AMX tiles here (the CPU or the build lacks AMX-BF16, or Linux did not lend them)")
    if backend == "torch":
        monkeypatch.setattr(attention, "cpu_kernel_for", lambda query, cache: None)
    runner = ModelRunner(loaded, slots=4, capacity=128)
    budget, window, kernel_size = 24, 8, 3
    method = RecordingSnapKV(DraftConfig(method="snapkv", budget=budget, window=window, kernel_size=kernel_size),
                             runner.cache, runner.heads)
    prompts = random_prompts(3, 20, 60, seed=5) + [random_prompts(1, 5, 5, seed=6)[0]]  # the last: < window
    rows = [RowPrefill(slot, prompt) for slot, prompt in zip([2, 0, 3, 1], prompts)]
    prefill_rows(runner, rows, chunk, method)
    for row in rows:
        n = len(row.prompt_ids)
        with torch.no_grad():
            want = reference(torch.tensor([row.prompt_ids])).logits[0, -1]
        torch.testing.assert_close(row.logits, want, atol=1e-4, rtol=0)
        observed, mass = method.handed[row.slot]
        assert mass is not None and mass.shape == (runner.layers, runner.kv_heads, n)
        seen = min(window, n)
        count = int(method.kept_count[row.slot])
        assert count == min(budget - window, max(n - seen, 0))
        for layer in range(runner.layers):
            keys = runner.cache.k[layer, row.slot, :, :n]
            brute = window_attention_scores(observed[layer], keys, n, seen)  # [kv_heads][n]
            torch.testing.assert_close(mass[layer].double(), torch.tensor(brute, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-5)
            for h in range(runner.kv_heads if count else 0):
                scores = pooled(brute[h][: n - seen], kernel_size)
                assert is_top(set(method.kept[layer, row.slot, h, :count].tolist()), scores, count)
