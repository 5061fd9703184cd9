"""Rows of the CLI's two-column tables that only the terminal shows (a job's summary rows are
`engine.job.report_render.summary_rows`, shared with the Markdown report)."""

from __future__ import annotations

from typing import Any


def display_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows for a terminal table of one plan (what `magicdec plan` might print)."""
    gamma = result["gamma"]
    verdict = "speculate" if gamma else "decode plainly (speculation does not pay)"
    rows = [
        ("gamma", f"{gamma}{' (fixed)' if result['gamma_fixed'] else ''}: {verdict}"),
        ("predicted speedup", f"{result['predicted_speedup']:.2f}x"),
        ("acceptance (alpha)", f"{result['acceptance']:.2f} -> {result['expected_tokens']:.2f} tokens/round"),
        ("T_T target step", f"{result['t_target_ms']:.2f} ms ({result['target_bound']}-bound, "
                            f"KV {100 * result['kv_share']:.0f}%)"),
        ("T_D draft step", f"{result['t_draft_ms']:.2f} ms ({result['t_draft_ms'] / result['t_target_ms']:.2f} T_T"
                           + (f", search {result['t_select_ms']:.2f} ms)" if result["t_select_ms"] else ")")),
        (f"T_V verify (g={max(gamma, 1)})", f"{result['t_verify_ms']:.2f} ms "
                                            f"({result['t_verify_ms'] / result['t_target_ms']:.2f} T_T)"),
        ("speedup by gamma", " ".join(f"{g}:{s:.2f}" for g, s in zip(result["gammas"], result["speedup_by_gamma"]))),
    ]
    return rows
