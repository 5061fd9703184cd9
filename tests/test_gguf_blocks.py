"""GGUF blocks read by the few-row kernel (`engine.models.gguf_blocks`, `small_linear_cat` with formats).

References: gguf-py's own `quantize` / `dequantize` for the block layout and its rounding,
transformers' GGUF loader for the q/k row order, and the float32 kernel over the de-quantised
weight, which reading the blocks must match bit for bit (Q4_1 and Q8_0 panels, another summation order:
float64, and a row's bits alone and in any batch).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_panel_call, make_tiny
from engine.core import linear as engine_linear
from engine.core.kernels import load as load_kernels
from engine.models.gguf_blocks import (BLOCK_BYTES, BLOCKS_OF_PANELS, PANEL_FORMATS, PackedWeight,
                                       attach_gguf_blocks, dequantise, from_panels, to_panels, unpermute_rope_rows)
from engine.spec.draft.gemms import INT8, resolve_linear_dtype

QTYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


@pytest.fixture(scope="module")
def kernel():
    module = load_kernels()
    if module is None or engine_linear.FORMATS["q4_1"] not in module.small_linear_formats():
        pytest.skip("the fused CPU kernel does not read GGUF blocks here (needs a compiler, AVX2 + FMA and F16C)")
    return module


def quantised(fmt: str, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """Random weights [N, K] through gguf-py's quantiser: blocks uint8 [N, K / 32, bytes]."""
    weights = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(weights, QTYPES[fmt])).reshape(N, K // 32, BLOCK_BYTES[fmt])


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_dequantise_is_gguf_pys_bit_for_bit(fmt):
    blocks = quantised(fmt, 37, 256)
    want = gguf.quants.dequantize(blocks.reshape(37, -1).numpy(), QTYPES[fmt])
    assert torch.equal(dequantise(blocks, fmt), torch.from_numpy(want))


def test_rope_rows_are_put_back_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, head_dim = 3, 8
    blocks = quantised("q4_1", heads * head_dim, 64, seed=1)
    want = LlamaTensorProcessor()._reverse_permute_weights(dequantise(blocks, "q4_1").numpy(), heads, heads)
    assert torch.equal(dequantise(unpermute_rope_rows(blocks, head_dim), "q4_1"), torch.from_numpy(want))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 13, 40])
@pytest.mark.parametrize("K,N", [(64, 48), (576, 195), (1536, 37), (32, 1)])
def test_reading_blocks_gives_the_float32_kernels_bits(kernel, fmt, M, K, N):
    """Every tile shape (4-row and 3-row tiles, single rows, N's tail) with and without a bias."""
    blocks = quantised(fmt, N, K, seed=M)
    weight = dequantise(blocks, fmt)
    g = torch.Generator().manual_seed(M)
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    fmt_id = engine_linear.FORMATS[fmt]
    for b in (None, bias):
        got = kernel.small_linear_cat(x, [weight], [b], [blocks], [fmt_id])
        assert torch.equal(got, kernel.small_linear(x, weight, b))


def test_side_by_side_mixes_float32_and_block_weights(kernel):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, 128, generator=g)
    plain = torch.randn(20, 128, generator=g)
    q4, q8 = quantised("q4_1", 33, 128, seed=4), quantised("q8_0", 9, 128, seed=5)
    weights = [plain, dequantise(q4, "q4_1"), dequantise(q8, "q8_0")]
    packed = [None, PackedWeight("q4_1", q4), PackedWeight("q8_0", q8)]
    got = engine_linear.linear_cat(x, weights, [None] * 3, packed)
    assert torch.equal(got, torch.cat([kernel.small_linear(x, w, None) for w in weights], dim=1))


@pytest.fixture(scope="module")
def panel_kernel(kernel):
    panel_formats = {engine_linear.FORMATS["q4_1_panels"], engine_linear.FORMATS["q8_0_panels"]}
    if not panel_formats <= set(kernel.small_linear_formats()):
        pytest.skip("the kernel reads Q4_1 and Q8_0 panels only where it is built with AVX-512")
    return kernel


