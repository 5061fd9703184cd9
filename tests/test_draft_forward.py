"""The lean draft forward computes what transformers' forward computes for the same draft step.

Reference: the model's own transformers forward through the engine's attention, over the same
compressed view and cache. Same weights (fp32): the same logits and the same K/V written to the
cache. Lower-precision GEMMs: the same as transformers' forward with `DraftGemms` on (the fused
q/k/v and gate/up copies are the separate ones side by side). The lossless end-to-end property
with the lean draft is in test_speculative.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny, random_prompts
from engine.core import kernels as cpu_kernels
from engine.spec.draft import forward as draft_forward
from engine.core.attention import ForwardBatch
from engine.config.schema import DraftConfig
from engine.spec.draft.forward import LeanDraft, supports
from engine.spec.draft.gemms import INT8, DraftGemms, int8_supported
from engine.spec.compressors.guided import Guided
from engine.spec.compressors.pqcache import PQCache
from engine.spec.compressors.snapkv import SnapKV
from engine.spec.compressors.streamingllm import StreamingLLM
from engine.models.loading import LoadedModel
from engine.core.runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the compiled CPU attention kernel")


def qwen2_tiny() -> LoadedModel:
    """A Qwen2-style model: q/k/v projections with biases (fused with their biases here)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="magicdec").eval().requires_grad_(False)
    with torch.no_grad():
        for layer in model.model.layers:  # random (not zero) biases, so fusing them is checked
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.3)
    return LoadedModel(name="qwen2-tiny", model=model, tokenizer=None, eos_token_ids=(2,), max_context=512,
                       device=torch.device("cpu"), dtype=torch.float32)


def prefilled(loaded: LoadedModel, method: str, lengths=(90, 140, 60), compact: bool = False):
    """A runner whose slots hold random prompts of the given lengths, and a compressor over them
    (with its compact store if asked)."""
    runner = ModelRunner(loaded, slots=len(lengths), capacity=200)
    prompts = random_prompts(len(lengths), max(lengths), max(lengths), seed=7)
    prompts = [p[:n] for p, n in zip(prompts, lengths)]
    config = DraftConfig(method=method, budget=48, sink=4, window=8, subspaces=4, bits=4)
    compressor = {"streamingllm": StreamingLLM, "pqcache": PQCache, "snapkv": SnapKV, "guided": Guided}[method](
        config, runner.cache, runner.heads)
    if compact:
        assert compressor.enable_compact(extra=3, copy_committed=True)
    for slot, prompt in enumerate(prompts):
        runner.forward(torch.tensor([prompt]), ForwardBatch(runner.cache, [slot], [0], len(prompt)), last_only=True)
        runner.cache.set_length(slot, len(prompt))
        observed = None
        if method in ("snapkv", "guided"):  # the observation window's queries: any will do here
            observed = torch.randn(runner.layers, runner.heads, config.window, runner.head_dim,
                                   generator=torch.Generator().manual_seed(slot))
        compressor.prefill_done(slot, len(prompt), observed)
    return runner, compressor, list(lengths)


def draft_batch(runner, compressor, lengths, width: int) -> ForwardBatch:
    slots = list(range(len(lengths)))
    starts = [n - width + 1 for n in lengths]  # width 2: a separate draft re-reads its newest position
    ends = [s + width for s in starts]
    return ForwardBatch(runner.cache, slots, starts, width, view=compressor.view(slots, ends))


def written(runner, batch: ForwardBatch) -> torch.Tensor:
    """The K and V the forward wrote at the batch's new positions, every layer: [2, B * T, layers, kv_heads, D]."""
    k = runner.cache.k[:, batch.write_slots, :, batch.write_positions]
    v = runner.cache.v[:, batch.write_slots, :, batch.write_positions]
    return torch.stack([k, v]).clone()


