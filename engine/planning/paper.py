"""`magicdec plan` against the paper: Llama-3.1-8B, tp 8, StreamingLLM-512 self-speculation, and a
comparison of the compressors by batch. Renders the Markdown tables of docs/plan.md
(`python -m engine.planning.paper --paper-table`). Predictions only; nothing is timed here.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.models.shapes import shapes_for
from engine.planning.hardware import hardware_profile
from engine.planning.roofline import plan

# --------------------------------------------------------------------------------------------
# The paper check (docs/plan.md): Llama-3.1-8B, tp 8, StreamingLLM self-speculation with budget 512.

# Acceptance of that draft on PG-19 by prefill length, as the authors' project page lists it
# (github.com/Infini-AI-Lab/MagicDec, index.html, "Choice of Drafts").
ACCEPTANCE_PG19 = {4000: 0.84, 8000: 0.83, 16000: 0.82, 32000: 0.81, 64000: 0.79, 100000: 0.79}

# Each check: (title, hardware, gamma (None = best), cells). A cell is (context, batch, paper low,
# paper high, paper's gamma); low = high for a single figure, None where the paper gives no number.
# The gamma-2 ranges come from docs/magicdec.md, which does not say which batch gives which end, so
# every cell of a range is compared with the whole range (error 0 inside it).
PAPER_CHECKS = [
    ("8xA100, gamma 2 (paper, Table 3)", "a100", 2, [
        *((4000, b, 0.76, 0.90, 2) for b in (32, 64, 128, 256)),
        *((8000, b, None, None, 2) for b in (32, 64, 128)),
        *((16000, b, None, None, 2) for b in (32, 64, 128)),
        *((32000, b, 1.22, 1.35, 2) for b in (32, 64, 128)),
        (64000, 32, None, None, 2),
        (100000, 32, 1.64, 1.64, 2),
    ]),
    ("8xA100, best gamma (authors' project page)", "a100", None, [
        (32000, 32, 1.22, 1.22, 3), (32000, 64, 1.38, 1.38, 3), (32000, 128, 1.47, 1.47, 4),
    ]),
    ("8xH100, best gamma (paper, via docs/magicdec.md)", "h100", None, [
        (32000, 16, 1.08, 1.08, None), (32000, 32, 1.26, 1.26, None), (32000, 64, 1.55, 1.55, None),
        (32000, 128, 1.85, 1.85, None),
    ]),
]


def _paper_plan(hw: dict[str, Any], *, batch: int, context: int, gamma: int | None) -> dict[str, Any]:
    return plan(shapes=shapes_for("llama-3.1-8b"), hardware=hw, batch=batch, context=context,
                method="streamingllm", budget=512, acceptance=ACCEPTANCE_PG19[context], tp=8, gamma=gamma)


def _bare(hw: dict[str, Any]) -> dict[str, Any]:
    """The same profile with every fixed latency set to zero: the pure roofline."""
    return dict(hw, layer_latency_s=0.0, step_overhead_s=0.0, allreduce_latency_s=0.0)


def paper_rows(check: int = 0, hardware: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One check of PAPER_CHECKS: prediction, pure roofline (no fixed costs), paper figure, relative error."""
    _, hw_name, gamma, cells = PAPER_CHECKS[check]
    hw = hardware or hardware_profile(hw_name)
    rows = []
    for context, batch, low, high, paper_gamma in cells:
        full = _paper_plan(hw, batch=batch, context=context, gamma=gamma)
        pure = _paper_plan(_bare(hw), batch=batch, context=context, gamma=gamma)
        predicted = full["predicted_speedup"]
        error = None
        if low is not None:
            nearest = min(max(predicted, low), high)
            error = (predicted - nearest) / nearest
        rows.append(dict(context=context, batch=batch, acceptance=full["acceptance"], gamma=full["gamma"],
                         paper_gamma=paper_gamma, paper_low=low, paper_high=high, predicted=predicted,
                         roofline_only=pure["predicted_speedup"], error=error, t_target_ms=full["t_target_ms"],
                         td_over_tt=full["t_draft_ms"] / full["t_target_ms"],
                         tv_over_tt=full["t_verify_ms"] / full["t_target_ms"]))
    return rows


