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
        time_row(report),
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
    latency = report.get("latency", {})
    lat = latency.get("row_s")
    if lat:
        rows.append(("row latency p50/p90/p99" + (" from admission" if "from" in latency else ""),
                     f"{lat['p50']:.1f} / {lat['p90']:.1f} / {lat['p99']:.1f} s"))
    queue = latency.get("queue_s")
    if queue:
        rows.append(("queueing p50/p90/p99 (read to admission)",
                     f"{queue['p50']:.1f} / {queue['p90']:.1f} / {queue['p99']:.1f} s"))
    rows += memory_rows(report["memory"])
    hw = report["hardware"]
    rows.append(("hardware", f"{hw['device']} ({hw.get('name', '')}), {hw['threads']} threads, tp {hw['tp']}, dp {hw.get('dp', 1)}"))
    if hw.get("attention"):
        paths = hw["attention"]
        rows.append(("compute", f"{hw.get('dtype', '-')} GEMMs and KV cache; attention: decode {paths['decode']}, "
                                f"draft views {paths['draft_view']}, prefill {paths['prefill']}; "
                                f"linear layers: {hw.get('linear', 'torch')}; "
                                f"decode layers: {hw.get('decode_forward', 'transformers')}"))
    return rows


def time_row(report: dict[str, Any]) -> tuple[str, str]:
    """The one time line: total from process start and the parts that add up to it."""
    times = report.get("time")
    if not times:  # a report written before the `time` section existed: its wall_s excluded load
        job, th = report["job"], report["throughput"]
        return ("wall time", f"{job['wall_s']:.1f} s after the model loaded (load {job.get('load_s', 0):.1f} s "
                             f"before it; prefill {th['prefill_s']:.1f} s, decode {th['decode_s']:.1f} s within it)")
    names = ["startup", "load", "prefill", "decode", "other"]
    shown = rounded_parts(times["total_s"], [times[f"{n}_s"] for n in names])
    parts = " + ".join(f"{n} {v:.1f}" for n, v in zip(names, shown))
    note = times.get("note") or "in sequence, no part overlaps another"
    return ("time", f"{times['total_s']:.1f} s from process start = {parts} s ({note})")


