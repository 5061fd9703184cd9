"""MagicDec rounds are lossless: greedy speculative output equals the engine's plain greedy output.

Tiny random-weight models; every compressor, self-speculation and a separate draft model; rows of
different lengths finishing at different times; EOS and max_new_tokens landing inside accepted runs;
every acceptance length 0..gamma occurring (checked, not assumed).
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny, random_prompts
from engine.spec.draft import forward as draft_forward
from engine.config.loading import recipe_from_dict
from engine.spec.decoder import build_engine
from engine.spec.gamma import GammaPolicy
from engine.errors import JobError
from engine.models.loading import LoadedModel
from engine.core.sequence import Request, Sequence

GAMMA = 4
MAX_NEW = 40


def recipe(method: str, *, gamma=GAMMA, budget=64, temperature=0.0, size=4, linear_dtype="same"):
    return recipe_from_dict({
        "model": "tiny",
        "draft": {"method": method, "budget": budget, "sink": 4, "window": 8, "subspaces": 4, "bits": 4,
                  "linear_dtype": linear_dtype},
        "spec": {"gamma": gamma}, "batch": {"size": size, "prefill_chunk": 32},
        "sampling": {"max_new_tokens": MAX_NEW, "temperature": temperature, "seed": 11},
    })


SHORT_ROWS = (2, 3, 2, 3)  # max_new_tokens of extra rows (the first prompts again)


def run(engine, prompts):
    """Every row's tokens: each prompt with MAX_NEW new tokens, then the first prompts again stopping at
    2 or 3 tokens, which ends them inside their first round's accepted run as soon as it accepts 1 or
    2 drafts: a max_new_tokens cut inside an accepted run happens whatever the draft (checked below)."""
    rows = [(p, MAX_NEW) for p in prompts] + [(prompts[i % len(prompts)], n) for i, n in enumerate(SHORT_ROWS)]
    results = {r.request.index: r for r in engine.run(Request(i, i, p, n) for i, (p, n) in enumerate(rows))}
    return [results[i].token_ids for i in range(len(rows))]


@pytest.fixture(scope="module")
def setup():
    loaded, _ = make_tiny(0)
    prompts = random_prompts(10, 20, 150)
    plain = run(build_engine(recipe("none"), loaded), prompts)
    # EOS: a token plain greedy emits mid-way in some rows, so rows stop at different times.
    counts = torch.bincount(torch.tensor([t for row in plain for t in row[3:30]]), minlength=512)
    eos = int(counts.argmax())
    return loaded, prompts, eos


def noisy_copy(loaded: LoadedModel, scale: float) -> LoadedModel:
    """A separate draft model: the target's weights plus noise (same vocabulary, other weights)."""
    draft, _ = make_tiny(0)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    draft.eos_token_ids = loaded.eos_token_ids
    return draft


@pytest.fixture
def cuts(monkeypatch):
    """Record every round whose tokens were cut by a row's stop (EOS or max_new_tokens)."""
    seen = []
    original = Sequence.extend

    def extend(self, tokens):
        taken = original(self, tokens)
        if taken < len(tokens):
            seen.append(self.finish_reason)
        return taken

    monkeypatch.setattr(Sequence, "extend", extend)
    return seen


# The draft step: transformers' forward (any model) or the lean one (engine.draft_forward), with its
# GEMMs in the target's dtype, bf16 or int8.
DRAFT_STEPS = [("transformers", "same"), ("transformers", "bfloat16"), ("lean", "bfloat16"), ("lean", "int8")]


