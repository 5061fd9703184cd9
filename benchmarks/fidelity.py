"""Do `magicdec run` outputs equal transformers' own greedy `generate`? (issues 2 and 3: >= 95% of rows)

Builds N real prompts of a few hundred to two thousand tokens from the standard library's sources
(sample_data/long.jsonl), runs `magicdec run` through the CLI once per draft method (plain decoding
and each compressor, batch 16, greedy), runs transformers' `generate` on each prompt alone (batch 1,
sdpa attention, its own cache), and counts identical rows. Writes benchmarks/results/fidelity.json.

    .venv/bin/python benchmarks/fidelity.py [--rows 32] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def outputs_of(args) -> list[str]:
    return args.methods.split(",")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--methods", default="none,streamingllm,snapkv,pqcache")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's dtype, for magicdec and for transformers' reference alike")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fidelity.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from engine.core import attention  # noqa: F401  (registers attn_implementation="magicdec")
    from engine.models.loading import load_model

    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m-instruct", dtype=args.dtype, device="cpu", attn_implementation="magicdec")
    tokenizer = loaded.tokenizer
    texts = [json.loads(line)["prompt"] for line in (ROOT / "sample_data" / "long.jsonl").read_text().splitlines()]
    stream = [t for text in texts for t in tokenizer(text)["input_ids"]]
    rng = random.Random(0)
    rows = []
    for i in range(args.rows):
        length = rng.randint(300, 2000)
        start = rng.randint(0, len(stream) - length - 1)
        # Decode a token span back to text: the prompt users would send (re-tokenised by the job).
        rows.append({"id": i, "prompt": tokenizer.decode(stream[start:start + length])})
    work = ROOT / "benchmarks" / "results" / "fidelity-work"
    work.mkdir(parents=True, exist_ok=True)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    reference = AutoModelForCausalLM.from_pretrained(loaded.model.name_or_path, attn_implementation="sdpa",
                                                     dtype=getattr(torch, args.dtype)).eval()
    eos = loaded.eos_token_ids[0]
    expected, t0 = {}, time.time()
    for row in rows:
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=eos,
                                     pad_token_id=eos)
        expected[row["id"]] = out[0, ids.shape[1]:].tolist()
    hf_s = time.time() - t0

    results = {"rows": len(rows), "new_tokens": args.new_tokens, "transformers_s": hf_s, "methods": {},
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": "2-core CPU", "dtype": args.dtype,
               "prompt_tokens": sorted(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)}
    for method in args.methods.split(","):
        out = work / f"{method}.jsonl"
        command = [sys.executable, "-m", "magicdec_cli.main", "run", "generic", "--input", str(data),
                   "--output", str(out), "--overwrite", "--json", "--set", f"draft.method={method}",
                   "--set", "batch.size=16", "--set", "batch.max_len=2304", "--set", f"dtype={args.dtype}",
                   "--set", f"sampling.max_new_tokens={args.new_tokens}"]
        t0 = time.time()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode not in (0, 1):  # 1: the job ran, with error records (counted below)
            sys.exit(f"magicdec run ({method}) failed with exit code {done.returncode}:\n{done.stderr}")
        summary = json.loads(done.stdout)
        produced = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        same = 0
        for row_id, tokens in expected.items():
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            same += produced[row_id]["text"] == text and produced[row_id]["output_tokens"] == len(tokens)
        if method == "none":
            plain = produced
        as_plain = sum(produced[i]["text"] == plain[i]["text"] for i in produced) if "none" in outputs_of(args) else None
        results["methods"][method] = {
            "identical_rows": same, "identical_share": same / len(rows), "wall_s": time.time() - t0,
            "identical_to_plain_rows": as_plain,
            "acceptance_rate": summary["speculative"]["acceptance_rate"],
            "decode_tokens_per_s": summary["throughput"]["decode_tokens_per_s"]}
        print(method, f"{same}/{len(rows)} identical to transformers", flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
