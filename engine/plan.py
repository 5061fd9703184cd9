"""A roofline prior for MagicDec: predicted T_T, T_D, T_V(g), best gamma and speedup at batch B x context L.

`plan(shapes=..., hardware=..., batch=..., context=..., ...)` prices one decode step of the target,
one draft step and one verification forward from a model's shapes and a hardware profile, then hands
those times to the cost model of `engine.gamma` (`best_gamma`, `relative_time`, `expected_tokens`),
the same functions the running job feeds with measured times. `hardware_profile(name)` gives the
built-in GPU profiles or, with "measure", `measure_hardware()`'s numbers for this machine.

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

import argparse
import difflib
import math
import time
from typing import Any

from engine.errors import JobError
from engine.gamma import best_gamma, expected_tokens, relative_time

SAMPLER_PASSES = 2  # float32 passes the sampler makes over the logits (up-cast + argmax / softmax)
TOPK_PASSES = 4  # reads of the float32 scores by a radix top-k (one per 8-bit digit)
SCORE_BYTES = 4  # PQCache approximate scores are float32
METHODS = ("none", "streamingllm", "snapkv", "pqcache")
PROFILE_KEYS = ("name", "mem_bw", "flops", "bw_eff", "flop_eff", "link_bw", "allreduce_latency_s",
                "layer_latency_s", "step_overhead_s")

# Peak numbers: memory bandwidth (B/s), dense bf16 tensor-core FLOP/s, NVLink/PCIe all-reduce bus
# bandwidth (B/s, as nccl-tests reports "busbw"), all-reduce latency. The efficiencies and fixed
# latencies are ours (module docstring, docs/plan.md): bw_eff 0.8, flop_eff 0.4; layer_latency_s
# 100 us (~10 kernels of ~10 us each: norms, rotary, cache write, attention, activation, residuals)
# and step_overhead_s 2 ms (embedding, sampling, host synchronisation), round values within what
# engines pay and chosen so that the paper's 8xA100 cells come out right (docs/plan.md): these fixed
# costs are what makes a 4K-context draft step cost ~0.9 of a target step.
_GPU_COMMON = dict(device="cuda", bw_eff=0.8, flop_eff=0.4, layer_latency_s=100e-6, step_overhead_s=2e-3)
HARDWARE: dict[str, dict[str, Any]] = {
    "a100": dict(_GPU_COMMON, name="A100-80GB", mem_bw=2.0e12, flops=312e12, link_bw=300e9,
                 allreduce_latency_s=20e-6),
    "h100": dict(_GPU_COMMON, name="H100-SXM", mem_bw=3.35e12, flops=989e12, link_bw=450e9,
                 allreduce_latency_s=15e-6),
    "h200": dict(_GPU_COMMON, name="H200", mem_bw=4.8e12, flops=989e12, link_bw=450e9,
                 allreduce_latency_s=15e-6),
    # No NVLink on L40: all-reduces go over PCIe 4.0 (~25 GB/s effective) with a higher latency.
    "l40": dict(_GPU_COMMON, name="L40", mem_bw=0.864e12, flops=181e12, link_bw=25e9,
                allreduce_latency_s=40e-6),
}
ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100", "cpu": "measure"}


# --------------------------------------------------------------------------------------------
# Hardware


def hardware_profile(name: str) -> dict[str, Any]:
    """A copy of a built-in profile (a100, h100, h200, l40; case-insensitive) or "measure" (this machine)."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key == "measure":
        return measure_hardware()
    if key not in HARDWARE:
        choices = [*HARDWARE, "measure"]
        close = difflib.get_close_matches(key, choices, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise JobError(f"hardware: unknown profile '{name}'{hint}; choose one of {', '.join(choices)}")
    return dict(HARDWARE[key])


def measure_hardware(*, seconds_hint: float = 3.0) -> dict[str, Any]:
    """Measure this machine in a few seconds with torch (CPU): read bandwidth, fp32 matmul rate, op latency.

    - memory bandwidth: the best of several `sum()`s of a 512 MiB float32 tensor on all threads;
    - FLOP/s: the best of a few 2048^3 float32 matmuls;
    - op latency: the mean time of a tiny in-place add (eager dispatch), from which the fixed costs
      are derived: `layer_latency_s` = 25 ops (a transformers Llama layer runs about that many),
      `step_overhead_s` = 200 ops (embedding, final norm, sampling, Python between forwards).
    The numbers are what this machine *achieves*, so the efficiencies are 1. The all-reduce terms
    (CPU tensor parallel goes through gloo over shared memory) are rough guesses: bus bandwidth a
    quarter of the read bandwidth, 100 us latency. `seconds_hint` caps the repeat loops.
    """
    import torch

    threads = torch.get_num_threads()
    deadline = time.perf_counter() + seconds_hint

    big = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # 512 MiB
    big.sum()  # touch the pages once
    best_sum = math.inf
    for i in range(6):
        start = time.perf_counter()
        big.sum()
        best_sum = min(best_sum, time.perf_counter() - start)
        if i >= 2 and time.perf_counter() > deadline - 1.5:
            break
    mem_bw = big.numel() * big.element_size() / best_sum
    del big

    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best_mm = math.inf
    for i in range(4):
        start = time.perf_counter()
        a @ b
        best_mm = min(best_mm, time.perf_counter() - start)
        if i >= 1 and time.perf_counter() > deadline - 0.5:
            break
    flops = 2 * n**3 / best_mm

    tiny = torch.zeros(8)
    reps = 2000
    start = time.perf_counter()
    for _ in range(reps):
        tiny.add_(1.0)
    op_latency = (time.perf_counter() - start) / reps

    return dict(name=f"cpu ({threads} threads, measured)", device="cpu", threads=threads, measured=True,
                mem_bw=mem_bw, flops=flops, bw_eff=1.0, flop_eff=1.0,
                link_bw=mem_bw / 4, allreduce_latency_s=100e-6,
                layer_latency_s=25 * op_latency, step_overhead_s=200 * op_latency)


# --------------------------------------------------------------------------------------------
# Shapes


def shapes_for(name: str) -> dict[str, Any]:
    """`model_shapes`-style numbers of a built-in shape (engine.models.MODEL_SHAPES), without transformers."""
    from engine.models import MODEL_SHAPES

    key = name[: -len("-shape")] if name.endswith("-shape") else name
    if key not in MODEL_SHAPES:
        raise JobError(f"model shapes: unknown '{name}'; built-in: {', '.join(MODEL_SHAPES)}")
    return normalize_shapes(MODEL_SHAPES[key])


def normalize_shapes(shapes: dict[str, Any]) -> dict[str, Any]:
    """Accept `engine.models.model_shapes()` output or a Hugging Face config mapping (`hidden_size`, ...)."""
    if "hidden" in shapes:
        out = dict(shapes)
    else:
        heads = shapes["num_attention_heads"]
        out = dict(layers=shapes["num_hidden_layers"], hidden=shapes["hidden_size"],
                   intermediate=shapes["intermediate_size"], heads=heads,
                   kv_heads=shapes.get("num_key_value_heads") or heads,
                   head_dim=shapes.get("head_dim") or shapes["hidden_size"] // heads,
                   vocab=shapes["vocab_size"], tied_embeddings=bool(shapes.get("tie_word_embeddings", False)))
    out.setdefault("kv_heads", out["heads"])
    out.setdefault("head_dim", out["hidden"] // out["heads"])
    for key in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
        if not isinstance(out.get(key), int) or out[key] < 1:
            raise JobError(f"model shapes: '{key}' must be a positive integer, got {out.get(key)!r}")
    return out


def linear_params(shapes: dict[str, Any]) -> int:
    """Parameters every decode step multiplies by: all linear layers and the lm_head (tied or not)."""
    h, d, q, kv = shapes["hidden"], shapes["head_dim"], shapes["heads"], shapes["kv_heads"]
    attention = h * q * d + 2 * h * kv * d + q * d * h  # q, k, v, o projections
    mlp = 3 * h * shapes["intermediate"]  # gate, up, down
    return shapes["layers"] * (attention + mlp) + h * shapes["vocab"]


def kv_bytes_per_token(shapes: dict[str, Any], dtype_bytes: int) -> int:
    """KV-cache bytes one token occupies across all layers (K and V)."""
    return shapes["layers"] * 2 * shapes["kv_heads"] * shapes["head_dim"] * dtype_bytes


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
    "torch" (a sequence of torch ops, as engine/kv/pqcache.py does it): the codes are read and copied
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
        raise JobError(f"plan: hardware profile lacks {', '.join(missing)} (see engine.plan.PROFILE_KEYS)")
    if method not in METHODS:
        raise JobError(f"plan: method must be one of {', '.join(METHODS)}, got {method!r}")
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


def display_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows for a terminal table of one plan (what `magicdec plan` might print)."""
    gamma = result["gamma"]
    verdict = "speculate" if gamma else "decode plainly (speculation does not pay)"
    rows = [
        ("gamma", f"{gamma}{' (fixed)' if result['gamma_fixed'] else ''}: {verdict}"),
        ("predicted speedup", f"{result['predicted_speedup']:.2f}x"),
        ("acceptance (alpha)", f"{result['acceptance']:.2f} -> {result['expected_tokens']:.2f} tokens/round"),
        ("T_T target step", f"{result['t_target_ms']:.2f} ms ({result['target_bound']}-bound, "
                            f"KV {100 * result['kv_share']:.0f}%)"),
        ("T_D draft step", f"{result['t_draft_ms']:.2f} ms ({result['t_draft_ms'] / result['t_target_ms']:.2f} T_T"
                           + (f", search {result['t_select_ms']:.2f} ms)" if result["t_select_ms"] else ")")),
        (f"T_V verify (g={max(gamma, 1)})", f"{result['t_verify_ms']:.2f} ms "
                                            f"({result['t_verify_ms'] / result['t_target_ms']:.2f} T_T)"),
        ("speedup by gamma", " ".join(f"{g}:{s:.2f}" for g, s in zip(result["gammas"], result["speedup_by_gamma"]))),
    ]
    return rows


# --------------------------------------------------------------------------------------------
# The paper check (docs/plan.md): Llama-3.1-8B, tp 8, StreamingLLM self-speculation with budget 512.

# Acceptance of that draft on PG-19 by prefill length, as the authors' project page lists it
# (github.com/Infini-AI-Lab/MagicDec, index.html, "Choice of Drafts").
ACCEPTANCE_PG19 = {4000: 0.84, 8000: 0.83, 16000: 0.82, 32000: 0.81, 64000: 0.79, 100000: 0.79}

# Each check: (title, hardware, gamma (None = best), cells). A cell is (context, batch, paper low,
# paper high, paper's gamma); low = high for a single figure, None where the paper gives no number.
# The gamma-2 ranges come from docs/magicdec.md, which does not say which batch gives which end, so
# every cell of a range is compared with the whole range (error 0 inside it).
PAPER_CHECKS = [
    ("8xA100, gamma 2 (paper, Table 3)", "a100", 2, [
        *((4000, b, 0.76, 0.90, 2) for b in (32, 64, 128, 256)),
        *((8000, b, None, None, 2) for b in (32, 64, 128)),
        *((16000, b, None, None, 2) for b in (32, 64, 128)),
        *((32000, b, 1.22, 1.35, 2) for b in (32, 64, 128)),
        (64000, 32, None, None, 2),
        (100000, 32, 1.64, 1.64, 2),
    ]),
    ("8xA100, best gamma (authors' project page)", "a100", None, [
        (32000, 32, 1.22, 1.22, 3), (32000, 64, 1.38, 1.38, 3), (32000, 128, 1.47, 1.47, 4),
    ]),
    ("8xH100, best gamma (paper, via docs/magicdec.md)", "h100", None, [
        (32000, 16, 1.08, 1.08, None), (32000, 32, 1.26, 1.26, None), (32000, 64, 1.55, 1.55, None),
        (32000, 128, 1.85, 1.85, None),
    ]),
]


def _paper_plan(hw: dict[str, Any], *, batch: int, context: int, gamma: int | None) -> dict[str, Any]:
    return plan(shapes=shapes_for("llama-3.1-8b"), hardware=hw, batch=batch, context=context,
                method="streamingllm", budget=512, acceptance=ACCEPTANCE_PG19[context], tp=8, gamma=gamma)


def _bare(hw: dict[str, Any]) -> dict[str, Any]:
    """The same profile with every fixed latency set to zero: the pure roofline."""
    return dict(hw, layer_latency_s=0.0, step_overhead_s=0.0, allreduce_latency_s=0.0)


def paper_rows(check: int = 0, hardware: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One check of PAPER_CHECKS: prediction, pure roofline (no fixed costs), paper figure, relative error."""
    _, hw_name, gamma, cells = PAPER_CHECKS[check]
    hw = hardware or hardware_profile(hw_name)
    rows = []
    for context, batch, low, high, paper_gamma in cells:
        full = _paper_plan(hw, batch=batch, context=context, gamma=gamma)
        pure = _paper_plan(_bare(hw), batch=batch, context=context, gamma=gamma)
        predicted = full["predicted_speedup"]
        error = None
        if low is not None:
            nearest = min(max(predicted, low), high)
            error = (predicted - nearest) / nearest
        rows.append(dict(context=context, batch=batch, acceptance=full["acceptance"], gamma=full["gamma"],
                         paper_gamma=paper_gamma, paper_low=low, paper_high=high, predicted=predicted,
                         roofline_only=pure["predicted_speedup"], error=error, t_target_ms=full["t_target_ms"],
                         td_over_tt=full["t_draft_ms"] / full["t_target_ms"],
                         tv_over_tt=full["t_verify_ms"] / full["t_target_ms"]))
    return rows


def paper_table_markdown(check: int = 0, hardware: dict[str, Any] | None = None) -> str:
    """One check of PAPER_CHECKS as the Markdown table docs/plan.md shows."""
    lines = ["| context | batch | alpha | gamma (paper) | paper | predicted | rel. error | roofline only | T_T ms "
             "| T_D/T_T | T_V/T_T |",
             "| ---: | ---: | ---: | :---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in paper_rows(check, hardware):
        if r["paper_low"] is None:
            paper, error = "-", "-"
        else:
            same = r["paper_low"] == r["paper_high"]
            paper = f"{r['paper_low']:.2f}" if same else f"{r['paper_low']:.2f}-{r['paper_high']:.2f}"
            error = f"{100 * r['error']:+.0f}%"
        paper_gamma = "?" if r["paper_gamma"] is None else r["paper_gamma"]
        lines.append(f"| {r['context']} | {r['batch']} | {r['acceptance']:.2f} | {r['gamma']} ({paper_gamma}) | "
                     f"{paper} | {r['predicted']:.2f} | {error} | {r['roofline_only']:.2f} | {r['t_target_ms']:.1f} | "
                     f"{r['td_over_tt']:.2f} | {r['tv_over_tt']:.2f} |")
    return "\n".join(lines)


def paper_tables_markdown() -> str:
    """Every check of PAPER_CHECKS, titled: the tables of docs/plan.md."""
    parts = []
    for index, (title, hw_name, _, _) in enumerate(PAPER_CHECKS):
        profile = hardware_profile(hw_name)["name"]
        parts.append(f"**Llama-3.1-8B, {title}**, StreamingLLM-512 self-speculation, tp 8, profile {profile}:\n\n"
                     + paper_table_markdown(index))
    return "\n\n".join(parts)


# (method, budget, alpha, pq_search) for `methods_table_markdown`: illustrative acceptances (PQCache
# the highest, as on the paper's needle tasks), not measured ones.
METHOD_CASES = [("streamingllm", 512, 0.80, "torch"), ("snapkv", 2048, 0.88, "torch"),
                ("pqcache", 2048, 0.95, "torch"), ("pqcache", 2048, 0.95, "fused")]


def methods_table_markdown(hardware: str = "h100", tp: int = 8, context: int = 32000,
                           batches: tuple[int, ...] = (1, 4, 16, 64, 128)) -> str:
    """Best gamma / speedup of each compressor by batch (Llama-3.1-8B), showing PQCache's search cost."""
    hw = hardware_profile(hardware)
    header = "| method | budget | alpha | " + " | ".join(f"B={b}" for b in batches) + " |"
    lines = [header, "| --- | ---: | ---: |" + " ---: |" * len(batches)]
    for method, budget, alpha, search in METHOD_CASES:
        cells = []
        for batch in batches:
            r = plan(shapes=shapes_for("llama-3.1-8b"), hardware=hw, batch=batch, context=context, method=method,
                     budget=budget, acceptance=alpha, tp=tp, pq_search=search)
            search_share = r["t_select_ms"] / r["t_draft_ms"]
            cells.append(f"g={r['gamma']} {r['predicted_speedup']:.2f}x"
                         + (f" ({100 * search_share:.0f}% search)" if method == "pqcache" else ""))
        label = f"{method} ({search} search)" if method == "pqcache" else method
        lines.append(f"| {label} | {budget} | {alpha:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--paper-table", action="store_true",
                        help="print the Markdown tables of docs/plan.md (predictions beside the paper's figures)")
    parser.add_argument("--methods-table", action="store_true",
                        help="print docs/plan.md's compressor comparison (8xH100, 32K, by batch)")
    args = parser.parse_args(argv)
    if args.paper_table:
        print(paper_tables_markdown())
    if args.methods_table:
        print(methods_table_markdown())
    if not (args.paper_table or args.methods_table):
        parser.print_help()


if __name__ == "__main__":
    main()
