"""A roofline prior for MagicDec: predicted T_T, T_D, T_V(g), best gamma and speedup at batch B x context L.

`plan(shapes=..., hardware=..., batch=..., context=..., ...)` prices one decode step of the target,
one draft step and one verification forward from a model's shapes and a hardware profile, then hands
those times to the cost model of `engine.gamma` (`best_gamma`, `relative_time`, `expected_tokens`),
the same functions the running job feeds with measured times. Hardware profiles come from
`engine.planning.hardware`.

This module is *not* the CLI (`magicdec plan` formats what `plan` returns; `display_rows` offers the
rows), loads no model and times nothing, except `measure_hardware()`, which says so.

How one forward is priced (per GPU; every byte and FLOP of a tensor-parallel forward is divided by tp).
Kernels of one forward run one after another, so the time is a *sum over phases*, each phase priced
by its own roofline *max*(bytes / bandwidth, FLOPs / FLOP rate) (compute and memory traffic overlap
inside a kernel, not across kernels):

  linear     every linear layer (q, k, v, o, gate, up, down, and the lm_head; embeddings are a lookup
             and are not counted): bytes = params x dtype, FLOPs = 2 x params x B x tokens
  attention  the KV cache read once per forward: B x kv_len x layers x 2 x kv_heads x head_dim x dtype
             bytes, FLOPs = 4 x kv_len x heads x head_dim x layers per token (QK^T and PV)
  logits     the sampler reading the B x tokens x vocab logits in float32 (`SAMPLER_PASSES` passes)
  select     PQCache only, every draft step: the B x L x subspaces codes, the scores, and a radix
             top-k over them, as torch ops or one fused kernel (`pq_search_bytes`, `pq_select_cost`)
  guided     the guided view, once per round (priced into T_V): verification writes each position's
             attention mass per layer and KV head (float32, from the pass that reads the K/V anyway),
             the selection reads it back and runs the same radix top-k, and the compact store takes
             the K/V of the kept entries that changed (`guided_round_cost`); its draft step costs
             what StreamingLLM's and SnapKV's does
  comm       tp > 1: 2 all-reduces per layer of B x tokens x hidden x dtype bytes and one all-gather
             of the logits, each `allreduce_latency_s` + bytes x ring factor / `link_bw`
  fixed      `step_overhead_s` per forward + `layer_latency_s` per layer: the floor a forward pays
             whatever its size (kernel launches and the few microseconds every small kernel takes,
             embedding, norms, host synchronisation). Without it a roofline prices a small draft step
             far below what engines measure; see docs/plan.md.

Bandwidth and FLOP rate are the profile's peaks times `bw_eff` / `flop_eff` (the GPU profiles use 0.8
and 0.4: decode kernels stream at ~0.75-0.85 of peak bandwidth, and decode-sized GEMMs, split 1/tp per
GPU, reach well under the ~0.6-0.7 of peak FLOP/s large GEMMs do). A profile is a plain dict with the
keys of `PROFILE_KEYS`; callers may pass their own.
"""

from __future__ import annotations

import math
from typing import Any

from engine.config.schema import DRAFT_METHODS
from engine.errors import JobError
from engine.models.shapes import kv_bytes_per_token, linear_params, normalize_shapes
from engine.planning.hardware import PROFILE_KEYS
from engine.spec.gamma import best_gamma, expected_tokens, relative_time

SAMPLER_PASSES = 2  # float32 passes the sampler makes over the logits (up-cast + argmax / softmax)
TOPK_PASSES = 4  # reads of the float32 scores by a radix top-k (one per 8-bit digit)
SCORE_BYTES = 4  # PQCache approximate scores and the guided view's attention masses are float32
# Share of a guided view's kept entries that change per round: 0.24-0.25 measured on code prompts
# (bench rows' `view_changed_share`, BENCHMARKS section 11).
GUIDED_CHANGED = 0.25


# --------------------------------------------------------------------------------------------
# Pricing one forward


def _roofline(bytes_: float, flops: float, hw: dict[str, Any]) -> float:
    return max(bytes_ / (hw["mem_bw"] * hw["bw_eff"]), flops / (hw["flops"] * hw["flop_eff"]))


