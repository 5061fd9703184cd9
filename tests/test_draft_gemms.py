"""The draft's lower-precision GEMMs: off, the model computes exactly as before; on, each linear layer
computes F.linear in the low dtype; `auto` picks bf16 only where the CPU has native bf16 dot products."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conftest import make_tiny
from engine import draft_gemms
from engine.draft_gemms import DraftGemms, resolve_linear_dtype


def test_outside_active_the_model_is_bit_for_bit_unchanged():
    _, model = make_tiny(5)  # transformers' own model (sdpa attention)
    ids = torch.randint(3, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        gemms = DraftGemms.for_model(model, torch.bfloat16)
        after = model(input_ids=ids).logits
        with gemms.active():
            drafted = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert gemms.layers > 0
    assert torch.equal(before, after) and torch.equal(before, again)
    assert not torch.equal(before, drafted)  # the bf16 copies were really used...
    # ...and compute the same function, to bf16's precision: small errors, the same argmax almost everywhere
    assert (drafted - before).abs().max() < 0.05 * before.abs().max()
    assert (drafted.argmax(-1) == before.argmax(-1)).float().mean() > 0.9


def test_each_linear_computes_in_the_low_dtype_when_active():
    layer = torch.nn.Linear(48, 24)
    model = torch.nn.Sequential(layer)
    x = torch.randn(5, 48)
    gemms = DraftGemms.for_model(model, torch.bfloat16)
    with torch.no_grad(), gemms.active():
        got = model(x)
    want = F.linear(x.bfloat16(), layer.weight.detach().bfloat16(), layer.bias.detach().bfloat16()).float()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert DraftGemms.for_model(model, torch.bfloat16) is gemms  # shared per model


def test_auto_uses_bf16_only_for_float32_on_cpus_with_native_bf16(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(draft_gemms, "cpu_flags", lambda: "flags : fpu sse2 avx512f avx512_bf16")
    assert resolve_linear_dtype("auto", torch.float32, cpu) == torch.bfloat16
    assert resolve_linear_dtype("auto", torch.bfloat16, cpu) is None
    assert resolve_linear_dtype("auto", torch.float32, cuda) is None
    monkeypatch.setattr(draft_gemms, "cpu_flags", lambda: "flags : fpu sse2 avx2")
    assert resolve_linear_dtype("auto", torch.float32, cpu) is None
    assert resolve_linear_dtype("same", torch.float32, cpu) is None
    assert resolve_linear_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve_linear_dtype("bfloat16", torch.bfloat16, cuda) is None  # already the model's dtype
