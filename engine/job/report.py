"""The per-job report: counters -> JSON (the contract's keys), a Markdown twin and a PNG plot.

`JobReport` collects what the job runner tells it (rows, latencies, a timeline of progress samples)
and the engine's `EngineStats`, and turns them into the report dict (`engine.job.report_render`
writes it as JSON, Markdown and a plot). It computes nothing about decoding itself and never
touches models or input files.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import sys
import time
from typing import Any

import torch

from engine.core.stats import EngineStats


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
    prefix_reuse: dict[str, Any] = dataclasses.field(default_factory=lambda: {"enabled": False})  # prefix_summary()
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
            "prefix_reuse": self.prefix_reuse,
            "timeline": self.timeline,
            **self.extra,
        }


def prefix_summary(store) -> dict[str, Any]:
    """The prefix store's counters (an engine.core.prefix_store.PrefixStore, or None with reuse off)."""
    if store is None:
        return {"enabled": False}
    st = store.stats
    return {"enabled": True, "block_tokens": store.block, "capacity_tokens": store.max_blocks * store.block,
            "lookups": st.lookups, "hits": st.hits, "hit_rate": st.hits / st.lookups if st.lookups else 0.0,
            "tokens_reused": st.tokens_reused, "peak_tokens": st.peak_blocks * store.block,
            "peak_bytes": st.peak_blocks * store.block * store.bytes_per_token}


def merge_prefix_summaries(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary for stores that served disjoint rows (data-parallel groups): counts add up."""
    if not parts or not parts[0].get("enabled"):
        return {"enabled": False}
    merged = dict(parts[0])
    for key in ("lookups", "hits", "tokens_reused", "peak_tokens", "peak_bytes", "capacity_tokens"):
        merged[key] = sum(p[key] for p in parts)
    merged["hit_rate"] = merged["hits"] / merged["lookups"] if merged["lookups"] else 0.0
    return merged


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
