"""Memory stays flat however many rows: peak RSS of `magicdec validate` on 20k vs 200k small rows.

Each size runs in a fresh process (`validate` streams the input, builds every prompt with the real
tokenizer, and keeps only counters and the ids seen, for the duplicate check). Writes
benchmarks/results/validate_memory.json.

    .venv/bin/python benchmarks/validate_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, resource, sys, time
from engine.job.validate import validate_job
t0 = time.time()
result = validate_job("generic", sys.argv[1])
print(json.dumps({"rows": result["rows"], "rows_bad": result["rows_bad"], "seconds": time.time() - t0,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def main() -> None:
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rows in (20_000, 200_000):
            path = Path(tmp) / f"rows{rows}.jsonl"
            with open(path, "w") as handle:
                for i in range(rows):
                    handle.write(json.dumps({"id": i, "prompt": f"Row {i}: summarise the number {i * 7919}."}) + "\n")
            done = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"validate over {rows} rows failed with exit code {done.returncode}:\n{done.stderr}")
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run["file_bytes"] = path.stat().st_size
            results["runs"].append(run)
            print(f"{rows} rows ({run['file_bytes'] / 1e6:.1f} MB): peak RSS {run['peak_rss_bytes'] / 2**20:.0f} MiB, "
                  f"{run['seconds']:.1f} s", flush=True)
    out = ROOT / "benchmarks" / "results" / "validate_memory.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
