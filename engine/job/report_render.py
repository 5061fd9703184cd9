"""Rendering a job report: the JSON file, its Markdown twin and a PNG plot of the timeline, and the
(label, value) rows both the Markdown and the terminal table show. Reads a report dict only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(report: dict[str, Any], path: Path) -> list[Path]:
    """Write <path> (JSON), its .md twin and a .png plot next to it; returns the paths written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(report, indent=2, default=str) + "\n")
    md = twin_path(path, ".md")
    _atomic_write(md, render_markdown(report))
    written = [path, md]
    png = twin_path(path, ".png")
    if plot_timeline(report, png):
        written.append(png)
    return written


def twin_path(path: Path, suffix: str) -> Path:
    return path.with_suffix(suffix) if path.suffix == ".json" else Path(str(path) + suffix)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs shown by the CLI and the Markdown report."""
    job, th, sp = report["job"], report["throughput"], report["speculative"]
    rows = [
        ("rows", f"{job['rows']} ({job['rows_ok']} ok, {job['rows_failed']} failed"
                 + (f", {job['rows_resumed']} resumed" if job.get("rows_resumed") else "") + ")"),
        ("wall time", f"{job['wall_s']:.1f} s (load {job.get('load_s', 0):.1f} s, prefill {th['prefill_s']:.1f} s, "
                      f"decode {th['decode_s']:.1f} s)"),
        ("prefill", f"{th['prefill_tokens']} tokens computed"
                    + (f", {th['prefill_tokens_per_s']:.1f} tokens/s" if th.get("prefill_tokens_per_s") else "")),
        *_prefix_rows(report),
        ("decode", f"{th['decode_tokens']} tokens, {th['decode_tokens_per_s']:.1f} tokens/s"),
        ("total throughput", f"{th['total_tokens_per_s']:.1f} tokens/s"),
        ("method", f"{sp['method']}" + (f" (budget {sp['budget']}, mean gamma {sp['gamma']:.2f}, "
                                         f"draft GEMMs {sp.get('draft_gemms', '-')})"
                                         if sp["method"] != "none" else "")),
    ]
    if sp["method"] != "none":
        per_pos = ", ".join(f"{x:.2f}" for x in sp["per_position_acceptance"])
        rows += [
            ("acceptance rate", f"{sp['acceptance_rate']:.3f} ({sp['accepted_tokens']}/{sp['draft_tokens']})"),
            ("mean accepted length", f"{sp['mean_accepted_length']:.2f}"),
            ("per-position acceptance", per_pos or "-"),
            ("draft / verify / select", f"{sp['draft_s']:.1f} s / {sp['verify_s']:.1f} s / {sp.get('select_s', 0):.1f} s"),
        ]
    lat = report.get("latency", {}).get("row_s")
    if lat:
        rows.append(("row latency p50/p90/p99", f"{lat['p50']:.1f} / {lat['p90']:.1f} / {lat['p99']:.1f} s"))
    mem = report["memory"]
    rows.append(("peak memory", f"{mem['peak_bytes'] / 2**30:.2f} GiB (KV cache {mem.get('kv_cache_bytes', 0) / 2**30:.2f} GiB)"))
    hw = report["hardware"]
    rows.append(("hardware", f"{hw['device']} ({hw.get('name', '')}), {hw['threads']} threads, tp {hw['tp']}, dp {hw.get('dp', 1)}"))
    return rows


def _prefix_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    reuse = report.get("prefix_reuse") or {}
    if not reuse.get("enabled"):
        return []
    return [("prefix reuse", f"{reuse['tokens_reused']} prompt tokens reused; {reuse['hits']}/{reuse['lookups']} "
                             f"rows hit ({100 * reuse['hit_rate']:.0f}%); store peak {reuse['peak_tokens']} of "
                             f"{reuse['capacity_tokens']} tokens ({reuse['peak_bytes'] / 2**20:.0f} MiB)")]


def render_markdown(report: dict[str, Any]) -> str:
    job = report["job"]
    lines = [f"# magicdec report: {Path(job['recipe']).name}", "",
             f"- model: `{job['model']}`", f"- input: `{job['input']}`", f"- output: `{job['output']}`",
             f"- started: {job.get('started_at', '')}", "", "| | |", "| --- | --- |"]
    lines += [f"| {label} | {value} |" for label, value in summary_rows(report)]
    return "\n".join(lines) + "\n"


def plot_timeline(report: dict[str, Any], path: Path) -> bool:
    """Decode throughput and acceptance rate over the job; False if there is nothing to plot."""
    points = report.get("timeline") or []
    if len(points) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p["t"] for p in points]
    tps, acc = [], []
    for a, b in zip(points, points[1:]):
        dt = b["decode_s"] - a["decode_s"]
        tps.append((b["decode_tokens"] - a["decode_tokens"]) / dt if dt > 0 else 0.0)
        dd = b["draft_tokens"] - a["draft_tokens"]
        acc.append((b["accepted_tokens"] - a["accepted_tokens"]) / dd if dd > 0 else float("nan"))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t[1:], tps, color="tab:blue")
    ax.set_xlabel("job time (s)")
    ax.set_ylabel("decode tokens/s", color="tab:blue")
    if report["speculative"]["method"] != "none":
        ax2 = ax.twinx()
        ax2.plot(t[1:], acc, color="tab:orange")
        ax2.set_ylabel("acceptance rate", color="tab:orange")
        ax2.set_ylim(0, 1)
    ax.set_title(f"{Path(report['job']['recipe']).name}: {report['speculative']['method']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
