"""The draft step: the lean stack for Llama-family drafts on CPU, or transformers' own forward.

A draft step reads a small compressed view, so once its GEMMs are cheap (int8 or bf16, see
`engine.spec.draft.gemms`) much of what is left is per-operation overhead in transformers' decoder
layers; on a 2-core CPU a batch-16 int8 draft step takes 30.4 ms that way and 22.9 ms in the lean
stack over the same view (BENCHMARKS.md, `results/draft_step.json`). `LeanDraft` runs
`engine.core.lean_forward.LeanStack` (where `supports` holds) with fused q/k/v and gate/up weights in
the draft's GEMM dtype, and attends over the view: from the cache at the view's positions, or from the
compressor's compact bf16 store (`engine.spec.compressors.compact`) when the view has one, where it
also writes its K/V (a forward without a view, a guided separate draft's first step of a round, reads
the whole cache through `engine.core.attention.attend_full`). `ModuleDraft` is the fallback for
everything else (other architectures, GPUs, tensor parallelism, where DeepSpeed's sharded layers are
not `nn.Linear`).

The target checks every draft token: a different rounding here changes acceptance, never output. Not
here: choosing the view (compressors), the target's forward (`engine.core.runner`).
"""

from __future__ import annotations

import torch

from engine.core.attention import ForwardBatch, attend_full
from engine.core.lean_forward import Linear, LeanStack, side_by_side, supports
from engine.spec.draft.gemms import INT8, DraftGemms, draft_map, resolve_linear_dtype
from engine.spec.compressors.base import Compressor
from engine.core.runner import ModelRunner

__all__ = ["LeanDraft", "ModuleDraft", "draft_forward_for", "supports"]


def draft_forward_for(setting: str, runner: ModelRunner, compressor: Compressor, *, extra: int,
                      self_speculation: bool) -> "LeanDraft | ModuleDraft":
    """The draft step for `draft.linear_dtype` = setting: the lean forward where `supports` says so
    (its compressor then keeps a StreamingLLM/SnapKV view in a compact store, before any prefill;
    extra = gamma_max + 1), else transformers' forward with the draft GEMMs switched on."""
    dtype = resolve_linear_dtype(setting, runner.model.dtype, runner.device, runner.model)
    if supports(runner.model, runner.cache.k.dtype, runner.device):
        compressor.enable_compact(extra=extra, copy_committed=self_speculation)
        return LeanDraft.for_model(runner.model, dtype)
    return ModuleDraft(runner, DraftGemms.for_model(runner.model, dtype) if dtype is not None else None)


def dtype_name(dtype: torch.dtype) -> str:
    return "int8" if dtype == INT8 else str(dtype).replace("torch.", "")


class ModuleDraft:
    """A draft step through transformers' forward (any architecture, tensor parallel included): the
    target's modules, or with `gemms` the draft's own tree of them with lower-precision linear layers."""

    path = "transformers"

    def __init__(self, runner: ModelRunner, gemms: DraftGemms | None):
        self.runner = runner if gemms is None else runner.with_module(gemms.module)
        self.gemms = gemms
        self.gemm_dtype = dtype_name(gemms.dtype if gemms is not None else runner.model.dtype)

    def __call__(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """tokens: [B, T] -> logits [B, vocab] of each row's last token."""
        return self.runner.forward(tokens, batch, last_only=True)[:, -1]


class LeanDraft:
    """The draft's decoder stack (`LeanStack`) with its projections in the draft's GEMM dtype, over
    the draft's view; a call returns last-position logits."""

    path = "lean"

    def __init__(self, model: torch.nn.Module, gemm_dtype: torch.dtype | None):
        """gemm_dtype: the draft GEMMs' dtype (bf16, int8, ...), or None for the model's own weights."""
        self.model = model
        self.gemm_dtype = dtype_name(gemm_dtype or model.dtype)
        self.stack = LeanStack(model, lambda modules: _fused(modules, gemm_dtype))
        self.kernel = self.stack.kernel

    @classmethod
    def for_model(cls, model: torch.nn.Module, gemm_dtype: torch.dtype | None) -> "LeanDraft":
        """One instance per model and GEMM dtype: engines sharing a loaded model share its copies."""
        made = model.__dict__.setdefault("_magicdec_lean_drafts", {})
        if gemm_dtype not in made:
            made[gemm_dtype] = cls(model, gemm_dtype)
        return made[gemm_dtype]

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """tokens: [B, T], written at batch.positions; attends to batch.view. Returns logits [B, vocab]
        of each row's last token (float32)."""
        B, T = tokens.shape
        stack, kernel, cache = self.stack, self.kernel, batch.cache
        H, D = stack.heads, stack.head_dim
        ends = batch.start_tensor + T
        compact = getattr(batch.view, "compact", None)  # the view kept in the draft's own store
        if compact is not None:
            rows = compact.rows_for(batch.positions, batch.slot_tensor[:, None])  # [B, T]: the new tokens' store entries
            compact.entry_pos[batch.slot_tensor[:, None], rows] = batch.positions
            entries = batch.view.compact_entries()  # [B, S]
            k_store, v_store = compact.k, compact.v
        else:
            rows, k_store, v_store = batch.positions, cache.k, cache.v

        def attend(index: int, query: torch.Tensor) -> torch.Tensor:  # [B, KV, group * T, D] -> [B, T, H * D]
            if batch.view is None:  # the whole cache (a guided separate draft's first step, with its mass)
                return attend_full(query.view(B, H, T, D), index, batch, stack.scale).reshape(B, T, H * D)
            if compact is not None:
                out = kernel.attend_entries(query * stack.scale, k_store[index], v_store[index], batch.slot_tensor,
                                            ends, T, entries)  # [B, KV, group * T, D]
            else:
                positions, valid = batch.view.select(index, query.view(B, H, T, D))  # query heads in order
                out = kernel.attend_positions(query * stack.scale, cache.k[index], cache.v[index],
                                              batch.slot_tensor, ends, T, positions.contiguous(), valid.contiguous())
            return out.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)

        return stack(tokens, batch.positions, batch.slot_tensor, attend, k_store, v_store, rows, last_only=True)


def _fused(modules: list[torch.nn.Linear], dtype: torch.dtype | None) -> Linear:
    """One linear map computing every module's output side by side ([..., in] -> [..., sum of outs]):
    the draft's `dtype` map (`engine.spec.draft.gemms.draft_map`: int8 from the modules' own GGUF
    panels where they keep them, else that dtype's copy of the concatenated weight), or with None the
    model's own weights side by side (`engine.core.lean_forward.side_by_side`: no copy)."""
    if dtype is not None:
        return draft_map(modules, dtype)[0]
    return side_by_side(modules)
