"""What one self-speculative draft step costs, taken apart: draft path x view store x GEMM dtype.

Not a test and not `magicdec bench`: one batch-16 StreamingLLM draft step (one token per row, the
real default model, a cache of random K/V at the given context; a step's cost does not depend on the
values) timed for each combination of
- the path: transformers' forward with `DraftGemms` (`engine.draft_forward.ModuleDraft`), or the
  lean forward (`LeanDraft`);
- the view: positions gathered from the float32 cache, or the compact bfloat16 store (lean only);
- the draft GEMMs: float32 (the model's own), bfloat16, int8.
Median of `--repeats` steps each, all in one process, beside one plain target step. Writes JSON.

    .venv/bin/python benchmarks/draft_step.py --out benchmarks/results/draft_step.json
"""

from __future__ import annotations

import json
import platform
import time

import torch

from engine.core.attention import ForwardBatch
from engine.config.schema import DraftConfig
from engine.spec.draft.forward import LeanDraft, ModuleDraft, dtype_name
from engine.spec.draft.gemms import INT8, DraftGemms
from engine.spec.compressors.streamingllm import StreamingLLM
from decode_setup import median_seconds, random_cache_runner, step_arguments


def median_ms(fn, repeats: int) -> float:
    return 1e3 * median_seconds(fn, repeats)


def main() -> None:
    parser = step_arguments(__doc__, context=3584, repeats=11, out="benchmarks/results/draft_step.json")
    parser.add_argument("--budget", type=int, default=512)
    args = parser.parse_args()
    B, L = args.batch, args.context

    loaded, runner, tokens = random_cache_runner(B, L)  # tokens: [B, 1], one new token per row
    slots = list(range(B))
    config = DraftConfig(method="streamingllm", budget=args.budget)
    on_cache = StreamingLLM(config, runner.cache, runner.heads)
    compact = StreamingLLM(config, runner.cache, runner.heads)
    compact.enable_compact(extra=9, copy_committed=True)
    for slot in slots:
        compact.prefill_done(slot, L, None)

    def step(draft, compressor):
        return lambda: draft(tokens, ForwardBatch(runner.cache, slots, [L] * B, 1,
                                                  view=compressor.view(slots, [L + 1] * B)))

    rows = []
    with torch.inference_mode():
        target_ms = median_ms(lambda: runner.forward(tokens, ForwardBatch(runner.cache, slots, [L] * B, 1),
                                                     last_only=True), args.repeats)
        for dtype in (None, torch.bfloat16, INT8):
            name = dtype_name(dtype or loaded.dtype)
            gemms = DraftGemms(loaded.model, dtype) if dtype is not None else None
            rows.append({"path": "transformers", "view": "cache positions", "gemms": name,
                         "ms": median_ms(step(ModuleDraft(runner, gemms), on_cache), args.repeats)})
            lean = LeanDraft(loaded.model, dtype)
            rows.append({"path": "lean", "view": "cache positions", "gemms": name,
                         "ms": median_ms(step(lean, on_cache), args.repeats)})
            rows.append({"path": "lean", "view": "compact bf16 store", "gemms": name,
                         "ms": median_ms(step(lean, compact), args.repeats)})
    for row in rows:
        row["t_draft_over_t_target"] = row["ms"] / target_ms
        print(f"{row['path']:<13} {row['view']:<19} {row['gemms']:<9} {row['ms']:6.1f} ms  "
              f"T_D/T_T {row['t_draft_over_t_target']:.2f}")
    print(f"plain target step {target_ms:.1f} ms")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
              platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "batch": B, "context": L, "budget": args.budget, "target_step_ms": target_ms, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
