"""The per-job report: counters -> JSON (the contract's keys), a Markdown twin and a PNG plot.

`JobReport` collects what the job runner tells it (rows, latencies, a timeline of progress samples)
and the engine's `EngineStats`, and renders `report.json`, `report.md` and `report.png` side by side.
It computes nothing about decoding itself and never touches models or input files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.stats import EngineStats


@dataclasses.dataclass
class JobReport:
    recipe: str
    model: str
    input: str
    output: str
    method: str
    budget: int
    device: str
    tp: int = 1
    dp: int = 1
    draft_gemms: str = "-"  # dtype of the draft's linear layers ("-" without a draft)
    started: float = dataclasses.field(default_factory=time.time)
    load_s: float = 0.0
    rows_ok: int = 0
    rows_failed: int = 0
    rows_resumed: int = 0  # already in the output when the job started (--resume)
    resumed_failed: int = 0  # of those, error records
    latencies: list[float] = dataclasses.field(default_factory=list)
    first_token: list[float] = dataclasses.field(default_factory=list)
    timeline: list[dict[str, float]] = dataclasses.field(default_factory=list)
    kv_cache_bytes: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def sample(self, stats: EngineStats) -> None:
        """Record one point of the throughput / acceptance timeline."""
        self.timeline.append({
            "t": time.time() - self.started,
            "rows": self.rows_ok + self.rows_failed,
            "decode_tokens": stats.decode_tokens,
            "decode_s": stats.decode_s,
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
        })

    @property
    def exit_code(self) -> int:
        return 1 if self.rows_failed or self.resumed_failed else 0

    def to_dict(self, stats: EngineStats) -> dict[str, Any]:
        wall = time.time() - self.started
        return {
            "job": {
                "recipe": self.recipe, "model": self.model, "input": self.input, "output": self.output,
                "rows": self.rows_ok + self.rows_failed + self.rows_resumed,
                "rows_ok": self.rows_ok + self.rows_resumed - self.resumed_failed,
                "rows_failed": self.rows_failed + self.resumed_failed,
                "rows_this_run": self.rows_ok + self.rows_failed,
                "rows_resumed": self.rows_resumed,
                "wall_s": wall, "load_s": self.load_s,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
                "exit_code": self.exit_code,
            },
            "throughput": stats.throughput_summary(),
            "speculative": {**stats.speculative_summary(self.method, self.budget), "draft_gemms": self.draft_gemms},
            "latency": {"row_s": percentiles(self.latencies), "first_token_s": percentiles(self.first_token)},
            "memory": {"peak_bytes": peak_memory_bytes(self.device), "kv_cache_bytes": self.kv_cache_bytes},
            "hardware": hardware_summary(self.device, self.tp, self.dp),
            "timeline": self.timeline,
            **self.extra,
        }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def peak_memory_bytes(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kib * (1 if sys.platform == "darwin" else 1024))


def hardware_summary(device: str, tp: int, dp: int) -> dict[str, Any]:
    name = platform.processor() or platform.machine()
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    return {"device": device, "name": name, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "tp": tp, "dp": dp, "torch": torch.__version__}


# ---------------------------------------------------------------------------------------- writing


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
        ("prefill", f"{th['prefill_tokens']} tokens"),
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
