"""One prefill chunk of the default model through the lean stack and through transformers' modules.

Not a test: a micro-benchmark behind BENCHMARKS.md section 34. The real default model prefills a
long real prompt (the first bench prompt) up to each shape's position through the job's own path,
then one `chunk`-token chunk at that position (a packed segment, as `ModelRunner.prefill` gets it) is
timed through `ModelRunner.prefill` (the lean stack where it applies) and `ModelRunner.module_prefill`
(transformers' modules), alternating in one process, median of --repeats; the two paths' logits are
checked against each other (within 1e-4). Writes JSON.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/prefill_paths_bench.py --shapes 512@1536,40@2048 \\
        --out benchmarks/results/prefill_paths.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from decode_setup import write_result
from engine.bench.prompts import bench_prompts
from engine.core import attention
from engine.core.prefill_attention import PrefillBatch, Segment
from engine.core.runner import ModelRunner
from engine.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="512@1536,40@2048", help="chunk@position pairs, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in shape.split("@")) for shape in args.shapes.split(",")]
    loaded = load_model("smollm2-135m-instruct", attn_implementation=attention.ATTN_NAME, dtype="float32",
                        device="cpu")
    longest = max(at + chunk for chunk, at in shapes)
    ids = torch.tensor(bench_prompts(loaded.tokenizer, 1, longest)[0][0])
    runner = ModelRunner(loaded, slots=1, capacity=longest + 16)
    if runner.lean_stack() is None:
        raise SystemExit("prefill_paths_bench: the lean stack does not apply here (nothing to compare)")
    for start in range(0, longest, 512):  # every position cached once, through the job's own path
        length = min(512, longest - start)
        runner.prefill(ids[start:start + length], PrefillBatch(runner.cache, [Segment(0, start, length)]))
    results = []
    for chunk, at in shapes:
        def run(path):
            return path(ids[at:at + chunk], PrefillBatch(runner.cache, [Segment(0, at, chunk)]))  # [1, vocab]

        torch.testing.assert_close(run(runner.prefill), run(runner.module_prefill), rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {"lean": [], "modules": []}
        for _ in range(args.repeats):  # alternating, so that a slow stretch of the machine hits both
            for name, path in (("lean", runner.prefill), ("modules", runner.module_prefill)):
                start = time.perf_counter()
                run(path)
                times[name].append(time.perf_counter() - start)
        lean_ms, modules_ms = (1e3 * statistics.median(times[name]) for name in ("lean", "modules"))
        row = {"chunk": chunk, "at": at, "lean_ms": round(lean_ms, 1), "modules_ms": round(modules_ms, 1),
               "speedup": round(modules_ms / lean_ms, 3)}
        results.append(row)
        print(row, flush=True)
    write_result(args.out, results=results)


if __name__ == "__main__":
    main()
