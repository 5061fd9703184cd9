"""The few-row linear map (`small_linear` in the fused CPU kernel) and the engine's linear layers.

References: a float64 matmul for the values, the same rows computed one at a time for batch
independence, `F.linear` for everything outside the engine's forwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny
from engine.core import linear as engine_linear
from engine.core.kernels import load as load_kernels


@pytest.fixture(scope="module")
def kernel():
    module = load_kernels()
    if module is None or not module.small_linear_available():
        pytest.skip("the fused CPU kernel has no small_linear here (needs a compiler and AVX2 + FMA or AVX-512)")
    return module


def operands(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 13, 64])
@pytest.mark.parametrize("K,N", [(64, 48), (50, 37), (576, 195), (8, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_matches_a_float64_matmul(kernel, M, K, N, with_bias):
    """Every tile shape: 3-row tiles and the 1-row tail, 4-output tiles and the tail of N, K's tail."""
    x, w, b = operands(M, K, N)
    out = kernel.small_linear(x, w, b if with_bias else None)
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    torch.testing.assert_close(out.double(), want, atol=1e-4 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("K,N", [(576, 195), (50, 37)])
def test_a_rows_result_does_not_depend_on_its_batch(kernel, K, N):
    """The same bits for a row alone, in any batch size and at any place in the batch."""
    x, w, b = operands(20, K, N, seed=1)
    together = kernel.small_linear(x, w, b)
    for m in range(20):
        assert torch.equal(kernel.small_linear(x[m:m + 1].contiguous(), w, b)[0], together[m])
    for size in (2, 5, 9):
        part = kernel.small_linear(x[3:3 + size].contiguous(), w, b)
        assert torch.equal(part, together[3:3 + size])


def test_linear_takes_the_kernel_only_where_it_applies(kernel):
    x, w, b = operands(5, 64, 48, seed=2)
    few = kernel.small_linear(x, w, b) if engine_linear.kernel_in_use() else F.linear(x, w, b)  # switched off: torch
    assert torch.equal(engine_linear.linear(x[None], w, b)[0], few)
    many = torch.randn(engine_linear.max_rows() + 1, 64)
    assert torch.equal(engine_linear.linear(many, w, b), F.linear(many, w, b))
    low = x.bfloat16()
    assert torch.equal(engine_linear.linear(low, w.bfloat16()), F.linear(low, w.bfloat16()))


def adopted_logits(model, ids):
    """The model's logits for ids before adopt(), after it outside the engine's forwards and inside a
    decode forward, and its linears (asserted all adopted, parameters and state dict unchanged)."""
    state = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.no_grad():
        before = model(input_ids=ids).logits
        count = engine_linear.adopt(model)
        plain = model(input_ids=ids).logits
        with engine_linear.engine_forward():
            fast = model(input_ids=ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert count == len(linears) > 0 and all(type(m) is engine_linear.EngineLinear for m in linears)
    assert all(torch.equal(t, state[name]) for name, t in model.state_dict().items())
    assert torch.equal(before, plain)
    return before, fast, linears


def test_engine_linears_are_plain_outside_the_engines_forwards(kernel):
    """adopt() keeps the parameters and the state dict; transformers' own calls still run F.linear,
    the runner's forwards run the kernel, and the model's outputs agree to float32 precision."""
    _, model = make_tiny(3)
    before, fast, _ = adopted_logits(model, torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(0)))
    torch.testing.assert_close(fast, before, atol=1e-4, rtol=1e-4)
    if engine_linear.kernel_in_use():
        assert not torch.equal(fast, before)  # ...and the kernel really ran inside


# ---------------------------------------------------------------- bfloat16 linears on bfloat16 dot products


@pytest.fixture(scope="module")
def bf16_kernel(kernel):
    if not kernel.bf16_linear_available():
        pytest.skip("bf16_linear_cat needs a CPU with AVX512-BF16 (this one has none)")
    return kernel


def bf16_operands(M, K, N, seed=0):
    x, w, b = operands(M, K, N, seed)
    return x.bfloat16(), w.bfloat16(), b


@pytest.mark.parametrize("M", [1, 5, 16, 17, 40, 130])
@pytest.mark.parametrize("K,N", [(64, 48), (1536, 32), (6, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_is_the_float64_product_rounded_once(bf16_kernel, M, K, N, with_bias):
    """Row tiles of 1..16 rows and their tails, one and several panels, a bias: each output is the float64
    product of the bfloat16 operands (+ the float32 bias) within one bfloat16 rounding and float32 sums."""
    x, w, b = bf16_operands(M, K, N)
    out = bf16_kernel.bf16_linear_cat(x, [bf16_kernel.bf16_panels(w)], [b if with_bias else None])
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    sums = x.double().abs() @ w.double().abs().T + (b.double().abs() if with_bias else 0)
    assert ((out.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-6 * K * sums).all()
    # not the widened float32 product rounded by another route: equal to it where that rounds the same
    widened = (x.float() @ w.float().T + (b if with_bias else 0)).bfloat16()
    assert (out == widened).float().mean() > 0.9


def test_bf16_linear_rows_do_not_depend_on_their_batch_and_parts_sit_side_by_side(bf16_kernel):
    """A row's bits alone, in any batch and at any place in it; several weights give each one's own output."""
    x, w, b = bf16_operands(40, 96, 64, seed=1)
    w2 = torch.randn(32, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    panels = [bf16_kernel.bf16_panels(w), bf16_kernel.bf16_panels(w2)]
    together = bf16_kernel.bf16_linear_cat(x, panels, [b, None])
    assert torch.equal(together[:, :64], bf16_kernel.bf16_linear_cat(x, panels[:1], [b]))
    assert torch.equal(together[:, 64:], bf16_kernel.bf16_linear_cat(x, panels[1:], [None]))
    for m in range(40):
        assert torch.equal(bf16_kernel.bf16_linear_cat(x[m:m + 1].contiguous(), panels, [b, None])[0], together[m])
    for start, size in ((3, 2), (7, 17), (0, 33)):
        part = bf16_kernel.bf16_linear_cat(x[start:start + size].contiguous(), panels, [b, None])
        assert torch.equal(part, together[start:start + size])


def test_bf16_panels_hold_pairs_of_16_outputs():
    """The layout the kernel reads: panel g, pair p, lane j holds W[16 g + j, 2 p], W[16 g + j, 2 p + 1]."""
    module = load_kernels()
    if module is None:
        pytest.skip("no fused CPU kernel here (needs a compiler)")
    w = torch.arange(32 * 6, dtype=torch.float32).view(32, 6).bfloat16()
    panels = module.bf16_panels(w)
    assert panels.shape == (2, 3, 16, 2)
    for g, p, j in ((0, 0, 0), (1, 2, 15), (1, 0, 3), (0, 1, 9)):
        assert torch.equal(panels[g, p, j], w[16 * g + j, 2 * p: 2 * p + 2])


def test_a_bfloat16_model_takes_the_kernel_inside_the_engine_only(bf16_kernel, monkeypatch):
    """adopt() takes a bfloat16 model's linears; inside the engine's decode forwards they make their
    panels and give the kernel's bits (a row's as alone, at any row count), in prefill forwards and
    outside F.linear's; the logits agree to bfloat16 precision; the report says so;
    MAGICDEC_BF16_GEMM=0 leaves the linears to torch."""
    if engine_linear.bf16_kernel() is None:
        pytest.skip("this CPU has AMX tiles: a bfloat16 model's GEMMs keep torch's there (not measured "
                    "against the kernel)")
    _, model = make_tiny(3)
    model.to(torch.bfloat16)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    before, fast, linears = adopted_logits(model, ids)
    with torch.no_grad(), engine_linear.engine_forward():
        alone = model(input_ids=ids[1:]).logits
    assert all(m.bf16_panels is not None for m in linears if m.weight.shape[0] % 16 == 0)
    assert torch.equal(alone[0], fast[1])
    torch.testing.assert_close(fast.float(), before.float(), atol=0.05, rtol=0.05)
    layer = linears[0]
    x = torch.randn(5, layer.in_features).bfloat16()
    with engine_linear.engine_forward():
        got = layer(x)
    panels, bias = layer.bf16_panels
    assert torch.equal(got, bf16_kernel.bf16_linear_cat(x, [panels], [bias]))
    many = torch.randn(300, layer.in_features).bfloat16()
    with engine_linear.engine_forward():
        assert torch.equal(layer(many), bf16_kernel.bf16_linear_cat(many, [panels], [bias]))
    with engine_linear.engine_forward(engine_linear.PREFILL):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # prefill chunks: torch's
    assert "bfloat16 dot products" in engine_linear.linear_path(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv(engine_linear.BF16_ENV, "0")
    monkeypatch.delitem(engine_linear._state, "bf16", raising=False)
    assert engine_linear.bf16_kernel() is None
    _, other = make_tiny(3)
    other.to(torch.bfloat16)
    assert engine_linear.adopt(other) == 0
    assert engine_linear.linear_path(torch.device("cpu"), torch.bfloat16) == "torch"
    monkeypatch.delitem(engine_linear._state, "bf16")  # the next test finds the kernel again


def test_the_memory_check_counts_a_bfloat16_models_panels(monkeypatch):
    """A bfloat16 CPU job's memory check adds 2 bytes per linear weight where the panels are made (a CPU
    with AVX512-BF16 and no AMX, the switch on), nothing with the switch off or for float32."""
    from engine.config.loading import load_recipe
    from engine.core.kernels import bf16_gemm_wanted
    from engine.job import memory
    from engine.models.shapes import linear_params

    bf16 = load_recipe("generic", ("model=tiny-shape", "dtype=bfloat16", "device=cpu", "draft.method=none"))
    shapes = memory.model_shapes("tiny-shape")
    cpu = torch.device("cpu")
    has = bf16_gemm_wanted()
    assert memory.bf16_panels_bytes(shapes, cpu, torch.bfloat16) == (2 * linear_params(shapes) if has else 0)
    assert memory.bf16_panels_bytes(shapes, cpu, torch.float32) == 0
    with_panels = memory.check_memory(bf16)
    monkeypatch.setenv(engine_linear.BF16_ENV, "0")
    assert memory.bf16_panels_bytes(shapes, cpu, torch.bfloat16) == 0
    assert with_panels - memory.check_memory(bf16) == (2 * linear_params(shapes) if has else 0)
