"""The draft's linear layers in a cheaper dtype than the target's (e.g. bfloat16 GEMMs for a float32 model).

Speculative decoding is lossless whatever the draft computes: verification uses the target's own
logits. So a draft may run its matrix multiplications in a faster, less precise dtype. With
self-speculation the draft is the target's weights, so `DraftGemms` builds the draft its own module
tree: the target's modules, shared, except that each `torch.nn.Linear` is a `LowPrecisionLinear` over a
lower-precision copy of its weight. The target's modules are not touched, so its numbers do not
change. bfloat16 copies are multiplied by the CPU's bfloat16 dot products where the kernel has them
(`engine.core.linear.bf16_panel_linear`; 1.3x torch's bfloat16 GEMM for a draft step on a Zen 4,
BENCHMARKS.md section 44), else by torch.

"int8" rounds each call's input to int8. Where the model keeps GGUF panels (Q4_1 or Q8_0, the
default model's) and the CPU has AVX512-VNNI and AVX512-VBMI, the draft multiplies those panels, the
weights the target reads, with no copy: each row's input rounded per block of 32 with its own scale
(`engine.core.linear.int8_panel_map`, cpu_int8_panels.cpp), so a row's draft does not depend on its
batch. Elsewhere it is fbgemm's: an int8 copy of the weights, each output channel with its own scale,
and one scale for the whole input of a call (`torch.ops.quantized.linear_dynamic`, x86 CPUs only).
One scale for 16 rows' activations, whose outlier channels are tens of times the rest, costs
fbgemm's drafts 0.015-0.076 of acceptance on the code prompts against the panels' per-block scales
(BENCHMARKS.md section 44). With VNNI dot products either is 1.2-1.5x cheaper than bfloat16 at batch
16. Where the AMX
tiles multiply the model's own GGUF panels (`engine.core.linear.amx_panels_take`), those float32
GEMMs cost a draft step what int8 does, so "auto" keeps them: the draft then computes with the
target's exact weights (acceptance 0.84 against int8's 0.69 on the code prompts, BENCHMARKS.md
section 32).

`resolve_linear_dtype` reads the recipe's `draft.linear_dtype`; `make_linear` is one low-precision
linear map, and `draft_map` the draft's map over one or more modules side by side (the module path
takes one, the lean draft forward, `engine.spec.draft.forward`, fuses several): their own GGUF panels
for int8 where they keep them, else `make_linear` on their weights. Not here: the
draft's KV (the compressors). Layers DeepSpeed has replaced for tensor parallelism are not
`nn.Linear` and keep their own forward.
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.nn.functional as F

from engine.core.kernels import cpu_flags
from engine.core.linear import amx_panels_take, bf16_panel_linear, int8_panel_map, is_plain_linear
from engine.errors import JobError
from engine.models.loading import TORCH_DTYPES

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # CPUs whose bf16 GEMMs beat float32 ones
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products without 16-bit saturation
INT8 = torch.qint8  # marks int8 weights with dynamically quantised activations
_DTYPES = {**TORCH_DTYPES, "int8": INT8}  # draft.linear_dtype name -> the dtype of its GEMMs


def resolve_linear_dtype(setting: str, model_dtype: torch.dtype, device: torch.device,
                         model: torch.nn.Module | None = None) -> torch.dtype | None:
    """The dtype for the draft's GEMMs, or None for "the model's own" (nothing to do).

    "auto", for a float32 model on a CPU: None where `model` (the loaded draft, if given) has every
    linear layer in the AMX panel kernel; else int8 where the CPU has VNNI int8 dot products (and torch
    its x86 quantized engine), else bfloat16 where it has native bf16 dot products; otherwise None.
    Without `model` (the memory check, before loading) the low-precision answer stands: an upper bound.
    """
    if setting == "same":
        return None
    if setting == "int8" and (device.type != "cpu" or not int8_supported()):
        raise JobError("draft.linear_dtype: int8 needs a CPU with torch's x86/fbgemm quantized engine")
    if setting == "auto":
        if device.type != "cpu" or model_dtype != torch.float32:
            return None
        if model is not None and amx_panels_take([m for m in model.modules() if is_plain_linear(m)]):
            return None
        flags = cpu_flags().split()
        if any(flag in flags for flag in VNNI_FLAGS) and int8_supported():
            return INT8
        return torch.bfloat16 if any(flag in flags for flag in NATIVE_BF16_FLAGS) else None
    dtype = _DTYPES[setting]
    return None if dtype == model_dtype else dtype


@functools.cache
def int8_supported() -> bool:
    """Whether this torch build can run dynamically quantised int8 linear layers (x86 CPUs): its
    quantized engine is there and a tiny layer runs (torch marks these ops deprecated; if a future
    build drops them, `auto` falls back to bfloat16)."""
    if not any(engine in torch.backends.quantized.supported_engines for engine in ("x86", "fbgemm")):
        return False
    try:
        _int8_linear(torch.ones(2, 4), None)(torch.ones(1, 4))
    except Exception:  # noqa: BLE001 - any failure means "not available here"
        return False
    return True


def int8_reduce_range() -> bool:
    """Without VNNI, fbgemm's u8 x s8 products can saturate 16-bit sums: it needs 7-bit activations."""
    return not any(flag in cpu_flags().split() for flag in VNNI_FLAGS)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """x [..., in] -> x @ weight.T + bias [..., out] computed on a `dtype` copy of weight [out, in].

    The result has x's dtype. bfloat16: panels for the CPU's bfloat16 dot products where the kernel
    has them, else (and float16) a converted copy for torch. int8 (`INT8`): fbgemm's, per-output-channel
    symmetric int8 weights, activations quantised per call (a module's own GGUF panels are taken
    before this, by `draft_map`).
    """
    if dtype == INT8:
        return _int8_linear(weight, bias)
    panel_linear = bf16_panel_linear(weight, bias) if dtype == torch.bfloat16 else None
    if panel_linear is not None:  # the CPU's bfloat16 dot products (cpu_bf16_linear.cpp)
        return panel_linear
    low_weight = weight.detach().to(dtype)  # [out, in]
    low_bias = None if bias is None else bias.detach().to(dtype)

    def linear(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(dtype), low_weight, low_bias).to(x.dtype)
    return linear


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    weight = weight.detach().float()  # [out, in]
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()  # [out]: one per output channel
    zero = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch flags quantized tensors as deprecated; the op is still its own
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_channel(weight, scales, zero, 0, INT8)
    packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach().float())
    reduce_range = int8_reduce_range()

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), packed, reduce_range).to(x.dtype)
    return linear