def rounded_parts(total: float, parts: list[float], step: float = 0.1) -> list[float]:
    """The parts rounded to `step` so that the shown parts add up to the shown total (largest
    remainder), when they add up to it unrounded."""
    units = [p / step for p in parts]
    floors = [int(u // 1) for u in units]
    missing = round(total / step) - sum(floors)
    order = sorted(range(len(parts)), key=lambda i: units[i] - floors[i], reverse=True)
    if 0 <= missing <= len(parts):
        for i in order[:missing]:
            floors[i] += 1
        return [f * step for f in floors]
    return [round(u) * step for u in units]


def memory_rows(mem: dict[str, Any]) -> list[tuple[str, str]]:
    """Peak resident (what the process held) and the KV cache's allocation (what it reserved, and
    how much of that rows used), as two rows so that neither reads as part of the other."""
    gib = 2 ** 30
    kind = mem.get("peak_kind", "")
    label = "peak CUDA allocated" if kind.startswith("cuda") else "peak resident"
    rows = [(label, f"{mem['peak_bytes'] / gib:.2f} GiB" + (f" ({kind})" if kind else ""))]
    if mem.get("kv_cache_bytes"):
        touched = mem.get("kv_cache_touched_bytes")
        rows.append(("KV cache allocated", f"{mem['kv_cache_bytes'] / gib:.2f} GiB"
                     + (f" (touched: {touched / gib:.2f} GiB)" if touched is not None else "")))
    return rows


def _prefix_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    reuse = report.get("prefix_reuse") or {}
    if not reuse.get("enabled"):
        return []
    return [("prefix reuse", f"{reuse['tokens_reused']} prompt tokens reused; {reuse['hits']}/{reuse['lookups']} "
                             f"rows hit ({100 * reuse['hit_rate']:.0f}%); store peak {reuse['peak_tokens']} of "
                             f"{reuse['capacity_tokens']} tokens ({reuse['peak_bytes'] / 2**20:.0f} MiB)"
                             + (f"; decode read {100 * reuse['decode_reads_shared']:.0f}% of its K/V once per "
                                "group of rows sharing it" if reuse.get("decode_reads_shared") else ""))]


def render_markdown(report: dict[str, Any]) -> str:
    job = report["job"]
    lines = [f"# magicdec report: {Path(job['recipe']).name}", "",
             f"- model: `{job['model']}`", f"- input: `{job['input']}`", f"- output: `{job['output']}`",
             f"- started: {job.get('started_at', '')}", "", "| | |", "| --- | --- |"]
    lines += [f"| {label} | {value} |" for label, value in summary_rows(report)]
    return "\n".join(lines) + "\n"


def plot_series(report: dict[str, Any]) -> dict[str, Any] | None:
    """What the plot draws, from the report's timeline alone (None if it has no interval): step
    series over the interval edges (each value holds from its interval's start to the next edge,
    the last one repeated for the final edge), NaN wherever an interval had nothing to measure."""
    from engine.job.timeline import LOAD, intervals

    points = report.get("timeline") or []
    spans = intervals(points)
    if not spans:
        return None
    nan = float("nan")

    def steps(key: str) -> list[float]:
        values = [nan if s[key] is None else s[key] for s in spans]
        return values + values[-1:]

    edges = [s["start"] for s in spans] + [spans[-1]["end"]]
    end = (report.get("time") or {}).get("total_s") or edges[-1]
    loaded = next((p["t"] for p in points if p.get("phase") not in (LOAD, None)), points[0]["t"])
    return {"edges": edges, "decode_tokens_per_s": steps("decode_tokens_per_s"), "acceptance": steps("acceptance"),
            "gamma": steps("gamma"), "prefill_share": steps("prefill_share"), "decode_share": steps("decode_share"),
            "rows_t": [p["t"] for p in points], "rows": [p["rows"] for p in points], "spans": spans,
            "loaded_at": loaded, "xlim": (0.0, max(end, edges[-1]))}


def plot_timeline(report: dict[str, Any], path: Path) -> bool:
    """The job over its whole time axis (0 = process start): decode tokens/s and acceptance, rows done
    and mean gamma, and the share of each interval spent in prefill and decode (also shaded behind
    the panels; grey until the model has loaded). Only measured values are drawn: an interval
    without decode time has no tokens/s (a gap, not a zero). False if there is nothing to plot."""
    series = plot_series(report)
    if series is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = series["edges"]
    speculative = report["speculative"]["method"] != "none"
    fig, (ax_tps, ax_rows, ax_share) = plt.subplots(3, 1, figsize=(9, 6.5), sharex=True,
                                                    gridspec_kw={"height_ratios": [3, 2, 1.2]})
    for ax in (ax_tps, ax_rows):
        _shade_phases(ax, series)
    ax_tps.step(edges, series["decode_tokens_per_s"], where="post", color="tab:blue")
    ax_tps.set_ylabel("decode tokens/s", color="tab:blue")
    ax_tps.set_ylim(bottom=0)
    if speculative:
        ax_acc = ax_tps.twinx()
        ax_acc.step(edges, series["acceptance"], where="post", color="tab:orange")
        ax_acc.set_ylabel("acceptance", color="tab:orange")
        ax_acc.set_ylim(0, 1.05)
    ax_rows.step(series["rows_t"], series["rows"], where="post", color="black")
    ax_rows.set_ylabel("rows done")
    ax_rows.set_ylim(bottom=0)
    if speculative:
        ax_gamma = ax_rows.twinx()
        ax_gamma.step(edges, series["gamma"], where="post", color="tab:green")
        ax_gamma.set_ylabel("mean gamma", color="tab:green")
        ax_gamma.set_ylim(bottom=0)
    prefill = series["prefill_share"]
    both = [p + d for p, d in zip(prefill, series["decode_share"])]
    ax_share.fill_between(edges, 0, prefill, step="post", color=PREFILL_COLOR, label="prefill")
    ax_share.fill_between(edges, prefill, both, step="post", color=DECODE_COLOR, label="decode")
    ax_share.set_ylim(0, 1)
    ax_share.set_ylabel("time share")
    ax_share.legend(loc="upper right", fontsize="small", ncol=2)
    ax_share.set_xlabel("time since the process started (s); grey: start-up and model load")
    ax_share.set_xlim(*series["xlim"])
    ax_tps.set_title(f"{Path(report['job']['recipe']).name}: {report['speculative']['method']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


PREFILL_COLOR, DECODE_COLOR, LOAD_COLOR = "#f5b971", "#9cc3e6", "#d0d0d0"


def _shade_phases(ax, series: dict[str, Any]) -> None:
    """Grey until the model loaded, orange where an interval was mostly prefill, blue mostly decode."""
    ax.axvspan(0, series["loaded_at"], color=LOAD_COLOR, alpha=0.5, lw=0)
    for span in series["spans"]:
        if span["end"] <= series["loaded_at"]:
            continue
        if span["prefill_share"] >= 0.5:
            ax.axvspan(span["start"], span["end"], color=PREFILL_COLOR, alpha=0.35, lw=0)
        elif span["decode_share"] >= 0.5:
            ax.axvspan(span["start"], span["end"], color=DECODE_COLOR, alpha=0.35, lw=0)
