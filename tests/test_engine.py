"""The engine is the same model as transformers': logits, greedy output, stopping, sampling."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, make_tiny, random_prompts
from engine.core.attention import BATCH_KWARG, ForwardBatch
from engine.core.prefill import RowPrefill, prefill_rows
from engine.core.prefill_attention import PrefillBatch, Segment
from engine.config.loading import recipe_from_dict
from engine.spec.decoder import build_engine
from engine.core.runner import ModelRunner
from engine.core.sequence import Request


def plain_recipe(**over):
    raw = {"model": "tiny", "draft": {"method": "none"}, "batch": {"size": 3, "prefill_chunk": 16},
           "sampling": {"max_new_tokens": 24}}
    for key, value in over.items():
        section, _, leaf = key.partition("__")
        raw.setdefault(section, {})[leaf] = value
    return recipe_from_dict(raw)


def generate(engine, prompts, max_new):
    results = {r.request.index: r for r in engine.run(Request(i, i, p, max_new) for i, p in enumerate(prompts))}
    return [results[i] for i in range(len(prompts))]


def check_logits(runner, reference, prompts, slots, *, chunk, steps, next_tokens):
    """The engine's logits against transformers' forward of the same weights (fp32, within 1e-4): each
    prompt whole, then as a chunked prefill into its slot, then `steps` decode steps of all rows
    together (mixed lengths in one batch), `next_tokens()` giving each step's [rows] input."""
    for slot, prompt in zip(slots, prompts):
        ids = torch.tensor(prompt)
        with torch.no_grad():
            want = reference(ids[None]).logits[0]  # [n, vocab]
        whole = runner.forward(ids[None], ForwardBatch(runner.cache, [slot], [0], len(prompt)))[0]
        torch.testing.assert_close(whole, want, atol=1e-4, rtol=0)
        chunks = []
        for start in range(0, len(prompt), chunk):
            piece = ids[start:start + chunk]
            chunks.append(runner.forward(piece[None], ForwardBatch(runner.cache, [slot], [start], len(piece)))[0])
        torch.testing.assert_close(torch.cat(chunks), want, atol=1e-4, rtol=0)
    lengths = [len(p) for p in prompts]
    history = [list(p) for p in prompts]
    for _ in range(steps):
        nxt = next_tokens()  # [rows]
        logits = runner.forward(nxt[:, None], ForwardBatch(runner.cache, list(slots), lengths, 1))[:, 0]
        for b in range(len(prompts)):
            history[b].append(int(nxt[b]))
            with torch.no_grad():
                want = reference(torch.tensor([history[b]])).logits[0, -1]
            torch.testing.assert_close(logits[b], want, atol=1e-4, rtol=0)
        lengths = [n + 1 for n in lengths]


def test_logits_match_transformers_prefill_chunks_and_decode(tiny):
    loaded, reference = tiny
    runner = ModelRunner(loaded, slots=4, capacity=128)
    check_logits(runner, reference, random_prompts(3, 20, 60), [2, 0, 3], chunk=7, steps=5,
                 next_tokens=lambda: torch.randint(3, 512, (3,)))


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_packed_prefill_of_several_rows_matches_transformers(tiny, chunk):
    """Rows of different lengths packed along the token axis (segments crossing forwards at `chunk`
    tokens): each row's last logits, and every position's logits of a packed forward, within 1e-4."""
    loaded, reference = tiny
    runner = ModelRunner(loaded, slots=4, capacity=128)
    prompts = random_prompts(3, 5, 60, seed=3) + random_prompts(1, 31, 40, seed=4)
    rows = [RowPrefill(slot, prompt) for slot, prompt in zip([3, 0, 2], prompts)]
    prefill_rows(runner, rows, chunk)
    for row in rows:
        with torch.no_grad():
            want = reference(torch.tensor([row.prompt_ids])).logits[0, -1]
        torch.testing.assert_close(row.logits, want, atol=1e-4, rtol=0)
        assert runner.cache.lengths[row.slot] == len(row.prompt_ids)
    # Every position of one packed forward (two rows, the second continuing from its cached start).
    tokens = torch.tensor(prompts[0][:9] + prompts[3][20:31])
    runner.forward(torch.tensor([prompts[3][:20]]), ForwardBatch(runner.cache, [0], [0], 20))  # slot 0 caches 0..19
    batch = PrefillBatch(runner.cache, [Segment(1, 0, 9), Segment(0, 20, 11)])
    out = runner.model(input_ids=tokens[None], position_ids=batch.positions, use_cache=False,
                       **{BATCH_KWARG: batch}).logits[0]  # [20, vocab]
    with torch.no_grad():
        first = reference(torch.tensor([prompts[0][:9]])).logits[0]
        second = reference(torch.tensor([prompts[3][:31]])).logits[0, 20:]
    torch.testing.assert_close(out, torch.cat([first, second]), atol=1e-4, rtol=0)