@pytest.mark.parametrize("block_format", ["q4_1", "q8_0"])
def test_panels_hold_the_blocks_bytes_where_the_kernel_reads_them(block_format):
    """Byte by byte against each layout's definition, and back: per 16 outputs and block, output i's
    fp16 d (then Q4_1's m) at bytes 2i of a 32-byte row, then byte j of its block's weights at row j,
    column i."""
    blocks = quantised(block_format, 32, 64, seed=9)
    panels = to_panels(blocks, block_format)
    scales = 4 if block_format == "q4_1" else 2  # bytes of fp16 scales at the start of a block
    assert panels.shape == (2, 2, 16 * BLOCK_BYTES[block_format])
    for n in range(32):
        g, i = divmod(n, 16)
        for b in range(2):
            block, panel = blocks[n, b], panels[g, b]
            for s in range(0, scales, 2):  # d, then m
                assert torch.equal(panel[16 * s + 2 * i: 16 * s + 2 * i + 2], block[s:s + 2])
            assert torch.equal(panel[16 * scales + i::16], block[scales:])
    assert torch.equal(from_panels(panels, block_format), blocks)


@pytest.fixture(params=["avx512", "amx"])
def panels_by(request, panel_kernel):
    """The kernel with its panels multiplied by AVX-512 FMAs, then by the AMX tiles (where it has them)."""
    amx = request.param == "amx"
    if amx and not panel_kernel.amx_in_use():
        pytest.skip("no AMX tiles here (a CPU with AMX-BF16 and a kernel built for it)")
    previous = panel_kernel.use_amx(amx)
    yield panel_kernel
    panel_kernel.use_amx(previous)


@pytest.mark.parametrize("block_format", ["q4_1", "q8_0"])
@pytest.mark.parametrize("M", [1, 2, 3, 13, 16, 17, 26, 40, 64])
@pytest.mark.parametrize("K,N", [(64, 48), (576, 192), (1536, 16)])
def test_panels_give_the_product_and_a_rows_bits_do_not_depend_on_its_batch(panels_by, block_format, M, K, N):
    """Against float64 (each output's error within float32 rounding of its terms' magnitudes); each
    row alone, and the rows in reverse order, give the very same bits as in the whole batch. Both
    ways of multiplying panels: AVX-512 FMAs, and the AMX tiles' bfloat16 products of x in three parts."""
    panel_kernel = panels_by
    blocks = quantised(block_format, N, K, seed=M + K)
    weight, panels = dequantise(blocks, block_format), to_panels(blocks, block_format)
    g = torch.Generator().manual_seed(M)
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    fmt = engine_linear.FORMATS[PANEL_FORMATS[block_format]]
    for b in (None, bias):
        got = panel_kernel.small_linear_cat(x, [weight], [b], [panels], [fmt])
        want = x.double() @ weight.double().T + (b.double() if b is not None else 0)
        bound = 4 * K * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T) + 1e-6
        assert ((got.double() - want).abs() <= bound).all()
        alone = torch.cat([panel_kernel.small_linear_cat(x[r:r + 1], [weight], [b], [panels], [fmt]) for r in range(M)])
        assert torch.equal(got, alone)
        reverse = panel_kernel.small_linear_cat(x.flip(0).contiguous(), [weight], [b], [panels], [fmt])
        assert torch.equal(got, reverse.flip(0))


