"""Hardware profiles for the roofline: built-in GPUs (A100, H100, H200, L40) and this machine, measured.

A profile is a plain dict with the keys of `PROFILE_KEYS`: peak memory bandwidth and FLOP rate, the
efficiencies reached of them, tensor-parallel link bandwidth and latency, and the fixed per-layer
and per-forward costs (see `engine.planning.roofline`). `measure_hardware()` times this machine in
a few seconds; `read_bandwidth()` is the bandwidth probe `bench` takes beside each figure.
"""

from __future__ import annotations

import difflib
import math
import time
from typing import Any

import torch

from engine.errors import JobError

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


def read_bandwidth(device: torch.device, repeats: int = 7) -> float:
    """Bytes/s of the median of `repeats` sums of a 512 MiB float32 tensor (all threads / the GPU).

    The median, not the best: on a shared VM single readings swing by 2x from one second to the next.
    """
    big = torch.ones(128 * 1024 * 1024, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    big.sum()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        big.sum()
        sync()
        times.append(time.perf_counter() - t0)
    return big.numel() * 4 / sorted(times)[repeats // 2]
