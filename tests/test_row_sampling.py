"""Per-row sampling parameters: each row decodes under its own temperature / top-p / top-k / seed /
max_new_tokens / stop, from an OpenAI batch body or the columns `input.sampling_columns` names.

- The recipe key and each row's values are checked: a bad value is that row's error record.
- Verification of one batch mixing greedy rows and sampled rows of different warpings: greedy rows
  are matched exactly, and each sampled row's emitted tokens follow its *own* warped target
  distribution (thousands of samples), while two wrong warpings (p warped with the recipe's
  parameters; q warped differently from how the drafts were drawn) fail the same check.
- End to end on a tiny model, with and without speculation: greedy rows equal their plain greedy
  output, every token a sampled row emits lies in its own warped support, rows stop at their own
  max_new_tokens and stop strings, and a sampled row's output depends only on its id and seed.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_tiny, random_prompts
from engine.config.loading import load_recipe, recipe_from_dict
from engine.config.schema import Recipe, SamplingConfig
from engine.core.sampling import BatchSampling, warp
from engine.core.sequence import Request
from engine.errors import JobError
from engine.job.io.input import InputRow
from engine.job.prompts import PromptBuilder
from engine.job.requests import row_verdicts
from engine.spec.decoder import build_engine
from engine.spec.verification import verify_greedy, verify_rows
from magicdec_cli.main import app


class TagTokenizer:
    """A stand-in tokenizer: text -> one id per character; ids -> "<id><id>..." (so a stop string
    "<17>" matches exactly where token 17 is emitted)."""

    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % 500 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


# --------------------------------------------------------------------------- the recipe key


def test_sampling_columns_recipe_key(tmp_path):
    recipe = recipe_from_dict({"input": {"sampling_columns": {"temperature": "temp", "stop": "stops"}}})
    assert recipe.input.sampling_columns == {"temperature": "temp", "stop": "stops"}
    assert Recipe().input.sampling_columns == {}
    with pytest.raises(JobError, match=r"unknown key 'input.sampling_columns.temprature'.*"
                                       r"did you mean 'input.sampling_columns.temperature'"):
        recipe_from_dict({"input": {"sampling_columns": {"temprature": "t"}}}, source="r.yaml")
    with pytest.raises(JobError, match="r.yaml: 'input.sampling_columns' must be a mapping"):
        recipe_from_dict({"input": {"sampling_columns": {"top_k": 3}}}, source="r.yaml")
    path = tmp_path / "r.yaml"
    path.write_text("model: tiny\n")
    got = load_recipe(str(path), ["input.sampling_columns.max_new_tokens=n", "input.sampling_columns.seed=s"])
    assert got.input.sampling_columns == {"max_new_tokens": "n", "seed": "s"}
    with pytest.raises(JobError, match="--set: unknown key 'input.sampling_columns.max_tokens'"):
        load_recipe(str(path), ["input.sampling_columns.max_tokens=n"])


# --------------------------------------------------------------------------- each row's values


def verdicts(rows: list[dict], **recipe_keys):
    recipe = recipe_from_dict({"model": "tiny", "sampling": {"temperature": 0.5, "top_k": 7, "max_new_tokens": 9,
                                                              "stop": ["END"], "seed": 3}, **recipe_keys})
    builder = PromptBuilder(recipe.prompt, TagTokenizer())
    return recipe, list(row_verdicts((InputRow(i, r) for i, r in enumerate(rows)), recipe, builder, 4096))


def openai_row(custom_id, **body):
    return {"custom_id": custom_id, "url": "/v1/completions", "body": {"prompt": "hi", **body}}


def test_openai_body_fields_set_the_row_sampling():
    recipe, (own, default) = verdicts([
        openai_row("a", temperature=0, top_p=0.5, top_k=-1, seed=42, max_completion_tokens=4, stop="\n"),
        openai_row("b")])
    assert own.request.sampling == SamplingConfig(temperature=0.0, top_p=0.5, top_k=0, seed=42,
                                                  max_new_tokens=4, stop=("\n",))
    assert own.request.max_new_tokens == 4 and own.request.own_seed
    assert default.request.sampling == recipe.sampling and default.request.max_new_tokens == 9
    assert not default.request.own_seed


def test_columns_named_by_the_recipe_set_the_row_sampling():
    columns = {"temperature": "temp", "top_p": "p", "max_new_tokens": "n", "stop": "stops", "seed": "s"}
    recipe, (own, partial, default) = verdicts([
        {"prompt": "x", "temp": 1.5, "p": 1, "n": 5.0, "stops": ["a", "b"], "s": 8},
        {"prompt": "y", "temp": None, "n": 3, "stops": "zz", "s": float("nan")},  # null / NaN: the recipe's
        {"prompt": "z", "other": 1}], input={"sampling_columns": columns})
    assert own.request.sampling == dataclasses.replace(recipe.sampling, temperature=1.5, top_p=1.0,
                                                       max_new_tokens=5, stop=("a", "b"), seed=8)
    assert own.request.own_seed and own.request.max_new_tokens == 5
    assert partial.request.sampling == dataclasses.replace(recipe.sampling, max_new_tokens=3, stop=("zz",))
    assert not partial.request.own_seed
    assert default.request.sampling == recipe.sampling


def test_a_bad_sampling_value_is_that_rows_error():
    columns = {"temperature": "temp", "max_new_tokens": "n", "stop": "stops", "top_k": "k"}
    _, got = verdicts([
        openai_row("neg", temperature=-0.5),
        openai_row("str", max_tokens="10"),
        openai_row("empty-stop", stop=["ok", ""]),
        {"prompt": "a", "temp": -1},
        {"prompt": "b", "n": "ten"},
        {"prompt": "c", "k": 2.5},
        {"prompt": "d", "stops": 5},
        {"prompt": "e", "n": 0},
        {"prompt": "fine", "temp": 0.0}], input={"sampling_columns": columns})
    errors = [v.error for v in got]
    assert errors[0] == "body.temperature must be >= 0, got -0.5"
    assert errors[1] == "body.max_tokens must be an integer, got '10'"
    assert errors[2] == "body.stop must not contain an empty string, got ('ok', '')"
    assert errors[3] == "column 'temp' (sampling.temperature) must be >= 0, got -1.0"
    assert errors[4] == "column 'n' (sampling.max_new_tokens) must be an integer, got 'ten'"
    assert errors[5] == "column 'k' (sampling.top_k) must be an integer, got 2.5"
    assert errors[6] == "column 'stops' (sampling.stop) must be a string or a list of strings, got a number"
    assert errors[7] == "column 'n' (sampling.max_new_tokens) must be >= 1, got 0"
    assert errors[8] is None and got[8].request.sampling.greedy
    assert all(v.request is None for v in got[:8])


def test_validate_lists_bad_sampling_rows(tmp_path):
    lines = [{"id": "ok", "prompt": "fine", "t": 0.7}, {"id": "cold", "prompt": "x", "t": -2},
             openai_row("long", max_tokens="lots")]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = CliRunner().invoke(app, ["validate", "generic", "--input", str(data), "--json",
                                   "--set", "input.sampling_columns.temperature=t"])
    assert out.exit_code == 1, out.output
    problems = {p["id"]: p["error"] for p in json.loads(out.stdout)["problems"]}
    assert problems == {"cold": "column 't' (sampling.temperature) must be >= 0, got -2.0",
                        "long": "body.max_tokens must be an integer, got 'lots'"}


# --------------------------------------------------------------------------- verification, statistically

V, GAMMA, PER_GROUP = 8, 2, 10_000
RECIPE = SamplingConfig(temperature=1.0)  # the job-wide setting the rows override
GROUPS = {"greedy": SamplingConfig(), "cold-top-k": SamplingConfig(temperature=0.6, top_k=3),
          "hot-top-p": SamplingConfig(temperature=1.5, top_p=0.8)}


def mixed_round(verify_params=None, q_params=None):
    """One speculative round over a batch interleaving the GROUPS' rows (PER_GROUP each), with the
    same target logits and draft logits for every row. Drafts are drawn as the engine draws them
    (BatchSampling.choose: each row's own warping); `verify_params` / `q_params` replace, for the
    verifier only, the parameters p is warped with / the q it is handed (the wrong-warping controls).
    Returns {group: (first emitted tokens, second emitted tokens where reached)} and p per group."""
    g = torch.Generator().manual_seed(1)
    target = torch.randn(GAMMA + 1, V, generator=g) * 1.5  # [gamma + 1, vocab]
    draft = torch.randn(GAMMA, V, generator=g) * 1.5  # [gamma, vocab]: a rather different draft
    names = list(GROUPS) * PER_GROUP
    params = [GROUPS[n] for n in names]
    gens = [None if p.greedy else torch.Generator().manual_seed(i) for i, p in enumerate(params)]
    B = len(names)
    sampling = BatchSampling(params, gens, torch.device("cpu"))
    drafts, probs = [], []
    for i in range(GAMMA):
        token, q = sampling.choose(draft[i].expand(B, V))
        drafts.append(token)
        probs.append(q)
    drafts, q = torch.stack(drafts, 1), torch.stack(probs, 1)  # [B, gamma], [B, gamma, vocab]
    if q_params is not None:
        q = q.clone()
        for name, wrong in q_params.items():
            q[[i for i, n in enumerate(names) if n == name]] = warp(draft, wrong)
    verifier = sampling if verify_params is None else BatchSampling(
        [verify_params.get(n, GROUPS[n]) for n in names], gens, torch.device("cpu"))
    logits = target.expand(B, -1, -1)  # [B, gamma + 1, vocab]
    accepted, nxt = verify_rows(logits, q, drafts, verifier)
    emitted = torch.cat([drafts, torch.zeros(B, 1, dtype=torch.long)], 1)
    emitted.scatter_(1, accepted[:, None], nxt[:, None])  # drafts[:accepted] + [next]
    out = {}
    for name in GROUPS:
        rows = torch.tensor([i for i, n in enumerate(names) if n == name])
        reached = rows[accepted[rows] >= 1]
        out[name] = (emitted[rows, 0], emitted[reached, 1], accepted[rows], nxt[rows], drafts[rows])
    p = {name: warp(target, params) for name, params in GROUPS.items() if not params.greedy}
    return out, p, target


def follows(samples: torch.Tensor, p: torch.Tensor, bound: float) -> bool:
    """Samples follow p: never a token p excludes, and total variation within `bound` (sampling noise
    at 10,000 samples over 8 tokens is ~0.01)."""
    freq = torch.bincount(samples, minlength=V).float() / len(samples)
    return bool((freq[p == 0] == 0).all()) and 0.5 * float((freq - p).abs().sum()) < bound


def test_mixed_batch_verification_follows_each_rows_own_distribution():
    out, p, target = mixed_round()
    first, _, accepted, nxt, drafts = out["greedy"]
    want_accepted, want_next = verify_greedy(target.expand(len(drafts), -1, -1), drafts)
    assert torch.equal(accepted, want_accepted) and torch.equal(nxt, want_next)  # matching, exactly
    assert (first == target[0].argmax()).all()
    for name in ("cold-top-k", "hot-top-p"):
        first, second, accepted, _, _ = out[name]
        assert follows(first, p[name][0], 0.03), name
        assert follows(second, p[name][1], 0.04), name
        assert 0 < float(accepted.float().mean()) < GAMMA  # drafts were both accepted and rejected


def test_wrong_warping_fails_the_same_check():
    # p warped with the recipe's parameters instead of the row's (what a job-wide warp would do).
    out, p, _ = mixed_round(verify_params={"cold-top-k": RECIPE, "hot-top-p": RECIPE})
    for name in ("cold-top-k", "hot-top-p"):
        assert not follows(out[name][0], p[name][0], 0.03), name
    # q warped differently from the distribution the drafts were drawn from (here: the other group's).
    swapped = {"cold-top-k": GROUPS["hot-top-p"], "hot-top-p": GROUPS["cold-top-k"]}
    out, p, _ = mixed_round(q_params=swapped)
    for name in ("cold-top-k", "hot-top-p"):
        assert not follows(out[name][0], p[name][0], 0.03), name


# --------------------------------------------------------------------------- end to end, tiny model

MAX_NEW = 16
COLD = SamplingConfig(temperature=0.7, top_k=2, seed=5, max_new_tokens=12)
HOT = SamplingConfig(temperature=1.3, top_p=0.6, max_new_tokens=MAX_NEW)  # seed: the recipe's + id
WIDE = SamplingConfig(temperature=1.0, top_k=4, top_p=0.9, seed=7, max_new_tokens=10)
GREEDY_SHORT = SamplingConfig(max_new_tokens=7)


def engine_recipe(method: str, size: int = 4):
    return recipe_from_dict({"model": "tiny", "draft": {"method": method, "budget": 24, "sink": 4,
                                                        "linear_dtype": "same"},
                             "spec": {"gamma": 3}, "batch": {"size": size, "prefill_chunk": 32},
                             "sampling": {"max_new_tokens": MAX_NEW, "seed": 11}})


def run(engine, rows):
    """rows: (id, prompt, sampling or None, own_seed) -> {id: Result}."""
    requests = [Request(i, row_id, prompt, (s.max_new_tokens if s else MAX_NEW), sampling=s, own_seed=own)
                for i, (row_id, prompt, s, own) in enumerate(rows)]
    return {r.request.id: r for r in engine.run(requests)}


@pytest.fixture(scope="module")
def setup():
    loaded, reference = make_tiny(3)
    loaded.tokenizer = TagTokenizer()
    loaded.eos_token_ids = (-1,)  # no EOS: rows end at their own max_new_tokens or stop string
    prompts = random_prompts(8, 20, 90, seed=4)
    plain = run(build_engine(engine_recipe("none"), loaded), [(i, p, None, False) for i, p in enumerate(prompts)])
    return loaded, reference, prompts, {i: plain[i].token_ids for i in plain}


def mixed_rows(prompts, plain, stop_row_2=None):
    """Greedy and sampled rows of different warpings, lengths and stops in one job."""
    token = plain[2][5]
    k = plain[2].index(token)  # the stop string's first match
    stop = dataclasses.replace(SamplingConfig(), stop=(f"<{token}>",))
    return [(0, prompts[0], None, False), (1, prompts[1], GREEDY_SHORT, False), (2, prompts[2], stop, False),
            ("cold", prompts[3], COLD, True), ("hot", prompts[4], stop_row_2 or HOT, False),
            ("wide", prompts[5], WIDE, True), (6, prompts[6], None, False),
            ("cold-twin", prompts[3], COLD, True)], k


def in_support(reference, prompt, tokens, params) -> bool:
    """Every emitted token has positive probability under `params`' warping of the target's logits."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]  # [n, vocab]
    probs = warp(logits, params)
    return bool((probs.gather(1, torch.tensor(tokens)[:, None]) > 0).all())


@pytest.mark.parametrize("method", ["none", "streamingllm"])
def test_mixed_batch_end_to_end(setup, method):
    loaded, reference, prompts, plain = setup
    rows, k = mixed_rows(prompts, plain)
    engine = build_engine(engine_recipe(method), loaded)
    got = run(engine, rows)
    prompt_of = {row[0]: row[1] for row in rows}
    # Greedy rows: their plain greedy output, cut at their own max_new_tokens / stop string.
    for i in (0, 6):
        assert got[i].token_ids == plain[i] and got[i].finish_reason == "length"
    assert got[1].token_ids == plain[1][:7] and got[1].finish_reason == "length"
    assert got[2].token_ids == plain[2][:k + 1] and got[2].finish_reason == "stop"
    assert got[2].text == TagTokenizer().decode(plain[2][:k])
    # Sampled rows: their own length, and every token inside their own warped support.
    for row_id, params in (("cold", COLD), ("hot", HOT), ("wide", WIDE)):
        result = got[row_id]
        assert len(result.token_ids) == params.max_new_tokens and result.finish_reason == "length"
        assert in_support(reference, prompt_of[row_id], result.token_ids, params), row_id
    # The check bites: the wide row's tokens leave the cold row's top-2 support somewhere.
    assert not in_support(reference, prompts[5], got["wide"].token_ids, COLD)
    # A row's own seed alone seeds it (as in vLLM): same seed, prompt and parameters, same text.
    assert got["cold-twin"].token_ids == got["cold"].token_ids
    assert got["hot"].token_ids != plain[4]  # sampled, not greedy
    if method != "none":
        assert engine.stats.accepted_tokens > 0 and engine.stats.rejections > 0


@pytest.mark.parametrize("method", ["none", "streamingllm"])
def test_a_sampled_rows_output_depends_only_on_its_id_and_seed(setup, method):
    loaded, _, prompts, plain = setup
    rows, _ = mixed_rows(prompts, plain)
    together = run(build_engine(engine_recipe(method), loaded), rows)
    # Alone in the engine (one slot), or beside other rows (other prompts and parameters, another
    # batch size): the same tokens.
    sampled = rows[3:6]
    alone = run(build_engine(engine_recipe(method, size=1), loaded), sampled)
    others = [(10 + i, p, dataclasses.replace(HOT, seed=i), True) for i, p in enumerate(prompts[5:])]
    beside = run(build_engine(engine_recipe(method, size=3), loaded), others[:1] + sampled[::-1] + others[1:])
    for row_id, _, _, _ in sampled:
        assert alone[row_id].token_ids == beside[row_id].token_ids == together[row_id].token_ids, row_id
    # A sampled row's stop string cuts it at its first match, leaving the tokens before unchanged.
    hot = together["hot"].token_ids
    k = hot.index(hot[4])
    stopped_rows, _ = mixed_rows(prompts, plain, stop_row_2=dataclasses.replace(HOT, stop=(f"<{hot[4]}>",)))
    stopped = run(build_engine(engine_recipe(method), loaded), stopped_rows)["hot"]
    assert stopped.token_ids == hot[:k + 1] and stopped.finish_reason == "stop"
    assert stopped.text == TagTokenizer().decode(hot[:k])