def test_amx_panels_take_every_row_count_that_torch_took(panel_kernel, monkeypatch):
    """Past max_rows() (a verification forward's gamma + 1 rows per sequence, a prefill chunk) torch's
    GEMM takes float32 calls, and AVX-512 panel calls past their measured limit; AMX panels stay in the
    kernel at any number of rows (in passes of 128), so those rows get a plain step's arithmetic: a
    row's bits the same as alone, across the passes too. With the tiles switched off and the AVX-512
    panels' limit at max_rows(), torch again."""
    if not panel_kernel.amx_in_use():
        pytest.skip("no AMX tiles here (a CPU with AMX-BF16 and a kernel built for it)")
    blocks = quantised("q4_1", 32, 64, seed=7)
    weight, packed = dequantise(blocks, "q4_1"), PackedWeight("q4_1_panels", to_panels(blocks, "q4_1"))
    g = torch.Generator().manual_seed(7)
    for rows in (engine_linear.max_rows() + 1, 300):  # a verification forward; a prefill chunk (3 passes)
        x = torch.randn(rows, 64, generator=g)
        got = engine_linear.linear(x, weight, None, packed)
        assert_panel_call(got, x, weight, lambda rows_x: engine_linear.linear(rows_x, weight, None, packed))
        previous = panel_kernel.use_amx(False)
        monkeypatch.setitem(engine_linear._state, "panel_rows", engine_linear.max_rows())
        try:
            assert torch.equal(engine_linear.linear(x, weight, None, packed), F.linear(x, weight))
        finally:
            panel_kernel.use_amx(previous)


def test_auto_draft_gemms_are_the_models_own_where_the_amx_panels_take_every_linear(panel_kernel):
    """draft.linear_dtype auto keeps a float32 model's own GEMMs (None) when every one of its linears
    runs in the AMX panels; a linear without panels, or the tiles switched off, gives the CPU's
    low-precision dtype again, as does asking without the model (the memory check)."""
    if not panel_kernel.amx_in_use():
        pytest.skip("no AMX tiles here (a CPU with AMX-BF16 and a kernel built for it)")
    cpu = torch.device("cpu")
    low = resolve_linear_dtype("auto", torch.float32, cpu)
    assert low is not None  # a CPU with AMX-BF16 has native bf16 dot products
    blocks = quantised("q4_1", 32, 64, seed=8)
    layer = engine_linear.EngineLinear(64, 32, bias=False)
    layer.weight.data = dequantise(blocks, "q4_1")
    layer.packed = PackedWeight("q4_1_panels", to_panels(blocks, "q4_1"))
    model = torch.nn.Sequential(layer)
    assert engine_linear.amx_panels_take([layer])
    assert resolve_linear_dtype("auto", torch.float32, cpu, model) is None
    assert resolve_linear_dtype("int8", torch.float32, cpu, model) == INT8  # asked for: kept
    assert resolve_linear_dtype("auto", torch.float32, cpu, torch.nn.Sequential(layer, torch.nn.Linear(32, 8))) == low
    previous = panel_kernel.use_amx(False)
    try:
        assert resolve_linear_dtype("auto", torch.float32, cpu, model) == low
    finally:
        panel_kernel.use_amx(previous)


def test_panels_side_by_side_with_other_formats_keep_each_parts_bits(panel_kernel):
    """A q|k|v-like call mixing panels, dot-product blocks and float32 gives each part's own call's bits."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(13, 128, generator=g)
    q4a, q4b, q8 = quantised("q4_1", 32, 128, seed=10), quantised("q4_1", 20, 128, seed=11), quantised("q8_0", 16, 128, seed=12)
    q8p = quantised("q8_0", 48, 128, seed=13)
    plain = torch.randn(24, 128, generator=g)
    weights = [dequantise(q4a, "q4_1"), plain, dequantise(q4b, "q4_1"), dequantise(q8, "q8_0"), dequantise(q8p, "q8_0")]
    packed = [PackedWeight("q4_1_panels", to_panels(q4a, "q4_1")), None, PackedWeight("q4_1", q4b),
              PackedWeight("q8_0", q8), PackedWeight("q8_0_panels", to_panels(q8p, "q8_0"))]
    got = engine_linear.linear_cat(x, weights, [None] * 5, packed)
    assert torch.equal(got, torch.cat([engine_linear.linear(x, w, None, p) for w, p in zip(weights, packed)], dim=1))


def test_linear_reads_the_blocks_and_the_switch_turns_that_off(kernel, monkeypatch):
    """Blocks next to a float32 weight of zeros: the output is the blocks' (they were read), and with
    MAGICDEC_GGUF_BLOCKS=0 it is the zeros' (the float32 copy was read)."""
    blocks = quantised("q4_1", 24, 64, seed=6)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6))
    zeros, packed = torch.zeros(24, 64), PackedWeight("q4_1", blocks)
    assert torch.equal(engine_linear.linear(x, zeros, None, packed),
                       kernel.small_linear(x, dequantise(blocks, "q4_1"), None))
    monkeypatch.setenv(engine_linear.BLOCKS_ENV, "0")
    monkeypatch.delitem(engine_linear._state, "formats", raising=False)
    assert torch.equal(engine_linear.linear(x, zeros, None, packed), torch.zeros(5, 24))
    monkeypatch.delitem(engine_linear._state, "formats", raising=False)  # the next test reads the blocks again


