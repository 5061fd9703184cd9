"""The draft step: a lean forward for Llama-family drafts on CPU, or transformers' own forward.

A draft step reads a small compressed view, so once its GEMMs are cheap (int8 or bf16, see
`engine.spec.draft.gemms`) much of what is left is per-operation overhead: transformers' decoder layer
makes many small torch calls (norms in five ops, RoPE by slicing and concatenating, three separate
projections, dtype round trips); on a 2-core CPU a batch-16 int8 draft step takes 30.4 ms that way
and 22.9 ms here over the same view (BENCHMARKS.md, `results/draft_step.json`). `LeanDraft`
runs the same computation for the decoder layers it recognises (`supports`: Llama, Mistral, Qwen2:
pre-norm RMSNorm, RoPE, GQA attention, SiLU-gated MLP, plain `nn.Linear` projections) with fused
q/k/v and gate/up weights in the draft's GEMM dtype and three C++ ops per layer (residual + RMSNorm,
RoPE + K/V write, SiLU x up; `engine/core/csrc/cpu_draft_ops.cpp`), then the engine's attention kernel
over the view: from the cache at the view's positions, or from the compressor's compact bf16 store
(`engine.spec.compressors.compact`) when the view has one, where it also writes its K/V (a forward
without a view, a guided separate draft's first step of a round, reads the whole cache through
`engine.core.attention.attend_full`). RoPE comes from the
model's own rotary module, so its scaling variants are kept. `ModuleDraft` is the fallback for
everything else (other architectures, GPUs, tensor parallelism, where DeepSpeed's sharded layers are
not `nn.Linear`).

Only the draft uses this, and the target checks every draft token: a different rounding here changes
acceptance, never output. Not here: choosing the view (compressors), the target's forward (always
transformers' modules with `engine.attention`).
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.core import kernels as cpu_kernels
from engine.core.attention import ForwardBatch, attend_full
from engine.core.linear import is_plain_linear, linear
from engine.spec.draft.gemms import INT8, DraftGemms, make_linear, resolve_linear_dtype
from engine.spec.compressors.base import Compressor
from engine.core.runner import ModelRunner

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
Linear = Callable[[torch.Tensor], torch.Tensor]


def draft_forward_for(setting: str, runner: ModelRunner, compressor: Compressor, *, extra: int,
                      self_speculation: bool) -> "LeanDraft | ModuleDraft":
    """The draft step for `draft.linear_dtype` = setting: the lean forward where `supports` says so
    (its compressor then keeps a StreamingLLM/SnapKV view in a compact store, before any prefill;
    extra = gamma_max + 1), else transformers' forward with the draft GEMMs switched on."""
    dtype = resolve_linear_dtype(setting, runner.model.dtype, runner.device)
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


def supports(model: torch.nn.Module, cache_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `LeanDraft` computes what transformers' forward of this model computes."""
    config = model.config
    if device.type != "cpu" or cache_dtype != torch.float32 or cpu_kernels.load() is None:
        return False
    if getattr(config, "model_type", None) not in SUPPORTED_TYPES or getattr(config, "hidden_act", None) != "silu":
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(is_plain_linear(m) for m in linears):
            return False
    return is_plain_linear(model.lm_head)


class LeanDraft:
    """The draft's decoder stack with fused projections; a call returns last-position logits."""

    path = "lean"

    def __init__(self, model: torch.nn.Module, gemm_dtype: torch.dtype | None):
        """gemm_dtype: the draft GEMMs' dtype (bf16, int8, ...), or None for the model's own weights."""
        self.model = model
        self.gemm_dtype = dtype_name(gemm_dtype or model.dtype)
        config = model.config
        first = model.model.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scale = first.scaling
        self.eps = config.rms_norm_eps
        self.hidden = config.hidden_size
        self.intermediate = config.intermediate_size
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append({
                "input_norm": layer.input_layernorm.weight.detach().float().contiguous(),
                "qkv": _fused([attn.q_proj, attn.k_proj, attn.v_proj], gemm_dtype),
                "o": _fused([attn.o_proj], gemm_dtype),
                "post_norm": layer.post_attention_layernorm.weight.detach().float().contiguous(),
                "gate_up": _fused([mlp.gate_proj, mlp.up_proj], gemm_dtype),
                "down": _fused([mlp.down_proj], gemm_dtype),
            })
        self.final_norm = model.model.norm.weight.detach().float().contiguous()
        self.lm_head = _fused([model.lm_head], gemm_dtype)
        self.kernel = cpu_kernels.load()

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
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        kernel, cache = self.kernel, batch.cache
        x = self.model.model.embed_tokens(tokens).float().contiguous()  # [B, T, hidden], the residual stream
        cos, sin = self.model.model.rotary_emb(x, batch.positions)  # [B, T, D] each
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        ends = batch.start_tensor + T
        compact = getattr(batch.view, "compact", None)  # the view kept in the draft's own store
        if compact is not None:
            rows = compact.rows_for(batch.positions)  # [B, T]: the new tokens' store entries
            compact.entry_pos[batch.slot_tensor[:, None], rows] = batch.positions
            entries = batch.view.compact_entries()  # [B, S]
            k_store, v_store = compact.k, compact.v
        else:
            rows, k_store, v_store = batch.positions, cache.k, cache.v
        delta = None  # the previous MLP's output, added to x by the next norm
        for index, layer in enumerate(self.layers):
            h = kernel.residual_rms_norm(x, delta, layer["input_norm"], self.eps)
            qkv = layer["qkv"](h).contiguous()  # [B, T, (H + 2 KV) * D]
            # Rotated queries [B, KV, group * T, D]; rotated keys and the values go into the store.
            query = kernel.rope_write(qkv, cos, sin, k_store[index], v_store[index], batch.slot_tensor, rows, H, KV)
            if batch.view is None:  # the whole cache (a guided separate draft's first step, with its mass)
                out = attend_full(query.view(B, H, T, D), index, batch, self.scale).reshape(B, T, H * D)
            elif compact is not None:
                out = kernel.attend_entries(query * self.scale, k_store[index], v_store[index], batch.slot_tensor,
                                            ends, T, entries)  # [B, KV, group * T, D]
            else:
                positions, valid = batch.view.select(index, query.view(B, H, T, D))  # query heads in order
                out = kernel.attend_positions(query * self.scale, cache.k[index], cache.v[index], batch.slot_tensor,
                                              ends, T, positions.contiguous(), valid.contiguous())
            if batch.view is not None:
                out = out.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
            h = kernel.residual_rms_norm(x, layer["o"](out).contiguous(), layer["post_norm"], self.eps)
            delta = layer["down"](kernel.silu_mul(layer["gate_up"](h).contiguous())).contiguous()
        h = kernel.residual_rms_norm(x, delta, self.final_norm, self.eps)[:, -1]  # [B, hidden]
        return self.lm_head(h).float()  # [B, vocab]


def _fused(modules: list[torch.nn.Linear], dtype: torch.dtype | None) -> Linear:
    """One linear map computing every module's output side by side ([..., in] -> [..., sum of outs]).

    With a lower-precision dtype the concatenated weight is that dtype's copy; with None the model's
    own weights are used as they are (no copy), one GEMM per module.
    """
    if dtype is not None:
        weight = torch.cat([m.weight.detach() for m in modules])  # [sum of outs, in]
        biases = [m.bias for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                              for b, m in zip(biases, modules)])
        return make_linear(weight, bias, dtype)
    if len(modules) == 1:
        module = modules[0]
        return lambda x: linear(x, module.weight, module.bias)
    return lambda x: torch.cat([linear(x, m.weight, m.bias) for m in modules], dim=-1)
