"""Whole jobs side by side: `magicdec run` under several settings (and checkouts), one after another
in one invocation, each job's own report collected, with a 2048^3 float32 matmul timed beside each.

What users pay is the whole job (prefill + decode), so this is the benchmark behind the job-level
figures in BENCHMARKS.md: prefill tokens/s, decode tokens/s, wall time (load excluded), prefix reuse,
acceptance. A config is `label=checkout:set1,set2,...` where checkout is a folder holding a magicdec
checkout (its own `engine/` is imported: e.g. a `git worktree` of an older commit) and each set is a
`--set KEY=VALUE`, or `env.NAME=VALUE` for an environment variable of that job (e.g.
`env.MAGICDEC_SHARED_READS=0`). Example (the prefill issue's table):

    .venv/bin/python benchmarks/job_bench.py --recipe generic --input sample_data/long.jsonl \\
        --common sampling.max_new_tokens=96,batch.size=16 \\
        --config old=/work/baseline:draft.method=none --config new=.:draft.method=none \\
        --out benchmarks/results/job_prefill

Writes `<out>/jobs.json` (every report, the matmul rates, the commands) and `<out>/jobs.md`.
Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.models.shapes import linear_params, shapes_for  # noqa: E402

MATMUL = ("import torch, time; a, b = torch.randn(2048, 2048), torch.randn(2048, 2048); a @ b; t = []\n"
          "for _ in range(5):\n s = time.perf_counter(); a @ b; t.append(time.perf_counter() - s)\n"
          "print(2 * 2048 ** 3 / sorted(t)[2] / 1e9)")


def matmul_gflops() -> float:
    out = subprocess.run([sys.executable, "-c", MATMUL], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def run_config(label: str, checkout: Path, sets: list[str], args, out: Path) -> dict:
    output = out / f"{label}.jsonl"
    command = [sys.executable, "-m", "magicdec_cli.main", "run", args.recipe, "--input", str(Path(args.input).resolve()),
               "--output", str(output.resolve()), "--overwrite", "--json"]
    if args.limit:
        command += ["--limit", str(args.limit)]
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    for item in [*args.common, *sets]:
        if item.startswith("env."):
            name, _, value = item[len("env."):].partition("=")
            env[name] = value
        else:
            command += ["--set", item]
    started = time.time()
    result = subprocess.run(command, cwd=checkout, capture_output=True, text=True, env=env)
    if result.returncode not in (0, 1):
        raise SystemExit(f"{label}: exit {result.returncode}: {result.stderr.strip()[-2000:]}")
    report = json.loads(result.stdout)
    return {"label": label, "checkout": str(checkout), "sets": sets, "command": command,
            "process_s": time.time() - started, "report": report}


def prefill_flop(output: Path, shapes: dict) -> float:
    """FLOPs the job's prefill computed: per prompt token 2 x the linear layers' parameters (not the
    lm_head: prefill keeps the last position's logits only, 2 x hidden x vocab a row) plus causal
    attention, 4 x heads x head_dim per layer per attended position (QK^T and PV)."""
    per_token = 2 * (linear_params(shapes) - shapes["hidden"] * shapes["vocab"])
    attend = 4 * shapes["heads"] * shapes["head_dim"] * shapes["layers"]
    total = 0.0
    for line in output.read_text().splitlines():
        n = json.loads(line).get("prompt_tokens") or 0
        if n:
            total += per_token * n + attend * n * (n + 1) / 2 + 2 * shapes["hidden"] * shapes["vocab"]
    return total


def summary(row: dict) -> dict:
    r = row["report"]
    th, job, sp = r["throughput"], r["job"], r["speculative"]
    prefill_tps = th["prefill_tokens"] / th["prefill_s"] if th["prefill_s"] else 0.0
    gflops = row.get("prefill_flop", 0.0) / th["prefill_s"] / 1e9 if th["prefill_s"] else 0.0
    return {"label": row["label"], "wall_s": job["wall_s"], "load_s": job.get("load_s"), "prefill_s": th["prefill_s"],
            "prefill_tokens": th["prefill_tokens"], "prefill_tokens_reused": th.get("prefill_tokens_reused", 0),
            "prefill_tokens_per_s": prefill_tps, "decode_s": th["decode_s"], "decode_tokens": th["decode_tokens"],
            "decode_tokens_per_s": th["decode_tokens_per_s"], "method": sp["method"],
            "acceptance_rate": sp["acceptance_rate"], "mean_gamma": sp["gamma"],
            "peak_bytes": r["memory"]["peak_bytes"], "rows_ok": job["rows_ok"], "matmul_gflops": row["matmul_gflops"],
            "prefill_gflops": gflops, "prefill_of_matmul": gflops / row["matmul_gflops"] if row["matmul_gflops"] else 0.0,
            "dtype": r["hardware"].get("dtype", "-"), "total_s": job.get("total_s"),
            "check_bytes": r["memory"].get("check_bytes", 0)}


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['machine']} ({meta['threads']} threads), input `{meta['input']}`, "
             f"recipe `{meta['recipe']}`, common settings `{' '.join(meta['common']) or '-'}`.", "",
             "| config | dtype | wall s (load excl.) | prefill s | prefill tok computed | reused | prefill tok/s "
             "| prefill GFLOP/s (% of matmul) | decode s | decode tok/s | method | acceptance | peak GiB (memory check) "
             "| 2048^3 matmul GFLOP/s beside it |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        flops = f"{s['prefill_gflops']:.0f} ({s['prefill_of_matmul']:.0%})" if s["prefill_gflops"] else "-"
        lines.append(f"| {s['label']} | {s['dtype']} | {s['wall_s']:.1f} | {s['prefill_s']:.1f} | {s['prefill_tokens']} | "
                     f"{s['prefill_tokens_reused']} | {s['prefill_tokens_per_s']:.1f} | {flops} | {s['decode_s']:.1f} | "
                     f"{s['decode_tokens_per_s']:.1f} | {s['method']} | {s['acceptance_rate']:.2f} | "
                     f"{s['peak_bytes'] / 2**30:.2f} ({s['check_bytes'] / 2**30:.2f}) | {s['matmul_gflops']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--common", default="", help="comma-separated KEY=VALUE sets for every config")
    parser.add_argument("--config", action="append", required=True, help="label=checkout:KEY=VALUE,KEY=VALUE")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=0, help="only the first N input rows (run --limit)")
    parser.add_argument("--shapes", default="smollm2-135m", help="the model's built-in shape, for prefill FLOPs")
    args = parser.parse_args()
    args.common = [x for x in args.common.split(",") if x]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.config:
        label, _, rest = spec.partition("=")
        checkout, _, sets = rest.partition(":")
        gflops = matmul_gflops()
        row = run_config(label, Path(checkout), [x for x in sets.split(",") if x], args, args.out)
        row["matmul_gflops"] = (gflops + matmul_gflops()) / 2  # before and after the job
        if not row["report"]["throughput"].get("prefill_tokens_reused"):  # the FLOP count assumes none reused
            row["prefill_flop"] = prefill_flop(args.out / f"{label}.jsonl", shapes_for(args.shapes))
        rows.append(row)
        s = summary(row)
        print(f"{label}: wall {s['wall_s']:.1f} s, prefill {s['prefill_tokens_per_s']:.1f} tok/s "
              f"({s['prefill_gflops']:.0f} GFLOP/s), "
              f"decode {s['decode_tokens_per_s']:.1f} tok/s, matmul {s['matmul_gflops']:.0f} GFLOP/s", flush=True)
    import torch
    from decode_setup import cpu_model_name

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_model_name(),
            "cpus": os.cpu_count(), "native_bf16": "avx512_bf16" in cpuinfo or "amx_bf16" in cpuinfo,
            "threads": torch.get_num_threads(), "input": args.input, "recipe": args.recipe, "common": args.common,
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}
    (args.out / "jobs.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2, default=str) + "\n")
    (args.out / "jobs.md").write_text(markdown([summary(r) for r in rows], meta))
    print(f"wrote {args.out / 'jobs.json'} and {args.out / 'jobs.md'}")


if __name__ == "__main__":
    main()
