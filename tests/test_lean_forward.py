"""The target's decode and verification forwards, and its packed prefill chunks, through the lean stack
compute what transformers' modules compute (engine.core.lean_forward, ModelRunner.forward / prefill).

Reference: `ModelRunner.module_forward`, the model's own transformers forward through the engine's
attention, over the same cache: the same logits (float32, summed in another order: within 1e-4), the
same K/V written, the same attention mass for the guided draft, with rows of different lengths and
rows reading a shared prefix once. A projection of several weights side by side gives each output
the bits the weight alone gives it, without copying the weights. The whole engine against transformers' `generate` is in
test_engine.py and test_speculative.py, which run this path wherever it applies.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny, random_prompts
from engine.core import kernels as cpu_kernels
from engine.core import lean_forward
from engine.core.attention import ForwardBatch
from engine.core.prefill import QueryWindow
from engine.core.prefill_attention import PrefillBatch, Segment
from engine.core.lean_forward import side_by_side, supports
from engine.core.linear import linear, linear_cat
from engine.core.runner import LEAN_SWITCH_ENV, ModelRunner
from test_draft_forward import qwen2_tiny, written

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the compiled CPU kernels")

LENGTHS = (90, 140, 61)


def prefilled_runner(loaded, lengths=LENGTHS, shared: int = 0) -> ModelRunner:
    """A runner whose slots hold random prompts of the given lengths (through transformers' modules);
    with `shared`, every slot's first `shared` positions hold slot 0's K/V and say so (as the prefix
    store leaves them), so decoding reads them once for the group."""
    runner = ModelRunner(loaded, slots=len(lengths), capacity=200)
    prompts = random_prompts(len(lengths), max(lengths), max(lengths), seed=7)
    for slot, (prompt, n) in enumerate(zip(prompts, lengths)):
        if shared and slot > 0:
            prompt = prompts[0][:shared] + prompt[shared:]
        prompt = prompt[:n]
        runner.module_forward(torch.tensor([prompt]), ForwardBatch(runner.cache, [slot], [0], n), last_only=True)
        runner.cache.set_length(slot, n)
    if shared:
        block = 32
        for slot in range(len(lengths)):
            runner.cache.set_origin(slot, tuple(range(shared // block)), block)
    return runner


def both_forwards(runner, tokens, make_batch, last_only):
    """(lean logits, lean batch, reference logits, reference batch, lean K/V, reference K/V)."""
    reference = make_batch()
    want = runner.module_forward(tokens, reference, last_only=last_only)
    want_kv = written(runner, reference)
    for store in (runner.cache.k, runner.cache.v):  # the lean forward must write them again
        store[:, reference.write_slots, :, reference.write_positions] = 0.0
    lean = make_batch()
    got = runner.forward(tokens, lean, last_only=last_only)
    return got, lean, want, reference, written(runner, lean), want_kv


@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("width,last_only", [(1, True), (1, False), (4, False)])
def test_decode_and_verify_forwards_equal_transformers_modules(model, width, last_only):
    loaded = make_tiny(4)[0] if model == "llama" else qwen2_tiny()
    runner = prefilled_runner(loaded)
    assert runner.lean_stack() is not None
    tokens = torch.randint(3, 500, (len(LENGTHS), width), generator=torch.Generator().manual_seed(1))  # [B, T]
    slots = list(range(len(LENGTHS)))
    got, _, want, _, got_kv, want_kv = both_forwards(
        runner, tokens, lambda: ForwardBatch(runner.cache, slots, list(LENGTHS), width), last_only)
    assert got.shape == want.shape == (len(LENGTHS), 1 if last_only else width, loaded.model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_packed_prefill_equals_transformers_modules(model):
    """Three rows' segments packed in one prefill forward (40 tokens after 90 cached ones, 30 after 140
    with SnapKV's observation window over the last 16, one token after 61): the same logits of each
    segment's last token, K/V written, window queries and window attention mass through both."""
    loaded = make_tiny(4)[0] if model == "llama" else qwen2_tiny()
    runner = prefilled_runner(loaded)
    config = loaded.model.config
    tokens = torch.randint(3, 500, (71,), generator=torch.Generator().manual_seed(2))  # [N]

    def batch():
        window = QueryWindow(runner.layers, runner.heads, runner.kv_heads, 16, runner.head_dim, 154, runner.device,
                             torch.float32)
        return PrefillBatch(runner.cache, [Segment(0, 90, 40), Segment(1, 140, 30, window), Segment(2, 61, 1)])

    reference = batch()
    want = runner.module_prefill(tokens, reference)
    want_kv = written(runner, reference)
    for store in (runner.cache.k, runner.cache.v):  # the lean prefill must write them again
        store[:, reference.write_slots, :, reference.write_positions] = 0.0
    lean = batch()
    got = runner.prefill(tokens, lean)
    assert runner.lean_stack() is not None
    assert got.shape == want.shape == (3, config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the second layer's K/V come from the first layer's outputs, summed in another order
    torch.testing.assert_close(written(runner, lean), want_kv, rtol=1e-4, atol=1e-4)
    got_window, want_window = lean.segments[1].observer, reference.segments[1].observer
    torch.testing.assert_close(got_window.queries, want_window.queries, rtol=1e-5, atol=1e-5)
    assert got_window.mass is not None and want_window.mass is not None
    torch.testing.assert_close(got_window.mass, want_window.mass, rtol=1e-5, atol=1e-5)


def test_verification_returns_the_attention_mass_transformers_modules_do():
    """The guided draft's scores come from the target's verification forward: the same through both."""
    loaded = make_tiny(4)[0]
    runner = prefilled_runner(loaded)
    width, slots = 3, list(range(len(LENGTHS)))
    tokens = torch.randint(3, 500, (len(LENGTHS), width), generator=torch.Generator().manual_seed(2))

    def batch():
        mass = torch.zeros(runner.layers, len(LENGTHS), runner.kv_heads, max(LENGTHS) + width)
        return ForwardBatch(runner.cache, slots, list(LENGTHS), width, mass=mass)

    got, lean, want, reference, _, _ = both_forwards(runner, tokens, batch, False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lean.mass, reference.mass, rtol=1e-4, atol=1e-5)
    group = runner.heads // runner.kv_heads  # every query's probability lands somewhere: [layers, B, kv_heads]
    torch.testing.assert_close(lean.mass.sum(-1), torch.full(lean.mass.shape[:3], float(group * width)))


def test_rows_reading_a_shared_prefix_once_get_what_transformers_modules_give():
    loaded = make_tiny(4)[0]
    lengths = (90, 140, 75)
    runner = prefilled_runner(loaded, lengths, shared=64)
    width, slots = 2, list(range(len(lengths)))
    tokens = torch.randint(3, 500, (len(lengths), width), generator=torch.Generator().manual_seed(3))
    got, lean, want, _, got_kv, want_kv = both_forwards(
        runner, tokens, lambda: ForwardBatch(runner.cache, slots, list(lengths), width), False)
    if cpu_kernels.load().shares_prefix_reads(runner.head_dim):
        assert lean.prefix_groups() is not None  # the shared reads were taken
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 13, 16, 129])  # 129: past the kernel's limit, torch's GEMMs
def test_projections_side_by_side_are_each_weight_alone_without_a_copy(rows):
    loaded = qwen2_tiny()  # q/k/v with biases
    attn = loaded.model.model.layers[0].self_attn
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    weights = [m.weight.data_ptr() for m in projections]
    x = torch.randn(rows, loaded.model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    separate = torch.cat([linear(x, m.weight, m.bias) for m in projections], dim=-1)
    got = side_by_side(projections)(x)
    assert torch.equal(got, separate)  # the same bits, whatever the other weights beside it
    assert [m.weight.data_ptr() for m in projections] == weights  # the model's own tensors, untouched
    odd = [torch.randn(n, 40) for n in (7, 1, 5)]  # widths that are no multiple of the register tile
    bias = [torch.randn(7), None, torch.randn(5)]
    x = torch.randn(rows, 40)
    want = torch.cat([x @ w.T + (b if b is not None else 0) for w, b in zip(odd, bias)], dim=-1)
    torch.testing.assert_close(linear_cat(x, odd, bias), want, rtol=1e-5, atol=1e-5)


def test_supports_only_what_it_computes(monkeypatch):
    loaded = make_tiny(4)[0]
    cpu = torch.device("cpu")
    assert supports(loaded.model, torch.float32, cpu)
    assert not supports(loaded.model, torch.bfloat16, cpu)  # the kernel reads float32 caches
    assert not supports(loaded.model, torch.float32, torch.device("cuda"))
    model = copy.deepcopy(loaded.model)
    model.config.hidden_act = "gelu"
    assert not supports(model, torch.float32, cpu)
    model = copy.deepcopy(loaded.model)
    model.model.layers[1].mlp.down_proj = torch.nn.Identity()  # e.g. a tensor-parallel replacement
    assert not supports(model, torch.float32, cpu)
    monkeypatch.setattr(lean_forward.cpu_kernels, "load", lambda: None)
    assert not supports(loaded.model, torch.float32, cpu)


def test_the_switch_and_unsupported_runners_keep_transformers_modules(monkeypatch):
    loaded = make_tiny(4)[0]
    runner = ModelRunner(loaded, slots=1, capacity=64)
    assert runner.decode_path().startswith("lean stack")
    monkeypatch.setenv(LEAN_SWITCH_ENV, "0")
    assert runner.lean_stack() is None and runner.decode_path() == f"transformers modules ({LEAN_SWITCH_ENV}=0)"
    monkeypatch.delenv(LEAN_SWITCH_ENV)
    model = copy.deepcopy(loaded.model)
    model.config.hidden_act = "gelu"
    twin = runner.with_module(model)
    assert twin.lean_stack() is None and twin.decode_path() == "transformers modules"
