"""The draft's int8 GEMMs from the model's own GGUF panels (`panels_int8_linear_cat`, cpu_int8_panels.cpp;
`engine.core.linear.int8_panel_map`).

Reference: the rule written out in float64 from gguf-py's blocks: each row's input rounded per block
of 32 (s = max |x| / 127, q = round(x / s)), times the de-quantised weights exactly. The op must give
that (to float32 sums), a row the same bits alone or in any batch, and several weights side by side.
"""

from __future__ import annotations

import pytest
import torch

from test_gguf_blocks import quantised
from engine.core import linear as engine_linear
from engine.core.kernels import load as load_kernels
from engine.models.gguf_blocks import PackedWeight, dequantise, to_panels


@pytest.fixture(scope="module")
def kernel():
    module = load_kernels()
    if module is None or not module.int8_panels_available():
        pytest.skip("panels_int8_linear_cat needs a build for a CPU with AVX512-VNNI and AVX512-VBMI (this one "
                    "has none; the draft keeps fbgemm's int8 there)")
    return module


def rounded(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] rounded to int8 per row and block of `block` (s = max |x| / 127, float32 as the op), float64."""
    M, K = x.shape
    xb = x.view(M, K // block, block)
    s = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, (xb / s).round(), torch.zeros(()))
    return (q.double() * s.double()).view(M, K)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("K,N", [(32, 16), (576, 48), (1536, 32)])
def test_int8_panels_follow_the_rule(kernel, fmt, M, K, N):
    blocks = quantised(fmt, N, K, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    x[:, 5] *= 40  # an outlier channel, as LLM activations have: only its own block's scale grows
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    got = kernel.panels_int8_linear_cat(x, [to_panels(blocks, fmt)], [bias])
    assert got.dtype == torch.float32 and got.shape == (M, N)
    weight = dequantise(blocks, fmt).double()
    want = rounded(x, 32) @ weight.T + bias.double()
    magnitude = x.double().abs() @ weight.abs().T + bias.double().abs()
    assert ((got.double() - want).abs() <= 1e-5 * magnitude + 1e-6).all()
    # the input really is rounded (the exact product is further off than float32 sums would be)...
    exact = x.double() @ weight.T + bias.double()
    assert ((got.double() - exact).abs() > 1e-5 * magnitude + 1e-6).any()
    # ...per block: the outlier leaves the other blocks of its row their own fine scales
    per_row = rounded(x, K) @ weight.T + bias.double()
    if K > 32:
        assert (got.double() - exact).abs().sum() < (per_row - exact).abs().sum()


def test_int8_panels_rows_do_not_depend_on_their_batch_and_weights_sit_side_by_side(kernel):
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2))
    first, second = quantised("q4_1", 48, 576, seed=3), quantised("q8_0", 32, 576, seed=4)
    panels = [to_panels(first, "q4_1"), to_panels(second, "q8_0")]
    bias = torch.randn(48)
    together = kernel.panels_int8_linear_cat(x, panels, [bias, None])
    assert torch.equal(together[:, :48], kernel.panels_int8_linear_cat(x, panels[:1], [bias]))
    assert torch.equal(together[:, 48:], kernel.panels_int8_linear_cat(x, panels[1:], [None]))
    for start, size in ((0, 1), (3, 2), (7, 17), (0, 33), (39, 1)):
        assert torch.equal(kernel.panels_int8_linear_cat(x[start:start + size].contiguous(), panels, [bias, None]),
                           together[start:start + size])


def test_int8_panel_map_takes_modules_that_keep_panels_and_the_switch_turns_it_off(kernel, monkeypatch):
    """Modules with Q4_1/Q8_0 panels (as `keep_gguf_blocks` leaves them): one call side by side, x's
    dtype out; a module without panels, or MAGICDEC_INT8_PANELS=0: None (fbgemm's int8 then)."""
    if not {"q4_1_panels", "q8_0_panels"} <= engine_linear._blocks_read():
        pytest.skip("the kernel reads no GGUF panels here (needs AVX-512)")
    modules = []
    for fmt, n, seed in (("q4_1", 32, 5), ("q8_0", 16, 6)):
        blocks = quantised(fmt, n, 64, seed=seed)
        module = torch.nn.Linear(64, n)
        module.weight.data = dequantise(blocks, fmt)
        module.packed = PackedWeight(f"{fmt}_panels", to_panels(blocks, fmt))
        modules.append(module)
    x = torch.randn(3, 2, 64)
    forward = engine_linear.int8_panel_map(modules)
    got = forward(x)
    panels = [m.packed.blocks for m in modules]
    want = kernel.panels_int8_linear_cat(x.reshape(6, 64), panels, [m.bias.detach() for m in modules])
    assert got.shape == (3, 2, 48) and torch.equal(got.reshape(6, 48), want)
    assert engine_linear.int8_panel_map([*modules, torch.nn.Linear(64, 16)]) is None
    monkeypatch.setenv(engine_linear.INT8_PANELS_ENV, "0")
    assert engine_linear.int8_panel_map(modules) is None


@pytest.mark.real_model
def test_the_default_models_int8_draft_reads_its_panels_and_follows_it_more_closely(kernel, real_model, monkeypatch):
    """The default model (Q4_1 layers, a Q8_0 lm_head): its int8 draft GEMMs come from the panels the
    target reads (no weight copy), and over real text their next-token choices agree with the model's
    own more often than fbgemm's int8 (one input scale per call) do, teacher forced."""
    import inspect
    import textwrap

    from engine.core.attention import ForwardBatch
    from engine.core.runner import ModelRunner
    from engine.spec.draft.gemms import INT8, DraftGemms, int8_supported

    if not int8_supported():
        pytest.skip("this torch build has no x86/fbgemm quantized engine (the comparison's other side)")
    model = real_model.model
    ids = torch.tensor([real_model.tokenizer(inspect.getsource(textwrap)[:6000])["input_ids"][:320]])
    runner = ModelRunner(real_model, slots=1, capacity=ids.shape[1])  # keeps the model's GGUF panels

    def choices(module_runner) -> torch.Tensor:  # [T]: each position's next token, teacher forced
        batch = ForwardBatch(runner.cache, [0], [0], ids.shape[1])
        return module_runner.forward(ids, batch)[0].argmax(-1)

    with torch.no_grad():
        exact = choices(runner)
        panels = DraftGemms(model, INT8)
        assert panels.bytes == 0  # every linear, the lm_head included, reads the model's own panels
        from_panels = choices(runner.with_module(panels.module))
        monkeypatch.setenv(engine_linear.INT8_PANELS_ENV, "0")
        fbgemm = DraftGemms(model, INT8)
        assert fbgemm.bytes > 0
        from_fbgemm = choices(runner.with_module(fbgemm.module))
    agree_panels = (from_panels == exact).float().mean().item()
    agree_fbgemm = (from_fbgemm == exact).float().mean().item()
    assert agree_panels > agree_fbgemm, (agree_panels, agree_fbgemm)


@pytest.mark.real_model
def test_the_memory_check_counts_no_int8_copy_where_the_draft_reads_the_panels(monkeypatch):
    """A float32 job on the default model (a GGUF) with int8 draft GEMMs: no int8 copy where the op takes
    the panels here (AVX512-VNNI and VBMI, the switch on); one byte a linear weight with the switch off."""
    from engine.config.loading import load_recipe
    from engine.core.kernels import int8_panels_wanted
    from engine.job import memory
    from engine.models.shapes import linear_params
    from engine.spec.draft.gemms import int8_supported

    if not int8_supported():
        pytest.skip("this torch build has no x86/fbgemm quantized engine (int8 draft GEMMs are refused)")
    recipe = load_recipe("code", ("device=cpu", "dtype=float32", "draft.linear_dtype=int8"))
    copy = linear_params(memory.model_shapes(recipe.model))  # bytes of an int8 copy
    panels = int8_panels_wanted()
    with_switch = memory.check_memory(recipe)
    monkeypatch.setenv(engine_linear.INT8_PANELS_ENV, "0")
    assert memory.check_memory(recipe) - with_switch == (copy if panels else 0)
