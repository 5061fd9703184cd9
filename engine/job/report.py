"""The per-job report: counters -> JSON (the contract's keys), a Markdown twin and a PNG plot.

`JobReport` collects what the job runner tells it (rows, latencies, queueing times, the timeline of
`engine.job.timeline`, when the process started and the model loaded) and the engine's
`EngineStats`, and turns them into the report dict, whose `time` section is the job's one time
line (total from process start = startup + load + prefill + decode + other) (`engine.job.report_render`
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
    dtype: str = "-"  # the target's weights, activations and KV cache (its GEMMs run in it)
    attention: dict[str, str] = dataclasses.field(default_factory=dict)  # engine.core.attention.attention_paths
    linear: str = "-"  # who computes the target's few-row GEMMs (engine.core.linear.linear_path)
    decode_forward: str = "-"  # who runs the target's decode/verify layers (ModelRunner.decode_path)
    host_malloc: str = "-"  # what the C library does with freed host memory (engine.core.host_memory)
    started: float = dataclasses.field(default_factory=time.time)  # time.time() once the model has loaded
    load_s: float = 0.0
    load_started: float | None = None  # time.time() when loading began (None: started - load_s)
    process_started: float | None = None  # time.time() when the process began (None: load_started)
    rows_ok: int = 0
    rows_failed: int = 0
    rows_resumed: int = 0  # already in the output when the job started (--resume)
    resumed_failed: int = 0  # of those, error records
    latencies: list[float] = dataclasses.field(default_factory=list)  # per row: admission to finish
    first_token: list[float] = dataclasses.field(default_factory=list)  # per row: admission to first token
    queue: list[float] = dataclasses.field(default_factory=list)  # per row: read from the input to admission
    timeline: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # engine.job.timeline points
    kv_cache_bytes: int = 0  # allocated, target + separate draft + compact store
    kv_touched_bytes: int = 0  # of it, what rows used (engine.core.kv_cache.KVCache.touched_bytes)
    memory_check_bytes: int = 0  # what the memory check counted before loading (KV cache, stores, weights)
    prefix_reuse: dict[str, Any] = dataclasses.field(default_factory=lambda: {"enabled": False})  # prefix_summary()
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def rows_done(self) -> int:
        """Rows this run has finished (ok or error record)."""
        return self.rows_ok + self.rows_failed

    @property
    def exit_code(self) -> int:
        return 1 if self.rows_failed or self.resumed_failed else 0

    def time_parts(self, stats: EngineStats, now: float) -> dict[str, Any]:
        """The job's one time line: total from process start = startup + load + prefill + decode + other."""
        load_started = self.load_started if self.load_started is not None else self.started - self.load_s
        process_started = self.process_started if self.process_started is not None else load_started
        return time_parts(total=now - process_started, startup=load_started - process_started, load=self.load_s,
                          prefill=stats.prefill_s, decode=stats.decode_s)

    def to_dict(self, stats: EngineStats) -> dict[str, Any]:
        now = time.time()
        times = self.time_parts(stats, now)
        peak, peak_kind = peak_memory(self.device)
        return {
            "job": {
                "recipe": self.recipe, "model": self.model, "input": self.input, "output": self.output,
                "rows": self.rows_ok + self.rows_failed + self.rows_resumed,
                "rows_ok": self.rows_ok + self.rows_resumed - self.resumed_failed,
                "rows_failed": self.rows_failed + self.resumed_failed,
                "rows_this_run": self.rows_ok + self.rows_failed,
                "rows_resumed": self.rows_resumed,
                # wall_s: from the model loaded to the report (= prefill + decode + other of `time`);
                # total_s: from the process start (= every part of `time`).
                "wall_s": now - self.started, "load_s": self.load_s, "total_s": times["total_s"],
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
                "exit_code": self.exit_code,
            },
            "time": times,
            "throughput": stats.throughput_summary(),
            "speculative": {**stats.speculative_summary(self.method, self.budget), "draft_gemms": self.draft_gemms},
            # row_s and first_token_s count from the row's admission into a slot; queue_s from its
            # reading off the input to that admission.
            "latency": {"row_s": percentiles(self.latencies), "first_token_s": percentiles(self.first_token),
                        "queue_s": percentiles(self.queue), "from": "admission"},
            "memory": {"peak_bytes": peak, "peak_kind": peak_kind, "kv_cache_bytes": self.kv_cache_bytes,
                       "kv_cache_touched_bytes": self.kv_touched_bytes, "check_bytes": self.memory_check_bytes},
            "hardware": {**hardware_summary(self.device, self.tp, self.dp), "dtype": self.dtype,
                         "attention": self.attention, "linear": self.linear,
                         "decode_forward": self.decode_forward, "host_malloc": self.host_malloc},
            "prefix_reuse": self.prefix_reuse,
            "timeline": self.timeline,
            **self.extra,
        }