def _collective(bytes_: float, hw: dict[str, Any], factor: float) -> float:
    """One collective: latency + bytes x ring factor / bus bandwidth."""
    return hw["allreduce_latency_s"] + bytes_ * factor / hw["link_bw"]


def forward_cost(shapes: dict[str, Any], hw: dict[str, Any], *, batch: int, tokens: int, kv_len: int,
                 tp: int = 1, dtype_bytes: int = 2) -> dict[str, float]:
    """Seconds per phase (and `total`) of one forward of `tokens` new tokens per row over `kv_len` cached ones."""
    layers, rows = shapes["layers"], batch * tokens
    params = linear_params(shapes)
    linear = _roofline(params * dtype_bytes / tp, 2 * params * rows / tp, hw)
    kv_read = batch * kv_len * kv_bytes_per_token(shapes, dtype_bytes) / tp
    kv_write = rows * kv_bytes_per_token(shapes, dtype_bytes) / tp
    attn_flops = 4 * kv_len * shapes["heads"] * shapes["head_dim"] * layers * rows / tp
    attention = _roofline(kv_read + kv_write, attn_flops, hw)
    logits = _roofline(rows * shapes["vocab"] * 4 * SAMPLER_PASSES, 0.0, hw)
    comm = 0.0
    if tp > 1:
        allreduce = _collective(rows * shapes["hidden"] * dtype_bytes, hw, 2 * (tp - 1) / tp)
        gather = _collective(rows * shapes["vocab"] * dtype_bytes, hw, (tp - 1) / tp)
        comm = 2 * layers * allreduce + gather
    fixed = hw["step_overhead_s"] + layers * hw["layer_latency_s"]
    cost = dict(linear=linear, attention=attention, logits=logits, comm=comm, fixed=fixed)
    cost["total"] = sum(cost.values())
    return cost


def pq_search_bytes(subspaces: int, bits: int, search: str = "torch") -> int:
    """Bytes PQCache's search moves per (row, KV head, cached position, layer), for one draft step.

    "fused" (one kernel reading each code once): the codes (subspaces x ceil(bits / 8) bytes), the
    float32 score written once, and a radix top-k reading the scores `TOPK_PASSES` times.
    "torch" (a sequence of torch ops, as engine/spec/compressors/pqcache.py does it): the codes are read and copied
    (index_select), read again and widened to int64 indices, the gather reads those and writes one
    float32 table entry per code, the sum over sub-spaces reads them back, the mask reads and writes
    the scores, then the same top-k: subspaces x (3 x code bytes + 24) + 12 + 4 x TOPK_PASSES bytes.
    For Llama-3.1-8B (16 sub-spaces, 8 bits) that is 36 vs 460 bytes, against 512 bytes of bf16 K+V.
    """
    code = math.ceil(bits / 8)
    if search == "fused":
        return subspaces * code + SCORE_BYTES * (1 + TOPK_PASSES)
    if search == "torch":
        return subspaces * (3 * code + 8 + 8 + 4 + 4) + 3 * SCORE_BYTES + SCORE_BYTES * TOPK_PASSES
    raise JobError(f"plan: pq_search must be 'torch' or 'fused', got {search!r}")


def pq_select_cost(shapes: dict[str, Any], hw: dict[str, Any], *, batch: int, context: int, tp: int,
                   subspaces: int, bits: int, search: str = "torch") -> dict[str, float]:
    """PQCache's search, paid at every draft step (not once a round): seconds, bytes and FLOPs behind it.

    Per layer and KV head (heads sharded by tp), for B rows over L cached positions: the bytes of
    `pq_search_bytes`; one lookup-add per code (2 FLOPs each, vector work that hides under the memory
    traffic); and the lookup table itself, each group's summed query against 2^bits centroids per
    sub-space, 2 x kv_heads x 2^bits x head_dim FLOPs per row (negligible). Fetching the chosen
    entries' exact K/V is the draft's own `budget`-sized attention read, already in T_D.
    """
    layers, kv_heads = shapes["layers"], shapes["kv_heads"]
    positions = layers * kv_heads * batch * context / tp
    bytes_ = positions * pq_search_bytes(subspaces, bits, search)
    flops = positions * subspaces * 2 + layers * batch * 2 * kv_heads * 2**bits * shapes["head_dim"] / tp
    return dict(seconds=_roofline(bytes_, flops, hw), bytes=bytes_, flops=flops)


