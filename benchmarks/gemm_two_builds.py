"""The few-row GEMM of two builds of the CPU kernel side by side: the same bits, and which is faster.

Not a test: a check that a change to `small_linear` (engine/core/csrc/cpu_linear.cpp) keeps every
output bit and what it gains, measured interleaved in one process (this VM's bandwidth drifts within
minutes). `--old-so` is the compiled kernel of an older checkout, from the kernel cache folder
(`$MAGICDEC_CACHE/torch_extensions/magicdec_cpu_attention_<hash>/*.so`); the new one is this
checkout's. The timed work is one decode step's 210 linear layers and the lm_head of
SmolLM2-135M's shapes, every weight a distinct tensor (read from memory, as in a step). Writes JSON.

    .venv/bin/python benchmarks/gemm_two_builds.py --old-so PATH --out benchmarks/results/gemm_two_builds.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from engine.core import kernels as cpu_kernels

LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def load_so(path: Path):
    name = path.parent.name  # the module name the build was compiled under
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-so", type=Path, required=True)
    parser.add_argument("--rows", default="1,4,13,16,52")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    builds = {"old": load_so(args.old_so), "new": cpu_kernels.load()}
    generator = torch.Generator().manual_seed(0)
    for M in (1, 2, 3, 5, 7, 13, 16, 29, 128):  # every register-tile split and tail
        for N, K in ((49152, 576), (960, 576), (576, 1536), (7, 37), (5, 576)):
            x, w, b = torch.randn(M, K, generator=generator), torch.randn(N, K, generator=generator), \
                torch.randn(N, generator=generator)
            assert torch.equal(builds["old"].small_linear(x, w, b), builds["new"].small_linear(x, w, b)), (M, N, K)
    layers = [[torch.randn(n, k) for n, k in LAYER_SHAPES] for _ in range(30)]
    lm_head = torch.randn(*LM_HEAD)
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeats):
        for M in map(int, args.rows.split(",")):
            x, h = torch.randn(M, 576), torch.randn(M, 1536)
            for name, build in builds.items():
                def step():
                    for weights in layers:
                        for w in weights:
                            build.small_linear(h if w.shape[1] == 1536 else x, w, None)
                    build.small_linear(x, lm_head, None)
                step()
                start = time.perf_counter()
                step()
                times.setdefault(str(M), {}).setdefault(name, []).append((time.perf_counter() - start) * 1e3)
    rows = []
    for M, by_build in times.items():
        old, new = statistics.median(by_build["old"]), statistics.median(by_build["new"])
        rows.append({"rows": int(M), "old_ms_median": old, "new_ms_median": new, "speedup": old / new,
                     "old_ms": by_build["old"], "new_ms": by_build["new"]})
        print(f"{M:>4} rows: old {old:.1f} ms, new {new:.1f} ms, {old / new:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "old_so": str(args.old_so),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "bit_identical": True, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