TIME_PARTS = ("startup", "load", "prefill", "decode", "other")


def time_parts(*, total: float, startup: float, load: float, prefill: float, decode: float) -> dict[str, Any]:
    """total and its parts, `other` being the rest, so they add up exactly (one process, one thread:
    the parts never overlap). startup: process start to the model load (imports, checks, counting
    the input); other: reading and tokenising rows, writing results, the report."""
    parts = {"startup_s": startup, "load_s": load, "prefill_s": prefill, "decode_s": decode}
    return {"total_s": total, **parts, "other_s": total - sum(parts.values()), "from": "process start",
            "overlap": "none"}


def prefix_summary(store, cache=None) -> dict[str, Any]:
    """The prefix store's counters (an engine.core.prefix_store.PrefixStore, or None with reuse off),
    and how much of the full-cache forwards' K/V reading its rows shared (the target's KVCache)."""
    if store is None:
        return {"enabled": False}
    st = store.stats
    read = cache.positions_read if cache is not None else 0
    shared = cache.positions_shared if cache is not None else 0
    return {"enabled": True, "block_tokens": store.block, "capacity_tokens": store.max_blocks * store.block,
            "lookups": st.lookups, "hits": st.hits, "hit_rate": st.hits / st.lookups if st.lookups else 0.0,
            "tokens_reused": st.tokens_reused, "peak_tokens": st.peak_blocks * store.block,
            "peak_bytes": st.peak_blocks * store.block * store.bytes_per_token,
            # decode / verify K/V positions (summed over rows) and those read once for a group instead
            "decode_positions_read": read, "decode_positions_shared": shared,
            "decode_reads_shared": shared / read if read else 0.0}


def merge_prefix_summaries(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary for stores that served disjoint rows (data-parallel groups): counts add up."""
    if not parts or not parts[0].get("enabled"):
        return {"enabled": False}
    merged = dict(parts[0])
    for key in ("lookups", "hits", "tokens_reused", "peak_tokens", "peak_bytes", "capacity_tokens",
                "decode_positions_read", "decode_positions_shared"):
        merged[key] = sum(p.get(key, 0) for p in parts)
    merged["hit_rate"] = merged["hits"] / merged["lookups"] if merged["lookups"] else 0.0
    read = merged["decode_positions_read"]
    merged["decode_reads_shared"] = merged["decode_positions_shared"] / read if read else 0.0
    return merged


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


PEAK_RESIDENT = "whole process, ru_maxrss"  # what memory.peak_bytes measures, on CPU
PEAK_CUDA = "cuda, torch.cuda.max_memory_allocated"  # and on a GPU


def peak_memory(device: str) -> tuple[int, str]:
    """(bytes, what they measure): the process's peak resident set, or on CUDA torch's peak allocation."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), PEAK_CUDA
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kib * (1 if sys.platform == "darwin" else 1024)), PEAK_RESIDENT


def hardware_summary(device: str, tp: int, dp: int) -> dict[str, Any]:
    name = platform.processor() or platform.machine()
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    return {"device": device, "name": name, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "tp": tp, "dp": dp, "torch": torch.__version__}
