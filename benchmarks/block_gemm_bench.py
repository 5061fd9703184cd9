"""One decode step's GEMMs of the default model read from its GGUF blocks against its float32 weights.

Not a test: a micro-benchmark behind BENCHMARKS.md sections 19, 21, 29 and 30. It loads the default
model as the engine does (`ModelRunner` keeps the GGUF's blocks), then times the few-row kernel over
the 210 layer linears (Q4_1; with --fused in the lean stack's 120 calls, q|k|v and gate|up side by
side) and the lm_head (Q8_0) at M rows, each call reading the blocks, against the same calls reading
the float32 weights (and torch's own GEMM over them, `torch_ms`, which the engine takes above the
kernel's row limit); where the blocks are kept as 16-output panels (AVX-512), it times the panels too
(by AVX-512 FMAs, and by the AMX tiles where the kernel has them) and the same blocks read one output
at a time. All are timed in turn, --repeats rounds, median of each. It asserts that blocks read one
output at a time give the float32 kernel's bits, and that panels (both ways) agree with them to
float32 rounding. Writes JSON.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/block_gemm_bench.py --rows 1,4,13,16,40 [--fused] \\
        --out benchmarks/results/block_gemm.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from decode_setup import write_result
from engine.core import kernels
from engine.core.linear import FORMATS
from engine.core.runner import ModelRunner
from engine.models.gguf_blocks import BLOCKS_OF_PANELS, PackedWeight, from_panels
from engine.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,13,16,40")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--flush-mb", type=int, default=0,
                        help="read this many MB before each timed pass (as a decode step's attention streams the KV "
                             "cache between two steps' GEMMs, so that their weights come from memory, not the LLC)")
    parser.add_argument("--fused", action="store_true",
                        help="each layer's q|k|v and gate|up side by side, as the lean stack calls them")
    args = parser.parse_args()

    loaded = load_model("smollm2-135m-instruct", device="cpu", attn_implementation="magicdec")
    ModelRunner(loaded, slots=1, capacity=64)  # keeps the GGUF's blocks, as a job's runner does
    kernel = kernels.load()
    linears = [m for m in loaded.model.modules() if getattr(m, "packed", None) is not None]
    if not linears or loaded.model.lm_head.packed is None:
        raise SystemExit("block_gemm_bench: the model has no GGUF blocks here (no kernel, or MAGICDEC_GGUF_BLOCKS=0)")
    if args.fused:
        layers = [group for layer in loaded.model.model.layers for group in
                  ([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], [layer.self_attn.o_proj],
                   [layer.mlp.gate_proj, layer.mlp.up_proj], [layer.mlp.down_proj])]
    else:
        layers = [[m] for m in linears if m is not loaded.model.lm_head]
    parts = {"layers": layers, "lm_head": [[loaded.model.lm_head]]}  # per part: its calls' modules

    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {K: torch.randn(rows, K) for K in {m.weight.shape[1] for m in linears}}
        row = {"rows": rows}
        for name, groups in parts.items():
            # per call: x, weights, blocks
            calls = [(xs[g[0].weight.shape[1]], [m.weight for m in g], [m.packed for m in g]) for g in groups]
            dot_calls = [(x, ws, [as_blocks(p) for p in ps]) for x, ws, ps in calls]

            def reading(chosen, amx=False):
                def call():
                    previous = kernel.use_amx(amx)  # panels by the AMX tiles or by AVX-512 FMAs
                    try:
                        return [kernel.small_linear_cat(x, ws, [None] * len(ws), [p.blocks for p in ps],
                                                        [FORMATS[p.format] for p in ps]) for x, ws, ps in chosen]
                    finally:
                        kernel.use_amx(previous)
                return call

            def from_float32():
                return [kernel.small_linear_cat(x, ws, [None] * len(ws), [], []) for x, ws, _ in calls]

            def by_torch():
                return [torch.cat([torch.nn.functional.linear(x, w) for w in ws], dim=-1) for x, ws, _ in calls]

            timed = {"torch": by_torch, "float32": from_float32, "blocks": reading(dot_calls)}
            if any(p.format in BLOCKS_OF_PANELS for _, _, ps in calls for p in ps):
                timed["panels"] = reading(calls)
                if kernel.amx_in_use():
                    timed["panels_amx"] = reading(calls, amx=True)
            reference = from_float32()
            assert all(torch.equal(a, b) for a, b in zip(timed["blocks"](), reference)), name
            for panels in [key for key in ("panels", "panels_amx") if key in timed]:
                assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(timed[panels](), reference))
            flush = torch.ones(args.flush_mb * 2**20 // 4) if args.flush_mb else None
            times = interleaved_medians(timed, args.repeats, before=flush.sum if flush is not None else None)
            row[name] = {"gemms": sum(len(ws) for _, ws, _ in calls), "calls": len(calls),
                         **{f"{k}_ms": round(1e3 * v, 2) for k, v in times.items()},
                         "ratio": round(times["float32"] / times["blocks"], 2)}
            if "panels" in times:
                row[name]["panels_vs_blocks"] = round(times["blocks"] / times["panels"], 2)
            if "panels_amx" in times:
                row[name]["amx_vs_panels"] = round(times["panels"] / times["panels_amx"], 2)
        results.append(row)
        print(row, flush=True)
    write_result(args.out, isa=kernel.vector_isa(), amx=kernel.amx_in_use(),
                 fused=args.fused, flush_mb=args.flush_mb,
                 blocks_bit_equal_to_float32=True, results=results)


def as_blocks(p: PackedWeight) -> PackedWeight:
    """The same blocks as the dot-product tiles read them (panels regrouped back)."""
    fmt = BLOCKS_OF_PANELS.get(p.format)
    return PackedWeight(fmt, from_panels(p.blocks, fmt)) if fmt else p


def interleaved_medians(timed: dict, repeats: int, before=None) -> dict[str, float]:
    """Each function once per round, in turn, for `repeats` rounds (after one warm round): the median
    seconds of each, so that a slow minute of a shared machine falls on all of them alike. before:
    called (untimed) before each timed call."""
    for fn in timed.values():
        fn()
    times = {name: [] for name in timed}
    for _ in range(repeats):
        for name, fn in timed.items():
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


if __name__ == "__main__":
    main()
