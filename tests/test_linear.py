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


def test_engine_linears_are_plain_outside_the_engines_forwards(kernel):
    """adopt() keeps the parameters and the state dict; transformers' own calls still run F.linear,
    the runner's forwards run the kernel, and the model's outputs agree to float32 precision."""
    _, model = make_tiny(3)
    ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(0))
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
    torch.testing.assert_close(fast, before, atol=1e-4, rtol=1e-4)
    if engine_linear.kernel_in_use():
        assert not torch.equal(fast, before)  # ...and the kernel really ran inside
