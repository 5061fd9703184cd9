"""A model bound to its KV cache: one forward of new tokens for a set of slots.

`ModelRunner` sizes the cache from the model's (rank-local) attention shapes, so it works unchanged on
a tensor-parallel shard, and calls transformers' model with the engine's `ForwardBatch` so that the
registered attention reads and writes that cache. Decode and verification forwards over the whole
cache, and prefill chunks, take the lean stack instead where it computes the same
(`engine.core.lean_forward`: float32 Llama-family models on CPU; `MAGICDEC_LEAN_FORWARD=0` turns it
off); `module_forward` and `module_prefill` are always transformers' modules. It knows nothing about
sampling or scheduling.
"""

from __future__ import annotations

import copy
import os

import torch

from engine.core.attention import BATCH_KWARG, FUSED_MAX_NEW, ForwardBatch, attend_full
from engine.core.lean_forward import LeanStack, stack_for
from engine.core.kv_cache import KVCache
from engine.core.linear import PREFILL, adopt as adopt_engine_linears, engine_forward, keep_gguf_blocks
from engine.core.prefill_attention import PrefillBatch, attend_prefill
from engine.models.loading import LoadedModel

LEAN_SWITCH_ENV = "MAGICDEC_LEAN_FORWARD"  # "0": every forward through transformers' modules


def attention_shapes(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head_dim) as this process holds them (local under TP)."""
    layers = model.model.layers
    attn = layers[0].self_attn
    head_dim = attn.head_dim
    heads = attn.q_proj.weight.shape[0] // head_dim
    kv_heads = attn.k_proj.weight.shape[0] // head_dim
    return len(layers), heads, kv_heads, head_dim


class ModelRunner:
    def __init__(self, loaded: LoadedModel, *, slots: int, capacity: int):
        self.loaded = loaded
        self.model = loaded.model
        adopt_engine_linears(self.model)  # few-row GEMMs by the CPU kernel inside these forwards
        keep_gguf_blocks(self.model, loaded.gguf)  # ...reading the GGUF's 4-bit blocks where it can
        self.layers, self.heads, self.kv_heads, self.head_dim = attention_shapes(self.model)
        self.cache = KVCache(layers=self.layers, slots=slots, kv_heads=self.kv_heads, head_dim=self.head_dim,
                             capacity=capacity, dtype=loaded.dtype, device=loaded.device)

    def with_module(self, module: torch.nn.Module) -> "ModelRunner":
        """A runner of another module tree of the same shapes (a draft's low-precision twin) over this cache."""
        twin = copy.copy(self)
        twin.model = module
        return twin

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def lean_stack(self) -> LeanStack | None:
        """The lean stack this runner's decode forwards take, or None (transformers' modules)."""
        if os.environ.get(LEAN_SWITCH_ENV, "1") == "0" or getattr(self.model, "dtype", None) != torch.float32:
            return None
        return stack_for(self.model, self.cache.k.dtype, self.device)

    def decode_path(self) -> str:
        """Who runs the layers of decode and verification forwards, and of prefill chunks, here (for the
        job report)."""
        if self.lean_stack() is not None:
            return "lean stack (fused CPU ops), prefill chunks too"
        if os.environ.get(LEAN_SWITCH_ENV, "1") == "0":
            return f"transformers modules ({LEAN_SWITCH_ENV}=0)"
        return "transformers modules"

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: ForwardBatch, *, last_only: bool = False) -> torch.Tensor:
        """tokens: [B, T] (row b's go to slot batch.slots[b] from position batch.starts[b]).

        Returns float32 logits [B, T, vocab], or [B, 1, vocab] with last_only.
        """
        B, T = tokens.shape
        if batch.view is None and batch.write_kv and T <= FUSED_MAX_NEW and (lean := self.lean_stack()) is not None:
            H, D = lean.heads, lean.head_dim

            def attend(layer: int, query: torch.Tensor) -> torch.Tensor:  # [B, KV, group * T, D] -> [B, T, H * D]
                return attend_full(query.view(B, H, T, D), layer, batch, lean.scale).reshape(B, T, H * D)

            logits = lean(tokens, batch.positions, batch.slot_tensor, attend, self.cache.k, self.cache.v,
                          batch.positions, last_only=last_only)
            return logits[:, None] if last_only else logits
        return self.module_forward(tokens, batch, last_only=last_only)

    @torch.inference_mode()
    def module_forward(self, tokens: torch.Tensor, batch: ForwardBatch, *, last_only: bool = False) -> torch.Tensor:
        """`forward` through transformers' modules, whatever the lean stack would do (the reference)."""
        with engine_forward():
            out = self.model(input_ids=tokens, position_ids=batch.positions, use_cache=False,
                             logits_to_keep=1 if last_only else 0, **{BATCH_KWARG: batch})
        return out.logits.float()

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, batch: PrefillBatch) -> torch.Tensor:
        """tokens: [N], the packed segments' prompt tokens. Returns float32 logits [S, vocab] of each
        segment's last token. Through the lean stack where decode forwards take it (the packed tokens
        as N rows of one token, each with its own slot and position), else transformers' modules."""
        if (lean := self.lean_stack()) is not None:
            N, H, D = tokens.shape[0], lean.heads, lean.head_dim

            def attend(layer: int, query: torch.Tensor) -> torch.Tensor:  # [N, KV, group, D] -> [N, 1, H * D]
                heads_first = query.view(1, N, H, D).transpose(1, 2)  # [1, H, N, D], transformers' layout
                out = attend_prefill(lean.kernel, heads_first, self.cache.k[layer], self.cache.v[layer], batch,
                                     layer, lean.scale)  # [1, N, H, D]
                return out.view(N, 1, H * D)

            rows = batch.write_positions[:, None]  # [N, 1]
            return lean(tokens[:, None], rows, batch.write_slots, attend, self.cache.k, self.cache.v, rows,
                        last_only=False, keep=batch.last_indices)
        return self.module_prefill(tokens, batch)

    @torch.inference_mode()
    def module_prefill(self, tokens: torch.Tensor, batch: PrefillBatch) -> torch.Tensor:
        """`prefill` through transformers' modules, whatever the lean stack would do (the reference)."""
        with engine_forward(PREFILL):
            out = self.model(input_ids=tokens[None], position_ids=batch.positions, use_cache=False,
                             logits_to_keep=batch.last_indices, **{BATCH_KWARG: batch})
        return out.logits[0].float()