def paper_table_markdown(check: int = 0, hardware: dict[str, Any] | None = None) -> str:
    """One check of PAPER_CHECKS as the Markdown table docs/plan.md shows."""
    lines = ["| context | batch | alpha | gamma (paper) | paper | predicted | rel. error | roofline only | T_T ms "
             "| T_D/T_T | T_V/T_T |",
             "| ---: | ---: | ---: | :---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in paper_rows(check, hardware):
        if r["paper_low"] is None:
            paper, error = "-", "-"
        else:
            same = r["paper_low"] == r["paper_high"]
            paper = f"{r['paper_low']:.2f}" if same else f"{r['paper_low']:.2f}-{r['paper_high']:.2f}"
            error = f"{100 * r['error']:+.0f}%"
        paper_gamma = "?" if r["paper_gamma"] is None else r["paper_gamma"]
        lines.append(f"| {r['context']} | {r['batch']} | {r['acceptance']:.2f} | {r['gamma']} ({paper_gamma}) | "
                     f"{paper} | {r['predicted']:.2f} | {error} | {r['roofline_only']:.2f} | {r['t_target_ms']:.1f} | "
                     f"{r['td_over_tt']:.2f} | {r['tv_over_tt']:.2f} |")
    return "\n".join(lines)


def paper_tables_markdown() -> str:
    """Every check of PAPER_CHECKS, titled: the tables of docs/plan.md."""
    parts = []
    for index, (title, hw_name, _, _) in enumerate(PAPER_CHECKS):
        profile = hardware_profile(hw_name)["name"]
        parts.append(f"**Llama-3.1-8B, {title}**, StreamingLLM-512 self-speculation, tp 8, profile {profile}:\n\n"
                     + paper_table_markdown(index))
    return "\n\n".join(parts)


# (method, budget, alpha, pq_search) for `methods_table_markdown`: illustrative acceptances (PQCache
# the highest, as on the paper's needle tasks), not measured ones.
METHOD_CASES = [("streamingllm", 512, 0.80, "torch"), ("snapkv", 2048, 0.88, "torch"),
                ("pqcache", 2048, 0.95, "torch"), ("pqcache", 2048, 0.95, "fused")]


def methods_table_markdown(hardware: str = "h100", tp: int = 8, context: int = 32000,
                           batches: tuple[int, ...] = (1, 4, 16, 64, 128)) -> str:
    """Best gamma / speedup of each compressor by batch (Llama-3.1-8B), showing PQCache's search cost."""
    hw = hardware_profile(hardware)
    header = "| method | budget | alpha | " + " | ".join(f"B={b}" for b in batches) + " |"
    lines = [header, "| --- | ---: | ---: |" + " ---: |" * len(batches)]
    for method, budget, alpha, search in METHOD_CASES:
        cells = []
        for batch in batches:
            r = plan(shapes=shapes_for("llama-3.1-8b"), hardware=hw, batch=batch, context=context, method=method,
                     budget=budget, acceptance=alpha, tp=tp, pq_search=search)
            search_share = r["t_select_ms"] / r["t_draft_ms"]
            cells.append(f"g={r['gamma']} {r['predicted_speedup']:.2f}x"
                         + (f" ({100 * search_share:.0f}% search)" if method == "pqcache" else ""))
        label = f"{method} ({search} search)" if method == "pqcache" else method
        lines.append(f"| {label} | {budget} | {alpha:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.planning.paper", description=__doc__.splitlines()[0])
    parser.add_argument("--paper-table", action="store_true",
                        help="print the Markdown tables of docs/plan.md (predictions beside the paper's figures)")
    parser.add_argument("--methods-table", action="store_true",
                        help="print docs/plan.md's compressor comparison (8xH100, 32K, by batch)")
    args = parser.parse_args(argv)
    if args.paper_table:
        print(paper_tables_markdown())
    if args.methods_table:
        print(methods_table_markdown())
    if not (args.paper_table or args.methods_table):
        parser.print_help()


if __name__ == "__main__":
    main()