@pytest.mark.parametrize("path,linear_dtype", DRAFT_STEPS, ids=["-".join(s) for s in DRAFT_STEPS])
@pytest.mark.parametrize("draft_kind", ["self", "separate"])
@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "pqcache", "guided"])
def test_greedy_speculation_is_lossless(setup, cuts, monkeypatch, method, draft_kind, path, linear_dtype):
    loaded, prompts, eos = setup
    loaded.eos_token_ids = (eos,)
    plain = run(build_engine(recipe("none"), loaded), prompts)
    draft = noisy_copy(loaded, 0.005) if draft_kind == "separate" else None
    if path == "transformers":
        monkeypatch.setattr(draft_forward, "supports", lambda *args: False)
    elif not draft_forward.supports(loaded.model, torch.float32, loaded.device):
        pytest.skip("the lean draft forward needs the compiled CPU attention kernel")
    engine = build_engine(recipe(method, linear_dtype=linear_dtype), loaded, draft)
    assert engine.decoder.draft_forward.path == path
    assert engine.decoder.draft_forward.gemm_dtype == ("float32" if linear_dtype == "same" else linear_dtype)
    # The lean draft reads StreamingLLM, SnapKV and self-speculative guided views from its compact bf16
    # store (a separate guided draft reads its whole cache at each round's start, so keeps its K/V there).
    has_store = path == "lean" and method != "pqcache" and not (method == "guided" and draft_kind == "separate")
    assert (engine.decoder.compressor.compact is not None) == has_store
    cuts.clear()
    speculative = run(engine, prompts)
    assert speculative == plain
    histogram = engine.stats.accepted_histogram
    assert len(histogram) == GAMMA + 1 and all(histogram), f"acceptance lengths seen: {histogram}"
    assert "stop" in cuts and "length" in cuts, f"stops inside accepted runs: {cuts}"
    lengths = {len(row) for row in plain}
    assert len(lengths) > 1 and MAX_NEW in lengths  # rows finished at different times
    if method == "guided":  # the views really moved with the verification (or first draft step) mass
        compressor = engine.decoder.compressor
        assert compressor.selected_entries > 0 and engine.stats.round_select_s > 0
        if has_store:
            assert 0 < compressor.changed_entries < compressor.selected_entries


@pytest.mark.parametrize("draft_kind", ["self", "separate"])
def test_guided_reselecting_every_few_rounds_is_lossless(setup, monkeypatch, draft_kind):
    """draft.reselect_every 3: the full-cache forward returns its mass (and the view is chosen again)
    on the first speculative round and every third after it, never between; the output is plain's."""
    loaded, prompts, eos = setup
    loaded.eos_token_ids = (eos,)
    plain = run(build_engine(recipe("none"), loaded), prompts)
    draft = noisy_copy(loaded, 0.005) if draft_kind == "separate" else None
    config = recipe("guided").to_dict()
    config["draft"]["reselect_every"] = 3
    engine = build_engine(recipe_from_dict(config), loaded, draft)
    compressor = engine.decoder.compressor
    observed_at = []  # the speculative round (counted from 0) of every re-selection
    observe = compressor.observe_mass

    def counted(*args, **kwargs):
        observed_at.append(compressor.spec_rounds - 1)
        observe(*args, **kwargs)

    monkeypatch.setattr(compressor, "observe_mass", counted)
    assert run(engine, prompts) == plain
    assert compressor.spec_rounds > 6 and observed_at == list(range(0, compressor.spec_rounds, 3))


def test_a_guided_view_is_chosen_in_the_plain_round_before_speculation(setup, monkeypatch):
    """Under gamma: auto a self-speculating guided draft re-selects in the plain rounds the policy says
    come right before a speculative one (the warm-up's last, so the first probe reads a view one round
    old, not the prompt's), in every speculative round, and in no other round; the output is plain's."""
    loaded, prompts, eos = setup
    loaded.eos_token_ids = (eos,)
    plain = run(build_engine(recipe("none"), loaded), prompts)
    engine = build_engine(recipe_from_dict({**recipe("guided").to_dict(), "spec": {"gamma": "auto", "replan_every": 4}}),
                          loaded)
    decoder, compressor = engine.decoder, engine.decoder.compressor
    rounds = []  # per round: [gamma, refresh_view, the tokens per row of each re-selection in it]
    run_round, observe = decoder.rounds.run, compressor.observe_mass

    def running(seqs, gamma, *, refresh_view=False):
        rounds.append([gamma, refresh_view, []])
        return run_round(seqs, gamma, refresh_view=refresh_view)

    def observing(mass, rows, slots, ends, committed, tokens):
        rounds[-1][2].append(tokens)
        observe(mass, rows, slots, ends, committed, tokens)

    monkeypatch.setattr(decoder.rounds, "run", running)
    monkeypatch.setattr(compressor, "observe_mass", observing)
    assert run(engine, prompts) == plain
    assert all(seen == ([1] if refresh else []) for gamma, refresh, seen in rounds if gamma == 0), rounds
    assert all(seen == [gamma + 1] for gamma, _, seen in rounds if gamma > 0), rounds
    warm_up = GammaPolicy.WARMUP_PLAIN
    assert [r[:2] for r in rounds[:warm_up + 1]] == [[0, False]] * (warm_up - 1) + [[0, True], [GammaPolicy.PROBE_GAMMA, False]]
    assert sum(refresh for _, refresh, _ in rounds) >= 2, rounds


