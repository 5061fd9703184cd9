"""`magicdec bench` and `magicdec run` side by side on the very same prompts: do their decode rates agree?

Both drive one Scheduler / RoundRunner loop (issue 10), so on one shape their decode tokens/s should
differ only by the machine's noise. This script writes the bench's own prompts (16 windows of exactly
`--context` tokens from `--prompts`, decoded to text) as a JSONL input, then alternates, `--repeats`
times: a `magicdec run` job per method (plain, then StreamingLLM at `--budget`, the recipe's other
defaults, gamma `auto`) and one `magicdec bench` over the same methods, swapping which goes first on
every repeat so a drift of the machine's speed does not land on one side only.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_vs_run.py --repeats 2 --out benchmarks/results/bench_vs_run_quiet

Writes `<out>/bench_vs_run.json` (every report and bench row, the commands) and prints the table.
Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine.bench.prompts import bench_prompts  # noqa: E402
from engine.config.schema import DEFAULT_MODEL  # noqa: E402
from engine.models.loading import load_tokenizer  # noqa: E402

METHODS = ("none", "streamingllm")  # the default --methods


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "magicdec_cli.main", *args]


def run_job(method: str, data: Path, out: Path, args) -> dict:
    output = out / f"run-{method}-{time.strftime('%H%M%S')}.jsonl"
    command = cli("run", "generic", "--input", str(data), "--output", str(output), "--overwrite", "--json",
                  "--set", f"draft.method={method}", "--set", f"draft.budget={args.budget}",
                  "--set", f"batch.size={args.batch}", "--set", f"sampling.max_new_tokens={args.new_tokens}")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    return {"command": command, "decode_tokens_per_s": report["throughput"]["decode_tokens_per_s"],
            "mean_gamma": report["speculative"]["gamma"], "acceptance": report["speculative"]["acceptance_rate"],
            "report": report}


def run_bench(out: Path, args) -> dict[str, dict]:
    folder = out / f"bench-{time.strftime('%H%M%S')}"
    command = cli("bench", "--batch", str(args.batch), "--context", str(args.context), "--methods", ",".join(args.methods),
                  "--budget", str(args.budget), "--gamma", "auto", "--new-tokens", str(args.new_tokens), "--no-hf",
                  "--prompts", str(args.prompts), "--out", str(folder))
    subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    rows = json.loads((folder / "bench.json").read_text())["rows"]
    found = {}
    for row in rows:
        if row["method"] in args.methods and row["method"] not in found:
            found[row["method"]] = {"command": command, "decode_tokens_per_s": row["decode_tokens_per_s"],
                                    "mean_gamma": row.get("mean_gamma"), "acceptance": row.get("acceptance_rate")}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=3328)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", type=lambda text: tuple(text.split(",")), default=METHODS,
                        help="comma-separated, e.g. none,streamingllm")
    parser.add_argument("--prompts", type=Path, default=ROOT / "sample_data" / "long.jsonl")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompts, _ = bench_prompts(tokenizer, args.batch, args.context, path=str(args.prompts))
    data = args.out / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": tokenizer.decode(ids)}) + "\n"
                            for i, ids in enumerate(prompts)))

    repeats = []
    for repeat in range(args.repeats):
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        order = ("run", "bench") if repeat % 2 == 0 else ("bench", "run")
        got: dict[str, dict] = {}
        for side in order:
            if side == "run":
                got["run"] = {method: run_job(method, data, args.out, args) for method in args.methods}
            else:
                got["bench"] = run_bench(args.out, args)
        repeats.append({"started": started, "order": order, **got})
        for method in args.methods:
            b, r = got["bench"][method]["decode_tokens_per_s"], got["run"][method]["decode_tokens_per_s"]
            print(f"repeat {repeat + 1} ({' then '.join(order)}) {method}: bench {b:.1f} tok/s, run {r:.1f} tok/s, "
                  f"bench/run {b / r:.3f}", flush=True)

    summary = {}
    for method in args.methods:
        bench = sum(rep["bench"][method]["decode_tokens_per_s"] for rep in repeats) / len(repeats)
        run = sum(rep["run"][method]["decode_tokens_per_s"] for rep in repeats) / len(repeats)
        summary[method] = {"bench_mean": bench, "run_mean": run, "bench_over_run": bench / run}
        print(f"mean {method}: bench {bench:.1f}, run {run:.1f}, bench/run {bench / run:.3f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    (args.out / "bench_vs_run.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "commit": commit, "machine": platform.processor()
         or platform.machine(), "repeats": repeats, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