def draft_map(modules: list[torch.nn.Linear], dtype: torch.dtype):
    """The draft's `dtype` map computing every module's output side by side ([..., in] -> [..., sum of
    outs], x's dtype), and the bytes of the weight copy it made.

    int8 over modules that keep GGUF panels: those panels, the input rounded per block
    (`engine.core.linear.int8_panel_map`: no copy). Otherwise `make_linear` on the weights (concatenated
    when there are several; a missing bias counts as zeros beside the others)."""
    on_panels = int8_panel_map(modules) if dtype == INT8 else None
    if on_panels is not None:
        return on_panels, 0
    if len(modules) == 1:
        weight, bias = modules[0].weight, modules[0].bias
    else:
        weight = torch.cat([m.weight.detach() for m in modules])  # [sum of outs, in]
        bias = None
        if any(m.bias is not None for m in modules):
            bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                              for m in modules])
    return make_linear(weight, bias, dtype), weight.numel() * dtype.itemsize


class LowPrecisionLinear(torch.nn.Module):
    """One of the draft's linear layers: a target `nn.Linear` computed by `draft_map` (its own GGUF
    panels, or a lower-precision copy)."""

    def __init__(self, source: torch.nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.compute, self.bytes = draft_map([source], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], x's dtype
        return self.compute(x)


class DraftGemms:
    """The draft's own module tree: the target's modules with every exact `nn.Linear` replaced by a
    `LowPrecisionLinear` (everything else, embeddings and norms included, shared with the target).

    The target's modules are never modified: its forward computes exactly as before, and the draft
    calls `module` (a transformers model, same signature) when it wants the cheaper GEMMs.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.linears: list[LowPrecisionLinear] = []  # the explicit set the draft's forward calls
        self.module = self._twin(model)

    def _twin(self, module: torch.nn.Module) -> torch.nn.Module:
        if is_plain_linear(module):  # nn.Linear (or the engine's): not DeepSpeed's sharded layers
            low = LowPrecisionLinear(module, self.dtype)
            self.linears.append(low)
            return low
        twin = copy.copy(module)  # shares parameters, buffers and config with the target's module
        twin.__dict__["_modules"] = {name: None if child is None else self._twin(child)
                                     for name, child in module._modules.items()}
        return twin

    @property
    def layers(self) -> int:
        return len(self.linears)

    @property
    def bytes(self) -> int:
        return sum(linear.bytes for linear in self.linears)

    @classmethod
    def for_model(cls, model: torch.nn.Module, dtype: torch.dtype) -> "DraftGemms":
        """One instance per model and dtype: engines sharing a loaded model share its copies."""
        made = model.__dict__.setdefault("_magicdec_draft_gemms", {})
        if dtype not in made:
            made[dtype] = cls(model, dtype)
        return made[dtype]