def test_greedy_equals_transformers_generate_mixed_lengths(tiny):
    loaded, reference = tiny
    prompts = random_prompts(8, 3, 90)
    engine = build_engine(plain_recipe(), loaded)  # 3 slots for 8 rows: slots are refilled as rows finish
    results = generate(engine, prompts, 24)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(reference, prompt, 24)


def test_rows_stop_on_their_own_eos_and_max_new_tokens():
    loaded, reference = make_tiny(5)
    prompts = random_prompts(6, 5, 40, seed=9)
    # Choose as EOS a token that plain greedy emits mid-way for some rows but not all.
    free = [hf_greedy(reference, p, 20, eos=None) for p in prompts]
    counts = torch.bincount(torch.tensor([t for row in free for t in row[2:10]]), minlength=512)
    eos = int(counts.argmax())
    loaded.eos_token_ids = (eos,)
    engine = build_engine(plain_recipe(), loaded)
    results = generate(engine, prompts, 20)
    reasons = set()
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(reference, prompt, 20, eos=eos)
        reasons.add(result.finish_reason)
        if result.finish_reason == "stop":
            assert result.token_ids[-1] == eos and eos not in result.token_ids[:-1]
        else:
            assert result.finish_reason == "length" and len(result.token_ids) == 20
    assert reasons == {"stop", "length"}


def test_slot_capacity_stops_a_row_with_length():
    loaded, _ = make_tiny(1)
    engine = build_engine(plain_recipe(batch__max_len=30), loaded)
    prompt = random_prompts(1, 10, 10)[0]
    result = generate(engine, [prompt], 20)[0]
    assert len(prompt) + len(result.token_ids) <= 30 and result.finish_reason == "length"
    too_long = generate(engine, [random_prompts(1, 25, 25)[0]], 20)[0]
    assert too_long.finish_reason == "error" and "batch.max_len" in too_long.error


def test_sampling_is_reproducible_and_seeded(tiny):
    loaded, _ = tiny
    prompts = random_prompts(5, 4, 30)

    def sample(seed):
        recipe = plain_recipe(sampling__temperature=1.0, sampling__top_p=0.9, sampling__top_k=50,
                              sampling__seed=seed)
        return [r.token_ids for r in generate(build_engine(recipe, loaded), prompts, 16)]

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_sampled_rows_do_not_depend_on_batch_composition(tiny):
    loaded, _ = tiny
    prompts = random_prompts(4, 4, 30)
    recipe = plain_recipe(sampling__temperature=0.8, sampling__seed=3)
    together = [r.token_ids for r in generate(build_engine(recipe, loaded), prompts, 12)]
    alone = []
    for i, p in enumerate(prompts):
        engine = build_engine(recipe, loaded)
        alone.append(next(iter(engine.run([Request(i, i, p, 12)]))).token_ids)
    assert together == alone


@pytest.mark.real_model
def test_real_model_greedy_equals_transformers(real_model):
    from transformers import AutoModelForCausalLM

    tokenizer = real_model.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
             "Three facts about the ocean:\n1."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    recipe = recipe_from_dict({"draft": {"method": "none"}, "batch": {"size": 2, "max_len": 256},
                               "sampling": {"max_new_tokens": 20}})
    results = generate(build_engine(recipe, real_model), prompts, 20)
    reference = AutoModelForCausalLM.from_pretrained(real_model.model.name_or_path, attn_implementation="sdpa")
    eos = real_model.eos_token_ids[0]
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(reference, prompt, 20, eos=eos)


@pytest.mark.real_model
def test_real_model_logits_match_transformers(real_model):
    """The same property on the real default model."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(real_model.model.name_or_path, attn_implementation="sdpa").eval()
    texts = ["def greet(name):\n    return 'Hello, ' + name\n\nprint(greet(", "The three primary colours are red,"]
    prompts = [real_model.tokenizer(t)["input_ids"] for t in texts]
    runner = ModelRunner(real_model, slots=2, capacity=128)
    g = torch.Generator().manual_seed(0)
    check_logits(runner, reference, prompts, [1, 0], chunk=5, steps=3,
                 next_tokens=lambda: torch.randint(0, 49152, (2,), generator=g))
