"""What one decode step's linear layers cost on this CPU, in float32, bfloat16 and int8.

Not a test: the figures behind BENCHMARKS.md's GEMM statements. For the default model's shapes at
M rows (the batch), it times every linear layer of one step (30 x q/k/v/o/gate/up/down + lm_head)
with distinct weight tensors, so the weights come from memory as in a real step, in float32 (torch's
GEMM, and the engine's `engine.core.linear.linear`, which takes the fused kernel's `small_linear` up
to `max_rows()` rows), in bfloat16 and as the draft's int8 linear maps (`make_linear`, fp32 in and out);
the lm_head alone both ways; and the fp32 GFLOP/s of a single layer repeated with warm caches.
--rows takes a comma-separated list (one result per M). Writes JSON.

    .venv/bin/python benchmarks/gemm_bench.py --rows 1,4,13,16,32,64,128,192 --out benchmarks/results/gemm_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.core.linear import linear as engine_linear
from engine.spec.draft.gemms import INT8, int8_supported, make_linear

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocab 49152, 30 layers.
LAYER_SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576),
                "gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}  # (out, in)
LAYERS, LM_HEAD = 30, (49152, 576)


def step_seconds(rows: int, dtype: torch.dtype | str, repeats: int = 3, shapes=None) -> float:
    """Best time of one step's linear layers, every weight distinct (read from memory); dtype
    "engine": float32 through the engine's `linear`."""
    shapes = shapes or [shape for _ in range(LAYERS) for shape in LAYER_SHAPES.values()] + [LM_HEAD]
    if dtype == INT8:  # the draft's int8 maps: fp32 activations in, quantised per call, fp32 out
        maps = [(make_linear(torch.randn(shape), None, INT8), shape[1]) for shape in shapes]
        inputs = {i: torch.randn(rows, i) for _, i in maps}  # [rows, in]
    else:
        gemm, dtype = (engine_linear, torch.float32) if dtype == "engine" else (F.linear, dtype)
        maps = [((lambda x, w=torch.randn(shape).to(dtype): gemm(x, w)), shape[1]) for shape in shapes]
        inputs = {i: torch.randn(rows, i).to(dtype) for _, i in maps}
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for linear, width in maps:
            linear(inputs[width])
        best = min(best, time.perf_counter() - start)
    return best


def warm_gflops(rows: int, shape=(1536, 576), calls: int = 200) -> float:
    """fp32 GFLOP/s of one layer's GEMM repeated with its weight in cache."""
    w, x = torch.randn(shape), torch.randn(rows, shape[1])
    F.linear(x, w)
    start = time.perf_counter()
    for _ in range(calls):
        F.linear(x, w)
    return 2 * rows * shape[0] * shape[1] * calls / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16", help="comma-separated row counts")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gemm_cpu.json"))
    args = parser.parse_args()
    results = [one_row_count(int(rows)) for rows in args.rows.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def one_row_count(rows: int) -> dict:
    fp32, engine = step_seconds(rows, torch.float32), step_seconds(rows, "engine")
    bf16 = step_seconds(rows, torch.bfloat16)
    int8 = step_seconds(rows, INT8) if int8_supported() else None
    head_fp32, head_engine = (step_seconds(rows, kind, shapes=[LM_HEAD]) for kind in (torch.float32, "engine"))
    params = LAYERS * sum(o * i for o, i in LAYER_SHAPES.values()) + LM_HEAD[0] * LM_HEAD[1]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "rows": rows,
        "step_linear_ms": {"float32": 1e3 * fp32, "float32_engine": 1e3 * engine, "bfloat16": 1e3 * bf16,
                           "int8": 1e3 * int8 if int8 is not None else None},
        "lm_head_ms": {"float32": 1e3 * head_fp32, "float32_engine": 1e3 * head_engine},
        "engine_speedup_float32": fp32 / engine,
        "step_gflops_float32": 2 * rows * params / fp32 / 1e9,
        "step_gflops_float32_engine": 2 * rows * params / engine / 1e9,
        "warm_gate_proj_gflops_float32": warm_gflops(rows),
    }


if __name__ == "__main__":
    main()