@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["streamingllm", "pqcache"])
@pytest.mark.parametrize("width", [1, 2])
def test_lean_forward_equals_transformers_forward(model, method, width):
    loaded = make_tiny(4)[0] if model == "llama" else qwen2_tiny()
    assert supports(loaded.model, torch.float32, loaded.device)
    runner, compressor, lengths = prefilled(loaded, method)
    tokens = torch.randint(3, 500, (len(lengths), width), generator=torch.Generator().manual_seed(1))  # [B, T]
    batch = draft_batch(runner, compressor, lengths, width)
    want = runner.module_forward(tokens, batch, last_only=True)[:, -1]  # [B, vocab]
    want_kv = written(runner, batch)
    for store in (runner.cache.k, runner.cache.v):  # the lean forward must write them again
        store[:, batch.write_slots, :, batch.write_positions] = 0.0
    got = LeanDraft(loaded.model, None)(tokens, draft_batch(runner, compressor, lengths, width))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32, summed in another order
    torch.testing.assert_close(written(runner, batch), want_kv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width", [1, 2])
def test_lean_forward_over_the_whole_cache_returns_the_mass_transformers_forward_does(width):
    """No view (a guided separate draft's first step of a round): the whole cache, with its attention mass."""
    loaded = make_tiny(4)[0]
    runner, compressor, lengths = prefilled(loaded, "guided")
    tokens = torch.randint(3, 500, (len(lengths), width), generator=torch.Generator().manual_seed(1))  # [B, T]
    slots, starts = list(range(len(lengths))), [n - width + 1 for n in lengths]

    def batch():
        return ForwardBatch(runner.cache, slots, starts, width,
                            mass=compressor.new_mass(len(lengths), max(lengths) + 1))

    reference = batch()
    want = runner.module_forward(tokens, reference, last_only=True)[:, -1]  # [B, vocab]
    lean = batch()
    got = LeanDraft(loaded.model, None)(tokens, lean)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lean.mass, reference.mass, rtol=1e-4, atol=1e-5)
    # [layers, B, kv_heads, N]: every query's probability lands somewhere.
    torch.testing.assert_close(lean.mass.sum(-1), torch.full(lean.mass.shape[:3], float(compressor.group * width)))


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "guided"])
@pytest.mark.parametrize("width", [1, 2])
def test_lean_forward_over_the_compact_store_equals_transformers_over_the_cache(method, width):
    """The same view, read from the draft's bfloat16 store instead of the float32 cache."""
    loaded = make_tiny(4)[0]
    runner, compressor, lengths = prefilled(loaded, method, compact=True)
    tokens = torch.randint(3, 500, (len(lengths), width), generator=torch.Generator().manual_seed(1))  # [B, T]
    compact_batch = draft_batch(runner, compressor, lengths, width)
    assert compact_batch.view.compact is compressor.compact
    got = LeanDraft(loaded.model, None)(tokens, compact_batch)
    # The reference: transformers over the full-cache view, the cached K/V rounded to bfloat16 as stored.
    for store in (runner.cache.k, runner.cache.v):
        store.copy_(store.bfloat16().float())
    batch = draft_batch(runner, compressor, lengths, width)
    batch.view.compact = None  # the transformers path reads the full cache
    want = runner.module_forward(tokens, batch, last_only=True)[:, -1]  # [B, vocab]
    want_kv = written(runner, batch)
    # Equal up to the new tokens' own K/V, stored in bfloat16 here: the same choices.
    torch.testing.assert_close(got, want, rtol=0, atol=0.01 * want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).all()
    store = compressor.compact  # the new tokens' K/V went into the store, not the cache
    rows = store.rows_for(batch.write_positions, batch.write_slots)  # [B * T]
    stored = store.k[:, batch.write_slots, :, rows]  # [B * T, layers, kv_heads, D]
    torch.testing.assert_close(stored.float(), want_kv[0], rtol=0.01, atol=0.01)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, INT8], ids=["bfloat16", "int8"])
def test_lean_forward_with_low_precision_gemms_equals_transformers_with_draft_gemms(dtype, model):
    if dtype == INT8 and not int8_supported():
        pytest.skip("this torch build has no x86/fbgemm quantized engine")
    loaded = make_tiny(6)[0] if model == "llama" else qwen2_tiny()
    lean = LeanDraft(loaded.model, dtype)
    runner, compressor, lengths = prefilled(loaded, "streamingllm")
    tokens = torch.randint(3, 500, (len(lengths), 1), generator=torch.Generator().manual_seed(2))
    gemms = DraftGemms(loaded.model, dtype)  # transformers' modules, with low-precision linear layers
    want = runner.with_module(gemms.module).forward(tokens, draft_batch(runner, compressor, lengths, 1),
                                                    last_only=True)[:, -1]
    exact = runner.module_forward(tokens, draft_batch(runner, compressor, lengths, 1), last_only=True)[:, -1]
    got = lean(tokens, draft_batch(runner, compressor, lengths, 1))
    # Equal up to the low dtype's rounding: the norms are summed in another order, and an input one
    # float32 ulp away can round to a neighbouring bfloat16 (or int8 step).
    torch.testing.assert_close(got, want, rtol=0, atol=0.01 * want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert not torch.allclose(got, exact, rtol=1e-5, atol=1e-5)  # the low-precision copies were used
