"""`magicdec bench` rows for draft-method variants with their own draft keys, side by side in one run.

Not a test and not a new engine path: `engine.bench.sweep.Bench`, whose recipe for a method named
`base@key=value,key=value` is the bench's own recipe for `base` with those `draft.*` keys set (for
example `guided@window=256` or `guided@smoothing=0.5`), so one process times a method against its
own knobs on the same prompts and the same plain baseline. Rows keep the variant's name.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/bench_variants.py \\
        --methods "streamingllm guided guided@window=256" --gamma auto --prompts sample_data/long.jsonl \\
        --context 3328 --budget 512 --new-tokens 64 --out benchmarks/results/guided_window_code.json
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.bench.sweep import Bench, BenchSpec
from engine.config.loading import apply_override, recipe_from_dict
from engine.errors import JobError


def base_method(name: str) -> str:
    return name.partition("@")[0]


class VariantBench(Bench):
    """Bench whose method names may carry draft keys after '@'."""

    def recipe(self, method, budget, gamma, linear_dtype="auto", batch=1, context=2):
        base, _, keys = method.partition("@")
        recipe = super().recipe(base, budget, gamma, linear_dtype, batch, context)
        if not keys:
            return recipe
        raw = recipe.to_dict()
        for item in keys.split(","):  # parsed and checked as `magicdec run --set draft.KEY=VALUE` is
            apply_override(raw, f"draft.{item}")
        return recipe_from_dict(raw, source=f"--methods {method}")

    def _predict(self, shapes, hardware, row, element):
        return super()._predict(shapes, hardware, dict(row, method=base_method(row["method"])), element)


def variant_parser(doc: str, *, gamma: str, gamma_help: str, new_tokens: int, methods_example: str):
    """The flags of a bench over method variants (this script's and `guided_oracle.py`'s)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", required=True, help=f"space-separated, e.g. '{methods_example}'")
    parser.add_argument("--gamma", default=gamma, help=gamma_help)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--context", type=int, default=3328)
    parser.add_argument("--budget", default="512", help="comma-separated ints")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--out", required=True)
    return parser


def run_variants(bench_class, args, gammas: tuple) -> None:
    """Run `bench_class` (a VariantBench) over the parsed flags, plain decoding first, and write args.out."""
    budgets = tuple(int(b) for b in args.budget.split(","))
    spec = BenchSpec(batches=(args.batch,), contexts=(args.context,), methods=("none", *args.methods.split()),
                     budgets=budgets, gammas=gammas, new_tokens=args.new_tokens, prompts=args.prompts, hf=False)
    try:
        result = bench_class(spec).run()
    except JobError as exc:  # a bad method or draft key: one line, exit 2, as the CLI does
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out}")


def main() -> None:
    parser = variant_parser(__doc__, gamma="auto", gamma_help="comma-separated ints and/or auto", new_tokens=64,
                            methods_example="streamingllm guided@window=256")
    args = parser.parse_args()
    run_variants(VariantBench, args, tuple(g if g == "auto" else int(g) for g in args.gamma.split(",")))


if __name__ == "__main__":
    main()
