"""A Llama-family decoder stack in a few fused CPU ops per layer, for decode forwards and prefill chunks.

transformers' decoder layer makes many small torch calls per layer (norms in five ops, RoPE by
slicing and concatenating, three separate projections, the K/V write by index_put, dtype round trips).
A decode step of ~13 rows spent ~30-40 ms of a ~170 ms step on them on a 2-core CPU (BENCHMARKS.md
section 13). `LeanStack` runs the same computation with q|k|v and gate|up each one GEMM call and
three C++ ops per layer (`engine/core/csrc/cpu_draft_ops.cpp`: residual + RMSNorm, RoPE + K/V
write, SiLU x up), and lets its caller choose the attention and where the K/V go. Its callers:
- `ModelRunner.forward` (the target's decode and verification forwards, float32 on CPU): the whole
  cache through `engine.core.attention.attend_full` (shared-prefix reads and the guided draft's
  attention mass included), the K/V written into the cache.
- the lean draft (`engine.spec.draft.forward`): a compressed view, perhaps in its own compact store,
  with its GEMMs perhaps in bfloat16 or int8.

`supports` says which models it computes exactly what transformers computes for (pre-norm RMSNorm,
RoPE from the model's own rotary module, GQA attention, SiLU-gated MLP, plain `nn.Linear`
projections: Llama, Mistral, Qwen2); everything else (other architectures, GPUs, tensor-parallel
shards, bfloat16 models) keeps transformers' modules. A third caller, `ModelRunner.prefill`, runs
packed prefill chunks through it as N rows of one token (each its own slot and position, the
prefill attention over the segments, the logits of the segments' last tokens only). Not here:
which positions a draft reads, sampling.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from engine.core import kernels as cpu_kernels
from engine.core.linear import is_plain_linear, linear_map

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
Linear = Callable[[torch.Tensor], torch.Tensor]  # [..., in] -> [..., out]
# attend(layer, query [B, kv_heads, group * T, D], rotated and unscaled) -> [B, T, heads * D]
Attend = Callable[[int, torch.Tensor], torch.Tensor]


def supports(model: torch.nn.Module, cache_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `LeanStack` computes what transformers' forward of this model computes."""
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


def side_by_side(modules: list[torch.nn.Linear]) -> Linear:
    """One float32 linear map computing every module's output side by side, from the modules' own
    weights (`engine.core.linear.linear_map`: one kernel call, no concatenated copy of them; their
    GGUF blocks where the model runner kept them, which it does before any stack is built)."""
    return linear_map(modules)


class LeanStack:
    """The decoder stack of one model, q|k|v and gate|up each one linear map; a call runs a forward
    of T new tokens per row and returns float32 logits."""

    def __init__(self, model: torch.nn.Module, fuse: Callable[[list[torch.nn.Linear]], Linear] = side_by_side):
        """fuse: builds one linear map from modules side by side (the draft's lower-precision copies,
        or `side_by_side` over the model's own float32 weights)."""
        self.model = model
        config = model.config
        first = model.model.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scale = first.scaling
        self.eps = config.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append({
                "input_norm": layer.input_layernorm.weight.detach().float().contiguous(),
                "qkv": fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                "o": fuse([attn.o_proj]),
                "post_norm": layer.post_attention_layernorm.weight.detach().float().contiguous(),
                "gate_up": fuse([mlp.gate_proj, mlp.up_proj]),
                "down": fuse([mlp.down_proj]),
            })
        self.final_norm = model.model.norm.weight.detach().float().contiguous()
        self.lm_head = fuse([model.lm_head])
        self.kernel = cpu_kernels.load()

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attend: Attend,
                 k_store: torch.Tensor, v_store: torch.Tensor, rows: torch.Tensor, *,
                 last_only: bool, keep: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [B, T] (positions drive RoPE); slots: [B]; the rotated keys and the
        values of layer l go into k_store[l] / v_store[l] ([slots, kv_heads, rows, D]) at
        (slots[b], rows[b, t]). Returns logits [B, T, vocab], or [B, vocab] of each row's last token
        with last_only, or [K, vocab] of the tokens `keep` [K] lists (indices into the B * T tokens,
        row-major) (float32)."""
        B, T = tokens.shape
        kernel = self.kernel
        x = self.model.model.embed_tokens(tokens).float().contiguous()  # [B, T, hidden], the residual stream
        cos, sin = self.model.model.rotary_emb(x, positions)  # [B, T, D] each
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        delta = None  # the previous MLP's output, added to x by the next norm
        for index, layer in enumerate(self.layers):
            h = kernel.residual_rms_norm(x, delta, layer["input_norm"], self.eps)
            qkv = layer["qkv"](h).contiguous()  # [B, T, (H + 2 KV) * D]
            # Rotated queries [B, KV, group * T, D]; the rotated keys and the values go into the store.
            query = kernel.rope_write(qkv, cos, sin, k_store[index], v_store[index], slots, rows,
                                      self.heads, self.kv_heads)
            out = attend(index, query)  # [B, T, H * D]
            h = kernel.residual_rms_norm(x, layer["o"](out).contiguous(), layer["post_norm"], self.eps)
            delta = layer["down"](kernel.silu_mul(layer["gate_up"](h).contiguous())).contiguous()
        if keep is not None:
            x, delta = x.flatten(0, 1)[keep], delta.flatten(0, 1)[keep]  # [K, hidden]
        elif last_only:
            x, delta = x[:, -1].contiguous(), delta[:, -1].contiguous()  # [B, hidden]
        h = kernel.residual_rms_norm(x, delta, self.final_norm, self.eps)
        return self.lm_head(h).float()  # [B, T, vocab], [B, vocab] or [K, vocab]


_STACKS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def stack_for(model: torch.nn.Module, cache_dtype: torch.dtype, device: torch.device) -> LeanStack | None:
    """The model's float32 lean stack where `supports` holds (one per model and cache dtype, built on
    first use and shared by every engine over the model), else None. Kept beside the model, not in
    it, so that the model still deep-copies."""
    made = _STACKS.setdefault(model, {})
    key = (cache_dtype, device.type)
    if key not in made:
        made[key] = LeanStack(model) if supports(model, cache_dtype, device) else None
    return made[key]