def guided_round_cost(shapes: dict[str, Any], hw: dict[str, Any], *, batch: int, context: int, tp: int,
                      budget: int, dtype_bytes: int, changed: float = GUIDED_CHANGED) -> dict[str, float]:
    """The guided view's work per round, beyond a plain verification: seconds, bytes behind it.

    Per layer and KV head (sharded by tp) and row: the L float32 masses written by verification and
    read back by the selection (normalise, top-k: 1 + 1 + TOPK_PASSES passes), and the `changed`
    share of the `budget` kept entries whose K/V are copied (read once, written once).
    """
    layers, kv_heads = shapes["layers"], shapes["kv_heads"]
    planes = layers * kv_heads * batch / tp
    mass = planes * context * SCORE_BYTES * (2 + TOPK_PASSES)
    refill = planes * changed * budget * 2 * shapes["head_dim"] * dtype_bytes * 2  # K and V, read + write
    return dict(seconds=_roofline(mass + refill, 0.0, hw), bytes=mass + refill)


# --------------------------------------------------------------------------------------------
# The plan


def plan(*, shapes: dict, hardware: dict, batch: int, context: int, method: str, budget: int,
         acceptance: float, tp: int = 1, dtype_bytes: int = 2, gamma_max: int = 8,
         draft_shapes: dict | None = None, subspaces: int = 16, bits: int = 8,
         gamma: int | None = None, pq_search: str = "torch") -> dict[str, Any]:
    """Predicted step times and the best gamma (or the given `gamma`) at batch x context.

    `acceptance` is used as the cost model's per-token acceptance probability alpha (Omega uses it);
    a measured `acceptance_rate` (accepted / draft tokens) of a run is close to it for small gamma but
    not equal (with i.i.d. acceptance, rate = (Omega - 1) / gamma). `draft_shapes` = None means
    self-speculation (the target's weights reading `budget` KV entries per row); otherwise the draft
    model, sharded over min(tp, its KV heads) GPUs, reads `budget` entries of its own KV.
    `gamma` = None picks the best gamma in 0..gamma_max; an int evaluates that gamma as given.
    `pq_search` prices PQCache's per-step search as this engine's torch ops ("torch") or as one fused
    kernel ("fused"); see `pq_search_bytes`.
    """
    shapes = normalize_shapes(shapes)
    missing = [key for key in PROFILE_KEYS if key not in hardware]
    if missing:
        raise JobError(f"plan: hardware profile lacks {', '.join(missing)} (see engine.planning.hardware.PROFILE_KEYS)")
    if method not in DRAFT_METHODS:
        raise JobError(f"plan: method must be one of {', '.join(DRAFT_METHODS)}, got {method!r}")
    for key, value, low in (("batch", batch, 1), ("context", context, 1), ("budget", budget, 1), ("tp", tp, 1),
                            ("dtype_bytes", dtype_bytes, 1), ("gamma_max", gamma_max, 1)):
        if not isinstance(value, int) or value < low:
            raise JobError(f"plan: '{key}' must be an integer >= {low}, got {value!r}")
    if not 0.0 <= acceptance < 1.0:
        raise JobError(f"plan: acceptance must be in [0, 1), got {acceptance!r}")
    if pq_search not in ("torch", "fused"):
        raise JobError(f"plan: pq_search must be 'torch' or 'fused', got {pq_search!r}")
    if gamma is not None and (not isinstance(gamma, int) or gamma < 0):
        raise JobError(f"plan: gamma must be an integer >= 0 (or None for the best), got {gamma!r}")

    target = forward_cost(shapes, hardware, batch=batch, tokens=1, kv_len=context, tp=tp, dtype_bytes=dtype_bytes)
    if draft_shapes is None:
        draft_model, draft_tp = shapes, tp
    else:
        draft_model = normalize_shapes(draft_shapes)
        draft_tp = max(1, min(tp, draft_model["kv_heads"]))
    draft = forward_cost(draft_model, hardware, batch=batch, tokens=1, kv_len=min(budget, context),
                         tp=draft_tp, dtype_bytes=dtype_bytes)
    select = dict(seconds=0.0, bytes=0.0, flops=0.0)
    if method == "pqcache" and context > budget:
        select = pq_select_cost(draft_model, hardware, batch=batch, context=context, tp=draft_tp,
                                subspaces=subspaces, bits=bits, search=pq_search)
    t_target = target["total"]
    t_draft = draft["total"] + select["seconds"]

    top = max(gamma_max, gamma or 0)
    verify = {g: forward_cost(shapes, hardware, batch=batch, tokens=g + 1, kv_len=context, tp=tp,
                              dtype_bytes=dtype_bytes) for g in range(1, top + 1)}
    guided = 0.0
    if method == "guided":  # the view's re-selection after each verification
        guided = guided_round_cost(draft_model, hardware, batch=batch, context=context, tp=draft_tp,
                                   budget=min(budget, context), dtype_bytes=dtype_bytes)["seconds"]
        for cost in verify.values():
            cost["guided"] = guided
            cost["total"] += guided
    speedups = [1.0 / relative_time(g, acceptance, t_draft, verify[g]["total"], t_target)
                for g in range(1, top + 1)]
    if method == "none":
        chosen, speedup = 0, 1.0
    elif gamma is None:
        chosen, speedup = best_gamma(acceptance, t_draft, lambda g: verify[g]["total"], t_target, gamma_max)
    else:
        chosen = gamma
        speedup = 1.0 / relative_time(gamma, acceptance, t_draft, verify[gamma]["total"], t_target) if gamma else 1.0
    shown = max(chosen, 1)

    def ms(cost: dict[str, float]) -> dict[str, float]:
        return {k: v * 1e3 for k, v in cost.items()}

    return dict(
        gamma=chosen,
        gamma_fixed=gamma is not None,
        predicted_speedup=speedup,
        acceptance=acceptance,
        expected_tokens=expected_tokens(chosen, acceptance),
        # what a run's report would show as acceptance_rate (accepted / draft tokens) at this gamma
        expected_acceptance_rate=(expected_tokens(shown, acceptance) - 1) / shown,
        t_target_ms=t_target * 1e3,
        t_draft_ms=t_draft * 1e3,
        t_select_ms=select["seconds"] * 1e3,
        t_round_select_ms=guided * 1e3,  # guided: the re-selection per round, included in t_verify_ms
        t_verify_ms=verify[shown]["total"] * 1e3,
        gammas=list(range(1, top + 1)),
        t_verify_ms_by_gamma=[verify[g]["total"] * 1e3 for g in range(1, top + 1)],
        speedup_by_gamma=speedups,
        breakdown_ms=dict(target=ms(target), draft=ms(draft), verify=ms(verify[shown])),
        target_bound=_bound(shapes, hardware, batch=batch, tokens=1, kv_len=context, tp=tp, dtype_bytes=dtype_bytes),
        kv_share=target["attention"] / t_target,
        hardware=dict(hardware),
        inputs=dict(shapes=shapes, draft_shapes=None if draft_shapes is None else draft_model, batch=batch,
                    context=context, method=method, budget=budget, tp=tp, draft_tp=draft_tp,
                    dtype_bytes=dtype_bytes, gamma_max=gamma_max, gamma=gamma, subspaces=subspaces, bits=bits,
                    pq_search=pq_search),
    )


def _bound(shapes, hw, *, batch, tokens, kv_len, tp, dtype_bytes) -> str:
    """Whether the target's decode step is memory- or compute-bound, over its linear + attention work."""
    params = linear_params(shapes)
    bytes_ = (params + batch * kv_len * kv_bytes_per_token(shapes, 1)) * dtype_bytes / tp
    flops = (2 * params + 4 * kv_len * shapes["heads"] * shapes["head_dim"] * shapes["layers"]) * batch * tokens / tp
    memory = bytes_ / (hw["mem_bw"] * hw["bw_eff"])
    compute = flops / (hw["flops"] * hw["flop_eff"])
    return "memory" if memory >= compute else "compute"
