"""Shared by the step micro-benchmarks (step_profile.py, draft_step.py, q4_1_probe.py, the kernel benches)
and job_bench.py: the real default model over a cache of random K/V, a median timer, the CPU's model
name and a result file stamped with date, machine, commit and threads. A decode step's cost does not
depend on the cached values. Not a benchmark itself."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from engine.models.loading import LoadedModel, load_model
from engine.core.runner import ModelRunner


def step_arguments(doc: str, *, context: int, repeats: int, out: str) -> argparse.ArgumentParser:
    """The options both scripts take: --batch, --context, --repeats, --out (with their defaults)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=context)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (for a result's provenance), else the platform's word."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine())


def write_result(path: Path, **fields) -> None:
    """Write a micro-benchmark's JSON to `path`: date (UTC), machine, commit and threads, then `fields`."""
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_model_name(),
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "threads": torch.get_num_threads(), **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


def random_cache_runner(batch: int, context: int) -> tuple[LoadedModel, ModelRunner, torch.Tensor]:
    """The default model, a runner whose cache holds random K/V, and one new token per row [batch, 1]."""
    loaded = load_model("smollm2-135m-instruct", device="cpu", attn_implementation="magicdec")
    runner = ModelRunner(loaded, slots=batch, capacity=context + 16)
    generator = torch.Generator().manual_seed(0)
    runner.cache.k.normal_(generator=generator)  # [layers, slots, kv_heads, capacity, head_dim]
    runner.cache.v.normal_(generator=generator)
    tokens = torch.randint(0, 1000, (batch, 1), generator=generator)  # [B, 1]
    return loaded, runner, tokens
