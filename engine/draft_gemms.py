"""The draft's linear layers in a cheaper dtype than the target's (e.g. bfloat16 GEMMs for a float32 model).

Speculative decoding is lossless whatever the draft computes: verification uses the target's own
logits. So a draft may run its matrix multiplications in a faster, less precise dtype. With
self-speculation the draft *is* the target's modules, so each `torch.nn.Linear` of the model gets a
second, lower-precision copy of its weight and a forward that uses it only inside `active()`; outside,
the forward is `F.linear(x, weight, bias)` exactly as `nn.Linear` computes it, so the target's numbers
do not change. On a 2-core EPYC with native bf16 dot products, a batch-16 step's GEMMs take 3.4x less
time in bfloat16 than in float32 (the draft's cost there is its GEMMs, see BENCHMARKS.md).

`draft_gemms_for` turns the recipe's `draft.linear_dtype` into an instance (or None); not here: the
draft's KV (the compressors). Layers DeepSpeed has replaced for tensor parallelism are not
`nn.Linear` and keep their own forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from engine.cpu_kernels import cpu_flags

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # CPUs whose bf16 GEMMs beat float32 ones
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_linear_dtype(setting: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype for the draft's GEMMs, or None for "the model's own" (nothing to do).

    "auto": bfloat16 when the model runs in float32 on a CPU with native bf16 dot products, else None.
    """
    if setting == "same":
        return None
    if setting == "auto":
        native = device.type == "cpu" and any(flag in cpu_flags().split() for flag in NATIVE_BF16_FLAGS)
        return torch.bfloat16 if native and model_dtype == torch.float32 else None
    dtype = _DTYPES[setting]
    return None if dtype == model_dtype else dtype


def draft_gemms_for(setting: str, runner) -> "DraftGemms | None":
    """The draft GEMMs a draft `ModelRunner` should use for `draft.linear_dtype` = setting, or None."""
    dtype = resolve_linear_dtype(setting, runner.model.dtype, runner.device)
    return DraftGemms.for_model(runner.model, dtype) if dtype is not None else None


def gemm_dtype_name(gemms: "DraftGemms | None", runner) -> str:
    """What the draft's linear layers compute in, for reports: "bfloat16", "float32", ..."""
    return str(gemms.dtype if gemms is not None else runner.model.dtype).replace("torch.", "")


class DraftGemms:
    """Lower-precision copies of a model's linear weights, used by its forward only while `active()`."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.on = False
        self.layers = 0
        self.bytes = 0
        for module in model.modules():
            if type(module) is torch.nn.Linear:  # exactly nn.Linear: not DeepSpeed's sharded layers
                weight = module.weight.detach().to(dtype)  # [out, in]
                bias = None if module.bias is None else module.bias.detach().to(dtype)
                module.forward = self._forward(module, weight, bias)
                self.layers += 1
                self.bytes += weight.numel() * weight.element_size()

    @classmethod
    def for_model(cls, model: torch.nn.Module, dtype: torch.dtype) -> "DraftGemms":
        """One instance per model and dtype: engines sharing a loaded model share its copies."""
        existing = getattr(model, "_magicdec_draft_gemms", None)
        if existing is None or existing.dtype != dtype:
            existing = cls(model, dtype)
            model._magicdec_draft_gemms = existing
        return existing

    def _forward(self, module: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None):
        def forward(x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
            if self.on:
                return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
            return F.linear(x, module.weight, module.bias)
        return forward

    @contextlib.contextmanager
    def active(self):
        """Run the model's linear layers on the low-precision copies inside this block."""
        self.on = True
        try:
            yield
        finally:
            self.on = False
