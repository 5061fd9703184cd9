"""The engine's linear layers: the fused CPU kernel's `small_linear` for decode steps' few rows (and for
every row count where the AMX tiles multiply GGUF panels, prefill chunks included).

A decode, verification or draft forward multiplies a few rows (one to gamma + 1 per sequence) by
every weight matrix; torch's CPU GEMM is slow at that shape (BENCHMARKS.md section 12: the kernel
takes 1.6x less time for one step's layers and lm_head of SmolLM2-135M at 13 rows, 2.6x less for
the lm_head alone, on a 2-core Zen 3; 1.7x less for the layers and lm_head at 13 rows on a 2-core
Xeon with AVX-512, section 15). `linear(x, weight, bias)` takes the kernel for float32 on CPU with
at most `max_rows()` rows, else `F.linear`. The kernel uses the build's widest vectors (AVX-512, else
AVX2 + FMA).

`adopt(model)` makes a model's exact `nn.Linear` modules `EngineLinear`, a subclass whose forward
takes `linear` only inside `engine_forward()` (the model runner's forwards), so the same module
called by anyone else, transformers' own `generate` in the tests included, runs `F.linear` as
before. The kernel's result for a row does not depend on the other rows of the call, so a row
decodes the same alone or in any batch. `MAGICDEC_SMALL_GEMM=0` turns it off (for side-by-side
benchmarks).

A module may carry `packed`, the GGUF blocks its float32 weight was de-quantised from (Q4_1 or
Q8_0). `keep_gguf_blocks` gives them where the kernel reads them, through `engine.models.gguf_blocks`,
which checks that they de-quantise to exactly that weight. The kernel then reads the blocks (0.625 or
1.06 bytes a weight instead of 4) and gives the same bits; with `MAGICDEC_GGUF_BLOCKS=0` it reads
the float32 copy. Where the kernel has AVX-512, Q4_1 and Q8_0 blocks are regrouped once into 16-output
panels, which it multiplies as an outer product (faster; other bits than the float32 kernel's, the same
for a row whatever its batch); where the CPU has AMX tiles (and `MAGICDEC_AMX` is not "0") the panels
are multiplied by them instead, x split into three bfloat16 parts so that every product is exact
(float32 accuracy; other bits again, still the same for a row whatever its batch), for any number of
rows: decode steps, verification forwards and prefill chunks alike (faster than torch's GEMM from 1.5x
at 16 rows of the lm_head to 1.4x at a 512-token chunk, BENCHMARKS.md sections 30 and 31). Without
the tiles, panel calls take the kernel up to the row count at which this machine measured torch's
GEMM faster (`engine.core.panel_rows`, once per machine; every count up to a 512-token chunk on a
Zen 4, ~96 rows on a Xeon), not only up to `max_rows()`: a verification forward's 48-144 rows then
get a plain step's arithmetic, 1.8x faster at 48 rows there (BENCHMARKS.md section 40).

A bfloat16 model's linears are `EngineLinear` too where the kernel was built for a CPU with
AVX512-BF16 and no AMX tiles (there torch's GEMM has them): inside the engine's forwards each multiplies by the CPU's bfloat16 dot products from
panels of its weight made on first use (`bf16_linear`; cpu_bf16_linear.cpp) in decode steps,
verification and draft forwards, whatever their rows (a row's bits the same in any of them; 1.7-2x
torch's bfloat16 GEMM at a decode step's 16 rows on a Zen 4, BENCHMARKS.md section 42). Prefill
forwards (`engine_forward(PREFILL)`) keep torch's GEMM: as fast at a 512-token chunk, and every
prompt's K/V then come from one path whichever rows its chunks held (given the kernel for chunks
of up to 256 rows only, a SnapKV job, whose reused prefixes stop before each row's observation
window, wrote other bfloat16 answers than the plain job). The panels are a second copy of the
weights (2 bytes a weight, counted by the memory check). `MAGICDEC_BF16_GEMM=0` keeps torch's GEMM.
Two maps for a self-speculative draft's cheaper GEMMs (`engine.spec.draft.gemms` decides when):
`bf16_panel_linear`, a float32 weight's bfloat16 panels on the same dot products, and
`int8_panel_map`, the model's own GGUF panels with the input rounded to int8 per row and block of
32, on VNNI dot products (cpu_int8_panels.cpp). Not here: fbgemm's int8 and the choice of the draft's
dtype (`engine.spec.draft.gemms`), sharded layers (DeepSpeed's keep their own forward), attention.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os

import torch
import torch.nn.functional as F

from engine.core import kernels as cpu_kernels
from engine.core import panel_rows
from engine.models.gguf_blocks import PANEL_FORMATS, PANEL_OUTPUTS, PackedWeight, attach_gguf_blocks, to_panels
from engine.models.loading import GgufSource

MAX_ROWS = 128  # AVX2: above this torch's GEMM is as fast (BENCHMARKS.md section 12)
MAX_ROWS_AVX512 = 40  # AVX-512: from ~40 rows torch's GEMM is as fast (BENCHMARKS.md section 15)
SWITCH_ENV = "MAGICDEC_SMALL_GEMM"  # "0": always torch's GEMM
BLOCKS_ENV = "MAGICDEC_GGUF_BLOCKS"  # "0": the kernel reads float32 weights even where blocks are attached
BF16_ENV = cpu_kernels.BF16_GEMM_ENV  # "0": a bfloat16 model's linears keep torch's GEMM
INT8_PANELS_ENV = cpu_kernels.INT8_PANELS_ENV  # "0": a draft's int8 GEMMs by fbgemm even where GGUF panels are kept
# block formats -> the kernel's ids (cpu_linear.cpp's WeightFormat); *_panels: regrouped by 16 outputs
FORMATS = {"q4_1": 1, "q8_0": 2, "q4_1_panels": 3, "q8_0_panels": 4}
_PANEL_IDS = frozenset(FORMATS[name] for name in PANEL_FORMATS.values())
FORMAT_NAMES = {"q4_1": "Q4_1", "q8_0": "Q8_0", "q4_1_panels": "Q4_1 (16-output panels)",
                "q8_0_panels": "Q8_0 (16-output panels)"}  # for the report
# None: outside the engine's forwards; else "decode" (decode, verification and draft forwards) or "prefill"
_in_engine = contextvars.ContextVar("magicdec_engine_forward", default=None)
DECODE, PREFILL = "decode", "prefill"
_state: dict[str, object] = {}


def _kernel():
    """The compiled kernel where `linear` takes it: a CPU with AVX2 + FMA or AVX-512, the switch on."""
    if "kernel" not in _state:
        kernel = None
        if os.environ.get(SWITCH_ENV, "1") != "0":
            kernel = cpu_kernels.load()
        _state["kernel"] = kernel if kernel is not None and kernel.small_linear_available() else None
    return _state["kernel"]


def bf16_kernel():
    """The compiled kernel where bfloat16 linears take its bfloat16 dot products: a build for a CPU with
    AVX512-BF16 and no AMX (`kernels.bf16_gemm_wanted`), `MAGICDEC_SMALL_GEMM` not "0"; else None."""
    if "bf16" not in _state:
        kernel = None
        if cpu_kernels.bf16_gemm_wanted() and os.environ.get(SWITCH_ENV, "1") != "0":
            kernel = cpu_kernels.load()
        _state["bf16"] = kernel if kernel is not None and kernel.bf16_linear_available() else None
    return _state["bf16"]


def _blocks_read() -> frozenset[str]:
    """The block formats the kernel reads here (none with the switch off or without the kernel)."""
    if "formats" not in _state:
        kernel = _kernel()
        compiled = set(kernel.small_linear_formats()) if kernel is not None else set()
        on = os.environ.get(BLOCKS_ENV, "1") != "0"
        _state["formats"] = frozenset(name for name, ident in FORMATS.items() if on and ident in compiled)
    return _state["formats"]


def max_rows() -> int:
    """The most rows `linear` gives the kernel on this CPU (torch's GEMM catches up sooner on AVX-512)."""
    if "max_rows" not in _state:
        _state["max_rows"] = MAX_ROWS_AVX512 if "avx512f" in cpu_kernels.cpu_flags().split() else MAX_ROWS
    return _state["max_rows"]


def kernel_in_use() -> bool:
    """Whether `linear` takes the kernel on this machine (for reports and tests)."""
    return _kernel() is not None


def linear_path(device: torch.device, dtype: torch.dtype, model: torch.nn.Module | None = None) -> str:
    """Who computes decode steps' GEMMs here (for the job report), and from which weights."""
    if device.type == "cpu" and dtype == torch.bfloat16 and bf16_kernel() is not None:
        return "bfloat16 dot products (avx512_bf16) from panels of the weights; prefill chunks: torch"
    if device.type == "cpu" and dtype == torch.float32 and kernel_in_use():
        isa = "avx512" if "avx512f" in cpu_kernels.cpu_flags().split() else "avx2"
        path = f"few-row CPU kernel ({isa}) up to {max_rows()} rows, torch above"
        packed = [m.packed.format for m in (model.modules() if model is not None else [])
                  if isinstance(m, EngineLinear) and m.packed is not None]
        if packed:
            counts = ", ".join(f"{packed.count(name)} {FORMAT_NAMES[name]}" for name in sorted(set(packed)))
            path += f"; reads GGUF blocks for {counts} weights"
            if any(name in PANEL_FORMATS.values() for name in packed):
                if _kernel().amx_in_use():
                    path += " (panels by AMX tiles, bfloat16 x 3, any number of rows)"
                else:
                    limit = panel_row_limit()
                    rows = "any number of rows" if limit == math.inf else f"up to {int(limit)} rows"
                    why = ("set by MAGICDEC_PANEL_ROWS" if panel_rows.setting_from_env() is not None
                           else "faster than torch's GEMM there, measured on this machine")
                    path += f" (panels for {rows}: {why})"
        return path
    return "torch"


def amx_panels_take(modules: list[torch.nn.Module]) -> bool:
    """Whether every one of these linears runs in the AMX panel kernel here, whatever its rows: float32
    weights kept as GGUF panels (`keep_gguf_blocks`), a CPU whose tiles multiply them, the kernel on."""
    if not modules or _kernel() is None:
        return False
    return (_weights_fit([m.weight for m in modules], [m.bias for m in modules])
            and _all_amx_panels(_blocks_args([getattr(m, "packed", None) for m in modules])))


def _weights_fit(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> bool:
    """Whether the kernel takes these weights and biases (float32, weights contiguous)."""
    return (all(w.dtype == torch.float32 and w.is_contiguous() for w in weights)
            and all(b is None or b.dtype == torch.float32 for b in biases))


def _kernel_for_input(x: torch.Tensor, limit: float):
    """The kernel if it takes x [..., K] here (float32, 1..limit rows on CPU), else None; the weights
    are checked apart (`_weights_fit`, `_row_limit`)."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if not (0 < rows <= limit and x.device.type == "cpu" and x.dtype == torch.float32):
        return None
    return _kernel()


def _row_limit(blocks_args: dict) -> float:
    """The most rows the kernel takes for a call with these weights: any number where every weight is a
    panel format the AMX tiles multiply (faster than torch's GEMM at every size measured, so decode steps,
    verification forwards and prefill chunks all take them, and a row's bits never depend on its batch);
    where every weight is a panel format multiplied by AVX-512 FMAs, as many as this machine measured
    them faster than torch's GEMM (`panel_row_limit`); else max_rows()."""
    if not _all_panels(blocks_args):
        return max_rows()
    return math.inf if _kernel().amx_in_use() else panel_row_limit()


def panel_row_limit() -> float:
    """Up to how many rows AVX-512 panel calls take the kernel here (`engine.core.panel_rows`: measured
    once per machine, at least max_rows())."""
    if "panel_rows" not in _state:
        _state["panel_rows"] = panel_rows.row_limit(_kernel(), FORMATS["q4_1_panels"], max_rows())
    return _state["panel_rows"]


def _all_panels(blocks_args: dict) -> bool:
    """Whether every weight of a call with these blocks arguments is read from panels."""
    formats = blocks_args.get("formats", [])
    return bool(formats) and all(f in _PANEL_IDS for f in formats)


def _all_amx_panels(blocks_args: dict) -> bool:
    """Whether every weight of a call with these blocks arguments (`_blocks_args`) is a panel format the
    AMX tiles multiply here (a weight without blocks read here has format 0)."""
    return _all_panels(blocks_args) and _kernel().amx_in_use()


def _blocks_args(packed: list[PackedWeight | None]) -> dict:
    """The kernel's blocks/formats arguments for weights that carry blocks it reads here (else none)."""
    formats = _blocks_read()
    if not any(p is not None and p.format in formats for p in packed):
        return {}
    use = [p if p is not None and p.format in formats else None for p in packed]
    return {"blocks": [p.blocks if p is not None else None for p in use],
            "formats": [FORMATS[p.format] if p is not None else 0 for p in use]}


def _small_linear(kernel, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                  blocks_args: dict) -> torch.Tensor:
    """The kernel's x [..., K] -> [..., sum of N_i] (biases contiguous, blocks_args from `_blocks_args`)."""
    out = kernel.small_linear_cat(x.reshape(-1, x.shape[-1]).contiguous(), weights, biases, **blocks_args)
    return out.view(*x.shape[:-1], out.shape[-1])


def _torch_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    """torch's x [..., K] -> [..., sum of N_i] (one weight: no concatenated copy)."""
    if len(weights) == 1:
        return F.linear(x, weights[0], biases[0])
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def _contiguous(biases: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [b.contiguous() if b is not None else None for b in biases]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]: the kernel where it applies (reading
    `packed`'s blocks if given and read here), else F.linear."""
    return linear_cat(x, [weight], [bias], [packed])


def linear_cat(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
               packed: list[PackedWeight | None] | None = None) -> torch.Tensor:
    """Every weight's `linear` side by side: x [..., K] -> [..., sum of N_i] (a fused q|k|v or gate|up
    projection over the model's own separate weights, no concatenated copy). Each output has the bits
    `linear` gives it alone."""
    if _weights_fit(weights, biases) and _kernel() is not None:
        blocks_args = _blocks_args(packed or [None] * len(weights))
        if (kernel := _kernel_for_input(x, _row_limit(blocks_args))) is not None:
            return _small_linear(kernel, x, weights, _contiguous(biases), blocks_args)
    return _torch_linear(x, weights, biases)


def linear_map(modules: list[torch.nn.Linear]):
    """`linear_cat` over these modules' weights, biases and GGUF blocks as they are now, with the
    weight checks and the kernel's arguments worked out once (for forwards built after the blocks are
    kept): [..., K] -> [..., sum of N_i]."""
    weights, biases = [m.weight for m in modules], [m.bias for m in modules]
    fit = _weights_fit(weights, biases)
    kernel_biases = _contiguous(biases)
    blocks_args = _blocks_args([getattr(m, "packed", None) for m in modules])
    limit = _row_limit(blocks_args) if fit and _kernel() is not None else 0  # 0: never the kernel

    def forward(x: torch.Tensor) -> torch.Tensor:
        kernel = _kernel_for_input(x, limit)
        if kernel is not None:
            return _small_linear(kernel, x, weights, kernel_biases, blocks_args)
        return _torch_linear(x, weights, biases)

    return forward


class EngineLinear(torch.nn.Linear):
    """An `nn.Linear` whose forward takes `linear` (float32) or `bf16_linear` (bfloat16) inside the
    engine's forwards (see the module docstring)."""

    packed: PackedWeight | None = None  # the GGUF blocks of its weight, where `keep_gguf_blocks` kept them
    bf16_panels: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (panels, float32 bias), made on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward = _in_engine.get()
        if forward is not None:
            if self.weight.dtype == torch.bfloat16:
                return bf16_linear(self, x) if forward == DECODE else F.linear(x, self.weight, self.bias)
            return linear(x, self.weight, self.bias, self.packed)
        return F.linear(x, self.weight, self.bias)


def bf16_linear(module: EngineLinear, x: torch.Tensor) -> torch.Tensor:
    """A bfloat16 module's x [..., K] -> [..., N] by the kernel's bfloat16 dot products where it takes
    them (a bfloat16 CPU input, N a multiple of 16, K even), else F.linear. The weight's panels and the
    bias in float32 are made on the first call and kept on the module (the weights are frozen)."""
    kernel = bf16_kernel()
    if (not _bf16_takes(kernel, module.weight) or x.dtype != torch.bfloat16 or x.device.type != "cpu"
            or x.numel() == 0):
        return F.linear(x, module.weight, module.bias)
    if module.bf16_panels is None:
        module.bf16_panels = _bf16_panels(kernel, module.weight, module.bias)
    return _bf16_times(kernel, x, *module.bf16_panels)


def bf16_panel_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """x [..., K] (any float dtype) -> x @ weight.T + bias [..., N] in x's dtype, by the kernel's
    bfloat16 dot products on panels of weight [N, K] rounded to bfloat16, made now (for a draft's
    bfloat16 copy of a float32 weight, `engine.spec.draft.gemms`); None where the kernel does not
    take it (no `bf16_kernel`, a weight off the CPU, N not a multiple of 16, K odd)."""
    kernel = bf16_kernel()
    if not _bf16_takes(kernel, weight):
        return None
    panels, bias32 = _bf16_panels(kernel, weight, bias)
    return lambda x: _bf16_times(kernel, x.to(torch.bfloat16), panels, bias32).to(x.dtype)


def _bf16_takes(kernel, weight: torch.Tensor) -> bool:
    """Whether the bfloat16 kernel (or None) multiplies this weight [N, K]: on the CPU, N a multiple of
    16, K even."""
    N, K = weight.shape
    return kernel is not None and weight.device.type == "cpu" and N % PANEL_OUTPUTS == 0 and K % 2 == 0


def _bf16_panels(kernel, weight: torch.Tensor, bias: torch.Tensor | None):
    """(weight [N, K] as bfloat16 panels [N / 16, K / 2, 16, 2], the bias in float32 or None)."""
    panels = kernel.bf16_panels(weight.detach().to(torch.bfloat16).contiguous())
    return panels, None if bias is None else bias.detach().float().contiguous()


def _bf16_times(kernel, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] bfloat16 times the panels (+ bias) -> [..., N] bfloat16."""
    out = kernel.bf16_linear_cat(x.reshape(-1, x.shape[-1]).contiguous(), [panels], [bias])
    return out.view(*x.shape[:-1], out.shape[-1])


def int8_panel_map(modules: list[torch.nn.Module]):
    """A draft's int8 map over these modules side by side, from their own GGUF panels: x [..., K] ->
    [..., sum of N_i] in x's dtype, x rounded to int8 per row and block of 32 and multiplied by the
    CPU's VNNI dot products (cpu_int8_panels.cpp; `engine.spec.draft.gemms`'s int8, with no weight
    copy). None unless every module keeps Q4_1 or Q8_0 panels read here (`keep_gguf_blocks`) and the
    kernel has the op (AVX512-VNNI and AVX512-VBMI); `MAGICDEC_INT8_PANELS=0` says None too (the draft
    then takes fbgemm's int8)."""
    kernel = _kernel()
    packed = [getattr(m, "packed", None) for m in modules]
    if (kernel is None or not cpu_kernels.int8_panels_wanted() or not kernel.int8_panels_available()
            or not all(p is not None and p.format in PANEL_FORMATS.values() and p.format in _blocks_read()
                       for p in packed)):
        return None
    panels = [p.blocks for p in packed]  # each [N_i / 16, K / 32, bytes]
    biases = [None if m.bias is None else m.bias.detach().float().contiguous() for m in modules]
    K = modules[0].in_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = kernel.panels_int8_linear_cat(x.reshape(-1, K).float().contiguous(), panels, biases)  # [M, sum N_i]
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    return forward


def adopt(model: torch.nn.Module) -> int:
    """Turn the model's exact `nn.Linear` modules into `EngineLinear` (same parameters, same state
    dict); returns how many. Only CPU models the kernels take: float32, and bfloat16 where the kernel
    has bfloat16 dot products (`bf16_kernel`)."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu" and (
                module.weight.dtype == torch.float32
                or (module.weight.dtype == torch.bfloat16 and bf16_kernel() is not None)):
            module.__class__ = EngineLinear
            count += 1
    return count


def keep_gguf_blocks(model: torch.nn.Module, source: GgufSource | None) -> int:
    """Give the model's float32 CPU linears their GGUF blocks where the kernel reads them here (once per
    model; `engine.models.gguf_blocks` checks each against its weight); returns how many have blocks."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if source is None or not _blocks_read() or not linears or linears[0].weight.device.type != "cpu" \
            or linears[0].weight.dtype != torch.float32:
        return 0
    if not any(getattr(m, "packed", None) is not None for m in linears):
        attach_gguf_blocks(model, source.file, source.folder)
        for module in linears:
            packed = getattr(module, "packed", None)
            panels = PANEL_FORMATS.get(packed.format) if packed is not None else None
            if panels in _blocks_read() and packed.blocks.shape[0] % PANEL_OUTPUTS == 0:
                module.packed = PackedWeight(panels, to_panels(packed.blocks, packed.format))
    return sum(getattr(m, "packed", None) is not None for m in linears)


def is_plain_linear(module: torch.nn.Module) -> bool:
    """An `nn.Linear` or `EngineLinear` (not a sharded or low-precision layer)."""
    return type(module) in (torch.nn.Linear, EngineLinear)


@contextlib.contextmanager
def engine_forward(kind: str = DECODE):
    """Inside: `EngineLinear` modules take `linear` (float32), and `bf16_linear` (bfloat16) in DECODE
    forwards (decode, verification, draft) but torch's GEMM in PREFILL ones."""
    token = _in_engine.set(kind)
    try:
        yield
    finally:
        _in_engine.reset(token)