def test_speculation_with_fixed_gamma_one_and_auto(setup):
    loaded, prompts, eos = setup
    loaded.eos_token_ids = (eos,)
    plain = run(build_engine(recipe("none"), loaded), prompts)
    assert run(build_engine(recipe("streamingllm", gamma=1), loaded), prompts) == plain
    auto = build_engine(recipe_from_dict({**recipe("streamingllm").to_dict(), "spec": {"gamma": "auto", "replan_every": 4}}),
                  loaded)
    assert run(auto, prompts) == plain
    guided = build_engine(recipe_from_dict({**recipe("guided").to_dict(), "spec": {"gamma": "auto", "replan_every": 4}}),
                          loaded)
    assert run(guided, prompts) == plain


@pytest.mark.parametrize("method", ["snapkv", "guided"])
def test_speculative_sampling_is_reproducible(setup, method):
    loaded, prompts, _ = setup
    loaded.eos_token_ids = (2,)
    first = run(build_engine(recipe(method, temperature=0.9), loaded), prompts)
    assert run(build_engine(recipe(method, temperature=0.9), loaded), prompts) == first


def test_separate_draft_must_share_the_vocabulary(setup):
    loaded, _, _ = setup
    other, _ = make_tiny(0, vocab_size=600)
    with pytest.raises(JobError, match="vocabulary"):
        build_engine(recipe("streamingllm"), loaded, other)


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "pqcache", "guided"])
def test_real_model_speculation_equals_plain(real_model, method):
    tokenizer = real_model.tokenizer
    import inspect
    import textwrap

    source = inspect.getsource(textwrap)
    texts = [source[:1800] + "\n# What does dedent do?\n", source[2000:3600] + "\n# Summary:\n"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    base = {"batch": {"size": 2, "max_len": 1024}, "sampling": {"max_new_tokens": 24}}
    plain = run(build_engine(recipe_from_dict({**base, "draft": {"method": "none"}}), real_model), prompts)
    spec = build_engine(recipe_from_dict({**base, "draft": {"method": method, "budget": 128, "window": 16, "sink": 8},
                                    "spec": {"gamma": 3}}), real_model)
    out = run(spec, prompts)
    assert out == plain
    assert spec.stats.accepted_tokens > 0


def bf16_tiny(seed: int = 0):
    """The tiny model and its transformers twin in bfloat16 (weights, activations and KV cache)."""
    loaded, reference = make_tiny(seed)
    loaded.model.to(torch.bfloat16)
    reference.to(torch.bfloat16)
    loaded.dtype = torch.bfloat16
    return loaded, reference


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "pqcache"])
def test_bf16_speculation_equals_bf16_plain(method):
    """The bf16 path (bf16 weights and K/V; the fused kernel where built) stays lossless against the
    engine's own bf16 plain decoding."""
    loaded, _ = bf16_tiny(0)
    prompts = random_prompts(6, 20, 150)
    plain = run(build_engine(recipe("none"), loaded), prompts)
    spec = run(build_engine(recipe(method), loaded), prompts)
    assert spec == plain


def test_bf16_plain_greedy_follows_transformers_bf16_generate():
    """Greedy bf16 decoding against transformers' own bf16 `generate` (same weights). Two correct bf16
    computations round differently, so a row may leave the reference's tokens, but only at a near-tie:
    where they part, the reference's own logits for the two tokens are within bf16 rounding of each
    other. A wrong computation parts at a clear winner, and fails. (The real model's figure is in
    BENCHMARKS.md.)"""
    loaded, reference = bf16_tiny(3)
    prompts = random_prompts(8, 10, 120, seed=5)
    engine = build_engine(recipe("none"), loaded)
    results = {r.request.index: r.token_ids for r in engine.run(Request(i, i, p, 16) for i, p in enumerate(prompts))}
    identical = 0
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(prompt):].tolist()
        ours = results[i]
        parted = next((k for k, (a, b) in enumerate(zip(out, ours)) if a != b), None)
        if parted is None:
            identical += 1
            continue
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out[:parted]])).logits[0, -1].float()  # [vocab]
        gap = float(logits[out[parted]] - logits[ours[parted]])
        assert 0 <= gap <= 0.02 * float(logits.abs().max()) + 0.05, (i, parted, gap)
    assert identical >= 4, f"{identical}/8 rows identical"
