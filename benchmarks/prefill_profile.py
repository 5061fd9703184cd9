"""Where one prefill chunk goes: linear layers, attention, norms / RoPE / other ops, and Python.

Not a test and not `magicdec bench`: the real default model prefills a long real prompt (the first
bench prompt) up to `--at` tokens, then one `--chunk`-token chunk at that position is timed (median of
`--repeats`, the chunk's K/V simply rewritten each time; the job's own path: `ModelRunner.prefill` of one
packed segment) and profiled with `torch.profiler`:
`aten::mm`/`aten::addmm`/`aten::linear` self time is the linear layers (the lm_head only for the last
token, as prefill keeps one logit), the engine's attention function is timed as a whole (its cache
write included), every other aten op is "norms, RoPE, other", and the rest of the wall time is Python
and module dispatch. Also: the FLOP count of the chunk (2 x linear parameters per token + 4 x head_dim x
heads per visible (query, key) pair and layer), the rate it reaches, and a 2048^3 float32 matmul timed
in the same run. Writes JSON.

    .venv/bin/python benchmarks/prefill_profile.py --at 2560 --chunk 512 --out benchmarks/results/prefill_profile.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine.bench.prompts import bench_prompts
from engine.core import attention
from engine.core.prefill_attention import PrefillBatch, Segment
from engine.core.runner import ModelRunner
from engine.models.loading import load_model
from engine.models.shapes import linear_params, normalize_shapes


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / median_s(lambda: a @ b, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", type=int, default=2560, help="cached prompt tokens before the chunk")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_profile.json"))
    args = parser.parse_args()
    loaded = load_model("smollm2-135m-instruct", attn_implementation=attention.ATTN_NAME, dtype=args.dtype,
                        device="cpu")
    n = args.at + args.chunk
    prompt = bench_prompts(loaded.tokenizer, 1, n)[0][0]
    runner = ModelRunner(loaded, slots=1, capacity=n + 16)
    ids = torch.tensor(prompt)
    for start in range(0, args.at, args.chunk):  # the cached part, through the job's own packed path
        length = min(args.chunk, args.at - start)
        runner.prefill(ids[start:start + length], PrefillBatch(runner.cache, [Segment(0, start, length)]))
    piece = ids[args.at:n]  # [chunk]

    def chunk():
        runner.prefill(piece, PrefillBatch(runner.cache, [Segment(0, args.at, args.chunk)]))

    original = attention.magicdec_attention

    def timed_attention(*a, **k):
        with record_function("magicdec_attention"):
            return original(*a, **k)

    from transformers import AttentionInterface
    AttentionInterface.register(attention.ATTN_NAME, timed_attention)
    chunk_s = median_s(chunk, args.repeats)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        chunk()
    events = {e.key: e for e in prof.key_averages()}
    AttentionInterface.register(attention.ATTN_NAME, original)
    linear_us = sum(events[k].self_cpu_time_total for k in ("aten::mm", "aten::addmm") if k in events)
    attention_us = events["magicdec_attention"].cpu_time_total if "magicdec_attention" in events else 0.0
    # The fused kernel is a pybind call, not an aten op: its time shows only inside the attention
    # function's record_function span. Every other aten op's self time (norms, RoPE, SiLU, residuals,
    # and the attention's small cache-write ops) is "other"; what is left of the wall time is Python
    # and module calls.
    other_us = sum(e.self_cpu_time_total for k, e in events.items()
                   if k.startswith("aten::") and k not in ("aten::mm", "aten::addmm"))
    python_us = max(chunk_s * 1e6 - linear_us - attention_us - other_us, 0.0)
    shapes = normalize_shapes(dict(loaded.model.config.to_dict()))
    params = linear_params(shapes) - shapes["hidden"] * shapes["vocab"]  # the lm_head runs for one token only
    pairs = sum(args.at + t + 1 for t in range(args.chunk))  # (query, key) pairs the chunk attends
    flops = 2 * params * args.chunk + 2 * shapes["hidden"] * shapes["vocab"] + \
        4 * shapes["head_dim"] * shapes["heads"] * shapes["layers"] * pairs
    mm = matmul_flops()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability()},
        "dtype": args.dtype, "cached": args.at, "chunk": args.chunk,
        "chunk_ms": 1e3 * chunk_s,
        "profiled_ms": {"linear layers (aten::mm/addmm self time)": linear_us / 1e3,
                        "attention (the engine's attention function, all inside it)": attention_us / 1e3,
                        "norms, RoPE, SiLU, residuals, embedding, cache writes (other aten ops' self time)":
                            other_us / 1e3,
                        "Python and module dispatch (the rest of the chunk's wall time)": python_us / 1e3},
        "flop": flops, "gflop_per_s": flops / chunk_s / 1e9,
        "matmul_2048_gflop_per_s": mm / 1e9, "fraction_of_matmul": flops / chunk_s / mm,
        "top_ops_ms": sorted(((k, e.self_cpu_time_total / 1e3) for k, e in events.items() if k.startswith("aten::")),
                             key=lambda kv: -kv[1])[:12],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