@pytest.mark.real_model
def test_the_default_models_linears_get_blocks_that_are_their_weights(real_model):
    """Every layer linear has its Q4_1 blocks and the tied lm_head its Q8_0 ones (as panels where the
    kernel has AVX-512), and each de-quantises to exactly the loaded float32 weight (the file saved
    once beside the converted copy)."""
    model = real_model.model
    assert engine_linear.keep_gguf_blocks(model, real_model.gguf) == 211  # (as the model runner does)
    layers = [m for layer in model.model.layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    panels = "q4_1_panels" in engine_linear._blocks_read()  # where the kernel has AVX-512
    assert all(m.packed is not None and m.packed.format == ("q4_1_panels" if panels else "q4_1") for m in layers)
    assert model.lm_head.packed is not None and model.lm_head.packed.format == ("q8_0_panels" if panels else "q8_0")
    for module in [*layers, model.lm_head]:
        blocks, fmt = module.packed.blocks, module.packed.format
        if fmt in BLOCKS_OF_PANELS:
            fmt = BLOCKS_OF_PANELS[fmt]
            blocks = from_panels(blocks, fmt)
        assert torch.equal(dequantise(blocks, fmt), module.weight)


def test_blocks_that_are_not_the_weights_are_not_attached(tmp_path):
    """A GGUF tensor that de-quantises to something else than the loaded weight (here: a random model's
    q_proj against blocks of other weights) gives that module no blocks; a matching one does."""
    loaded, _ = make_tiny(11)
    model = loaded.model
    q_proj, v_proj = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.v_proj
    v_blocks = quantised("q8_0", *v_proj.weight.shape, seed=7)
    with torch.no_grad():
        v_proj.weight.copy_(dequantise(v_blocks, "q8_0"))
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    for name, blocks, fmt in (("blk.0.attn_q.weight", quantised("q4_1", *q_proj.weight.shape, seed=8), "q4_1"),
                              ("blk.0.attn_v.weight", v_blocks, "q8_0")):
        writer.add_tensor(name, blocks.reshape(blocks.shape[0], -1).numpy(), raw_dtype=QTYPES[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "converted"
    folder.mkdir()
    assert attach_gguf_blocks(model, tmp_path / "tiny.gguf", folder) == 1
    assert getattr(q_proj, "packed", None) is None
    assert v_proj.packed.format == "q8_0" and torch.equal(v_proj.packed.blocks, v_blocks)
    assert attach_gguf_blocks(model, tmp_path / "tiny.gguf", folder) == 1  # the second time from the saved file


def test_a_damaged_blocks_file_leaves_the_float32_weights(tmp_path, caplog):
    """The blocks only speed decode up: a file that cannot be read is logged, and nothing is attached."""
    loaded, _ = make_tiny(12)
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "gguf_blocks.safetensors").write_bytes(b"not a safetensors file")
    assert attach_gguf_blocks(loaded.model, tmp_path / "missing.gguf", folder) == 0
    assert not any(getattr(m, "packed", None) is not None for m in loaded.model.modules())
    assert "not used" in caplog.text
