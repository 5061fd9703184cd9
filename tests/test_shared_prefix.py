"""Grouping a forward's rows by the prefix K/V they hold alike (engine.core.shared_prefix), held to a
brute-force rule over the rows' origins; and, end to end, that decoding reads a shared prefix once
per group without changing a token."""

from __future__ import annotations

import random

import pytest

from engine.core import kernels as cpu_kernels
from engine.core.shared_prefix import KERNEL_BLOCK, group_rows
from engine.spec.decoder import build_engine
from test_prefix_reuse import documents_and_questions, generate, recipe


def brute_force_groups(origins, block, starts):
    """Each row's deepest prefix of serials that another row also starts with; rows with the same
    such prefix form a group reading min(depth x block, its rows' starts) rounded down to 64."""
    deepest = []
    for i, o in enumerate(origins):
        best = 0
        for j, p in enumerate(origins):
            if i != j:
                n = 0
                while n < min(len(o), len(p)) and o[n] == p[n]:
                    n += 1
                best = max(best, n)
        deepest.append(tuple(o[:best]))
    groups = {}
    for i, prefix in enumerate(deepest):
        if prefix:
            groups.setdefault(prefix, []).append(i)
    out = {}
    for prefix, rows in groups.items():
        length = min(len(prefix) * block, min(starts[r] for r in rows)) // KERNEL_BLOCK * KERNEL_BLOCK
        if len(rows) >= 2 and length > 0:
            out[frozenset(rows)] = length
    return out


def as_groups(result):
    members, offsets, shared = result.members.tolist(), result.offsets.tolist(), result.shared.tolist()
    return {frozenset(members[offsets[g]:offsets[g + 1]]): shared[g] for g in range(len(shared)) if shared[g]}


@pytest.mark.parametrize("seed", range(40))
def test_rows_are_grouped_by_their_deepest_shared_origin(seed):
    rng = random.Random(seed)
    block = rng.choice([16, 32, 64])
    documents = [[rng.randrange(1, 10 ** 6) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 4))]
    origins = []
    for _ in range(rng.randint(2, 10)):
        if rng.random() < 0.2:
            origins.append(())  # a row that reused nothing
            continue
        doc = rng.choice(documents)
        own = doc[: rng.randint(1, len(doc))] if rng.random() < 0.3 else list(doc)  # a shorter match
        origins.append(tuple(own + [rng.randrange(10 ** 6, 10 ** 7) for _ in range(rng.randint(0, 2))]))
    starts = [len(o) * block + rng.randint(0, 40) for o in origins]
    result = group_rows(origins, block, starts)
    expected = brute_force_groups(origins, block, starts)
    if not expected:
        assert result is None
        return
    assert as_groups(result) == expected
    assert sorted(result.members.tolist()) == list(range(len(origins)))  # every row once
    assert result.positions_saved == sum((len(rows) - 1) * n for rows, n in expected.items())


def test_rows_whose_hash_chains_collide_are_not_grouped_by_the_hash_alone():
    """Only equal serials make equal bits: two rows are grouped on their longest equal serial prefix."""
    origins = [(1, 2, 3), (1, 2, 4), (5,)]
    result = group_rows(origins, 64, [500, 500, 500])
    assert as_groups(result) == {frozenset({0, 1}): 128}


def needs_group_task(head_dim=16):
    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip("no C++ compiler here: the fused CPU kernel (and its shared reads) cannot be built")
    if not kernel.shares_prefix_reads(head_dim):
        pytest.skip(f"this CPU's kernel has no vector task for head size {head_dim}, so no group task "
                    "that reads a prefix once")


@pytest.mark.parametrize("method", ["none", "streamingllm", "snapkv"])
def test_decoding_reads_a_shared_prefix_once_and_writes_the_same_tokens(tiny_pair, method, monkeypatch):
    needs_group_task()
    loaded, _ = tiny_pair
    prompts = documents_and_questions(seed=11, docs=2, questions=5)
    on = build_engine(recipe(method, reuse=True, size=4), loaded)
    tokens = generate(on, prompts)
    cache = on.decoder.prefill_targets[0].runner.cache
    assert cache.positions_shared > 0.2 * cache.positions_read  # rows of one document read it once
    monkeypatch.setenv("MAGICDEC_SHARED_READS", "0")
    separate = build_engine(recipe(method, reuse=True, size=4), loaded)
    assert generate(separate, prompts) == tokens
    assert separate.decoder.prefill_targets[0].runner.cache.positions_shared == 0
    off = build_engine(recipe(method, reuse=False, size=4), loaded)
    assert generate(off, prompts) == tokens


def test_the_job_report_says_how_much_decoding_read_once(tmp_path):
    """Through `run_job` on the real model: rows sharing a document, the report's `prefix_reuse`
    counts the shared reads and the end-of-run table names them."""
    import inspect
    import json
    import textwrap

    from engine.job.options import JobOptions
    from engine.job.report_render import summary_rows
    from engine.job.run import run_job

    needs_group_task(64)
    document = inspect.getsource(textwrap)[:1500]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": f"{document}\n# Question {i}: what does line {i} do?"})
                            + "\n" for i in range(4)))
    overrides = ("batch.size=4", "batch.max_len=1024", "sampling.max_new_tokens=6", "draft.method=none")
    run_job(JobOptions(recipe="generic", input=str(data), output=str(tmp_path / "out.jsonl"), overrides=overrides))
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    reuse = report["prefix_reuse"]
    assert reuse["tokens_reused"] > 0 and reuse["decode_positions_shared"] > 0
    assert 0 < reuse["decode_reads_shared"] == reuse["decode_positions_shared"] / reuse["decode_positions_read"] < 1
    assert any("once per group" in value for _, value in summary_rows(report))
