"""Tensor parallel and data parallel on this machine: decode tokens/s of tp=1 vs tp=2 and dp=1 vs dp=2.

Runs one short job (sample_data/generic.jsonl, 16 rows of ~200-400 tokens, the real default model,
greedy) through `magicdec run --json` in each layout, side by side in one run, and reads the
throughput from each job's report (for dp=2 the merged report: all tokens over the longest group's
decode time). Writes benchmarks/results/parallel_cpu.json and prints a table. Not a test.

    .venv/bin/python benchmarks/parallel_bench.py [--methods none,snapkv] [--new-tokens 32] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name, CLI flags, threads per process (the machine's cores split over the processes)
LAYOUTS = [
    ("tp1 (1 process x all cores)", [], None),
    ("tp1 (1 process x 1 thread)", [], 1),
    ("tp2 (2 processes x 1 thread)", ["--tp", "2"], 1),
    ("dp2 (2 processes x 1 thread)", ["--dp", "2"], 1),
]


def run_job(data: Path, out: Path, method: str, flags: list[str], threads: int | None, args) -> dict:
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    env["MAGICDEC_THREADS"] = str(threads or os.cpu_count() or 1)
    command = [sys.executable, "-m", "magicdec_cli.main", "run", "generic", "-i", str(data), "-o", str(out),
               "--overwrite", "--json", *flags, "--set", f"draft.method={method}",
               "--set", f"batch.size={args.batch}", "--set", "batch.max_len=1024",
               "--set", f"sampling.max_new_tokens={args.new_tokens}", "--set", "draft.budget=128"]
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    th, sp = report["throughput"], report["speculative"]
    return {"decode_tokens_per_s": th["decode_tokens_per_s"], "decode_tokens": th["decode_tokens"],
            "decode_s": th["decode_s"], "prefill_tokens_per_s": th["prefill_tokens"] / th["prefill_s"],
            "acceptance_rate": sp["acceptance_rate"], "mean_gamma": sp["gamma"],
            "job_wall_s": report["job"]["wall_s"], "process_wall_s": time.time() - started,
            "texts": {row["id"]: row["text"] for row in map(json.loads, out.read_text().splitlines())}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="none,snapkv")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="runs per layout; the best is kept")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "parallel_cpu.json")
    args = parser.parse_args()

    data = ROOT / "sample_data" / "generic.jsonl"
    results = []
    with tempfile.TemporaryDirectory() as work:
        for method in args.methods.split(","):
            reference = None
            for name, flags, threads in LAYOUTS:
                runs = [run_job(data, Path(work) / "out.jsonl", method, flags, threads, args)
                        for _ in range(args.repeat)]
                best = max(runs, key=lambda r: r["decode_tokens_per_s"])
                texts = best.pop("texts")
                reference = reference or texts
                best.update(method=method, layout=name, same_text_as_first_layout=texts == reference)
                results.append(best)
                print(f"{method:12s} {name:30s} {best['decode_tokens_per_s']:7.1f} decode tok/s", file=sys.stderr)

    load = os.getloadavg()
    summary = {"machine": {"cpus": os.cpu_count(), "loadavg_at_end": load},
               "job": {"input": str(data.relative_to(ROOT)), "rows": 16, "batch_size": args.batch,
                       "max_new_tokens": args.new_tokens, "model": "smollm2-135m-instruct", "dtype": "float32"},
               "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")

    print(f"\n{'method':12s} {'layout':30s} {'decode tok/s':>12s} {'vs tp1 all cores':>16s} {'prefill tok/s':>13s} "
          f"{'job wall s':>10s} {'same text':>9s}")
    for method in args.methods.split(","):
        rows = [r for r in results if r["method"] == method]
        base = rows[0]["decode_tokens_per_s"]
        for r in rows:
            print(f"{method:12s} {r['layout']:30s} {r['decode_tokens_per_s']:12.1f} "
                  f"{r['decode_tokens_per_s'] / base:15.2f}x {r['prefill_tokens_per_s']:13.0f} "
                  f"{r['job_wall_s']:10.1f} {str(r['same_text_as_first_layout']):>9s}")
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (other work on the machine "
          f"skews these numbers); wrote {args.out}")


if __name__ == "__main__":
    main()
