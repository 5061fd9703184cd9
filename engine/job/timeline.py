"""A job's timeline: points sampled on a clock and at phase changes, for the report's plot.

`Timeline.mark(phase, stats, rows)` is called before every piece of work (the scheduler's `on_phase`
hook: before each prefill chunk and each decoding round) and at the job's own milestones (load
start, load end, the end). It records a point when the phase changes (at most one every
`min_gap_s`) or when `clock_s` has passed since the last point, so a job of any length gets points
spread over its whole time axis, prefill included. A point holds *cumulative* counters (rows done,
prefill and decode tokens and seconds, rounds, draft and accepted tokens), so any two points give
the exact rates and time shares of the interval between them and dropping points loses nothing:
past `max_points` every other point is dropped and the clock slows down by half. Times are seconds
since the process started. Nothing here draws (that is `engine.job.report_render`) or knows how
rows are decoded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

CLOCK_S = 1.0  # a point at least this often while work goes on
MIN_GAP_S = 0.1  # phase changes closer than this to the last point are not recorded on their own
MAX_POINTS = 3600  # an hour at one point per second; beyond it the clock halves its rate

EXEC_GAP_S = 10.0  # Python's init before the first import never takes this long: a bigger gap was a shell
LOAD, OTHER, END = "load", "other", "end"  # the job's own phases (the scheduler adds prefill and decode)


def process_started(imported_at: float | None = None) -> float:
    """time.time() at which this process started: Linux's /proc/self/stat (its start in clock ticks
    since boot, against CLOCK_BOOTTIME), so interpreter start-up and imports count; else now.

    imported_at: when the caller's first module was imported. That start is the process's fork, and
    a shell runs the last command of `sh -c "setup && magicdec run ..."` (or of a `( ... )` subshell)
    by exec in its own process, so the fork can be minutes before magicdec began. When it is more
    than EXEC_GAP_S before imported_at, imported_at is the start (only Python's own init is missed).
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        if age >= 0:
            forked = time.time() - age
            return imported_at if imported_at is not None and imported_at - forked > EXEC_GAP_S else forked
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return imported_at if imported_at is not None else time.time()


class Timeline:
    def __init__(self, origin: float, *, clock_s: float | None = None, min_gap_s: float | None = None,
                 max_points: int | None = None, now: Callable[[], float] = time.time):
        """origin: time.time() of t = 0 (the process start); now: the clock (a test may pass its own);
        clock_s, min_gap_s, max_points: None for CLOCK_S, MIN_GAP_S, MAX_POINTS."""
        self.origin = origin
        self.clock_s = CLOCK_S if clock_s is None else clock_s
        self.min_gap_s = MIN_GAP_S if min_gap_s is None else min_gap_s
        self.max_points = MAX_POINTS if max_points is None else max_points
        self.now = now
        self.points: list[dict[str, Any]] = []
        self.phase: str | None = None

    def mark(self, phase: str, stats, rows: int, *, force: bool = False) -> bool:
        """`phase` is about to run (or, for END, everything has): record a point if it is due.

        stats: the engine's EngineStats (None before the engine exists: all counters 0).
        Returns whether a point was recorded.
        """
        t = self.now() - self.origin
        since = t - self.points[-1]["t"] if self.points else float("inf")
        changed = phase != self.phase
        self.phase = phase
        if force or since >= self.clock_s or (changed and since >= self.min_gap_s):
            self.points.append(point(t, phase, stats, rows))
            if len(self.points) > self.max_points:
                self._thin()
            return True
        return False

    def _thin(self) -> None:
        """Keep every other point (and the newest) and sample half as often from now on."""
        kept = self.points[::2]
        if kept[-1] is not self.points[-1]:
            kept.append(self.points[-1])
        self.points[:] = kept
        self.clock_s *= 2
        self.min_gap_s *= 2


def point(t: float, phase: str, stats, rows: int) -> dict[str, Any]:
    get = (lambda name: getattr(stats, name)) if stats is not None else (lambda name: 0)
    return {
        "t": t, "phase": phase, "rows": rows,
        "prefill_tokens": get("prefill_tokens"), "prefill_s": get("prefill_s"),
        "decode_tokens": get("decode_tokens"), "decode_s": get("decode_s"),
        "rounds": get("rounds"), "gamma_sum": get("gamma_sum"),
        "draft_tokens": get("draft_tokens"), "accepted_tokens": get("accepted_tokens"),
    }


def intervals(points: list[dict[str, Any]]) -> list[dict[str, float]]:
    """What happened between consecutive points: start, end, time shares and rates.

    Rates are None where the interval had nothing to measure (no decode time, no drafts, no rounds),
    never a made-up zero. prefill/decode shares are of the interval's wall time; `other` is the rest
    (reading and tokenising rows, writing results, loading the model before the first point).
    """
    out = []
    for a, b in zip(points, points[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        prefill = b.get("prefill_s", 0.0) - a.get("prefill_s", 0.0)
        decode = b["decode_s"] - a["decode_s"]
        drafted = b["draft_tokens"] - a["draft_tokens"]
        rounds = b.get("rounds", 0) - a.get("rounds", 0)
        out.append({
            "start": a["t"], "end": b["t"], "phase": a.get("phase", OTHER),
            "prefill_share": min(1.0, max(0.0, prefill / dt)), "decode_share": min(1.0, max(0.0, decode / dt)),
            "decode_tokens_per_s": (b["decode_tokens"] - a["decode_tokens"]) / decode if decode > 0 else None,
            "acceptance": (b["accepted_tokens"] - a["accepted_tokens"]) / drafted if drafted > 0 else None,
            "gamma": (b.get("gamma_sum", 0) - a.get("gamma_sum", 0)) / rounds if rounds > 0 else None,
            "rows": b["rows"],
        })
    return out
