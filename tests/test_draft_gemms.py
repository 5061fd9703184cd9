"""The draft's lower-precision GEMMs: the target's modules compute exactly as before and are not
patched; the draft's own module tree computes each linear layer in the low dtype (bfloat16: F.linear,
or the kernel's bfloat16 dot products where it has them; fbgemm's int8: held to a brute-force
quantised product; int8 from GGUF panels: tests/test_int8_panels.py); `auto` picks int8 where the CPU
has VNNI, else bf16 where it has native bf16 dot products, else nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny
from engine.spec.draft import gemms as draft_gemms
from engine.spec.draft.gemms import DraftGemms, resolve_linear_dtype
from engine.errors import JobError


def test_the_target_model_is_bit_for_bit_unchanged_and_unpatched():
    _, model = make_tiny(5)  # transformers' own model (sdpa attention)
    ids = torch.randint(3, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with torch.no_grad():
        before = model(input_ids=ids).logits
        gemms = DraftGemms.for_model(model, torch.bfloat16)
        after = model(input_ids=ids).logits
        drafted = gemms.module(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert gemms.layers == len(linears) > 0
    assert all("forward" not in m.__dict__ for m in linears), "the target's nn.Linear modules are not patched"
    assert [m for m in model.modules() if type(m) is torch.nn.Linear] == linears
    assert torch.equal(before, after) and torch.equal(before, again)
    assert not torch.equal(before, drafted)  # the bf16 copies were really used...
    # ...and compute the same function, to bf16's precision: small errors, the same argmax almost everywhere
    assert (drafted - before).abs().max() < 0.05 * before.abs().max()
    assert (drafted.argmax(-1) == before.argmax(-1)).float().mean() > 0.9


def test_each_draft_linear_computes_in_the_low_dtype():
    layer = torch.nn.Linear(48, 24)
    model = torch.nn.Sequential(layer)
    x = torch.randn(5, 48)
    gemms = DraftGemms.for_model(model, torch.bfloat16)
    with torch.no_grad():
        got = gemms.module(x)
    want = F.linear(x.bfloat16(), layer.weight.detach().bfloat16(), layer.bias.detach().bfloat16()).float()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert DraftGemms.for_model(model, torch.bfloat16) is gemms  # shared per model


def test_a_bfloat16_draft_gemm_takes_the_cpus_bfloat16_dot_products_where_the_kernel_has_them():
    """Where the kernel multiplies bfloat16 (`cpu_bf16_linear.cpp`), a draft's bfloat16 copy of a float32
    weight is its panels: the kernel's bits for the rounded operands, within one bfloat16 rounding of
    their float64 product; weights it does not take (N not a multiple of 16) keep F.linear."""
    from engine.core import linear as engine_linear
    kernel = engine_linear.bf16_kernel()
    if kernel is None:
        pytest.skip("no bfloat16 dot products in the kernel here (a CPU without AVX512-BF16, or with AMX "
                    "tiles, where torch's bfloat16 GEMM has them)")
    layer = torch.nn.Linear(96, 48)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = draft_gemms.make_linear(layer.weight, layer.bias, torch.bfloat16)(x)
        xb, wb = x.bfloat16(), layer.weight.bfloat16()
        kernel_bits = kernel.bf16_linear_cat(xb, [kernel.bf16_panels(wb)], [layer.bias.float()]).float()
        want = xb.double() @ wb.double().T + layer.bias.double()
    assert got.dtype == torch.float32 and torch.equal(got, kernel_bits)
    assert ((got.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-5).all()
    odd = torch.nn.Linear(96, 24)  # 24 outputs: not whole panels
    with torch.no_grad():
        kept = draft_gemms.make_linear(odd.weight, odd.bias, torch.bfloat16)(x)
    assert torch.equal(kept, F.linear(x.bfloat16(), odd.weight.bfloat16(), odd.bias.bfloat16()).float())


def test_auto_uses_int8_or_bf16_only_for_float32_on_cpus_with_native_dot_products(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(draft_gemms, "cpu_flags", lambda: "flags : fpu sse2 avx512f avx512_bf16 avx512_vnni")
    assert resolve_linear_dtype("auto", torch.float32, cpu) == (draft_gemms.INT8 if draft_gemms.int8_supported()
                                                               else torch.bfloat16)
    monkeypatch.setattr(draft_gemms, "cpu_flags", lambda: "flags : fpu sse2 avx512f avx512_bf16")
    assert resolve_linear_dtype("auto", torch.float32, cpu) == torch.bfloat16
    assert resolve_linear_dtype("auto", torch.bfloat16, cpu) is None
    assert resolve_linear_dtype("auto", torch.float32, cuda) is None
    monkeypatch.setattr(draft_gemms, "cpu_flags", lambda: "flags : fpu sse2 avx2")
    assert resolve_linear_dtype("auto", torch.float32, cpu) is None
    assert resolve_linear_dtype("same", torch.float32, cpu) is None
    assert resolve_linear_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve_linear_dtype("bfloat16", torch.bfloat16, cuda) is None  # already the model's dtype
    with pytest.raises(JobError, match="draft.linear_dtype: int8"):
        resolve_linear_dtype("int8", torch.float32, cuda)


def brute_force_int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The int8 rule written out: weights symmetric per output channel, the input asymmetric uint8 per
    call (scale and zero point as torch chooses them), integer products, one rescale."""
    w_scale = weight.abs().amax(dim=1) / 127  # [out]
    w_q = torch.round(weight / w_scale[:, None]).clamp(-128, 127)  # [out, in]
    reduce_range = draft_gemms.int8_reduce_range()  # 7-bit activations on CPUs without VNNI
    x_scale, x_zero = torch._choose_qparams_per_tensor(x, reduce_range)
    x_q = torch.clamp(torch.round(x / x_scale) + x_zero, 0, 127 if reduce_range else 255)  # [M, in]
    acc = (x_q - x_zero).double() @ w_q.double().T  # [M, out], exact integers
    return (acc * x_scale * w_scale.double()[None, :]).float() + bias


def test_int8_linear_follows_the_quantisation_rule():
    if not draft_gemms.int8_supported():
        pytest.skip("this torch build has no x86/fbgemm quantized engine")
    layer = torch.nn.Linear(96, 40)
    x = torch.randn(7, 96)
    with torch.no_grad():
        got = draft_gemms.make_linear(layer.weight, layer.bias, draft_gemms.INT8)(x)
        want = brute_force_int8_linear(x, layer.weight, layer.bias)
        exact = layer(x)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    assert not torch.allclose(got, exact, rtol=1e-5, atol=1e-5)  # quantised for real, yet close to fp32
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()
