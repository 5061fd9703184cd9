"""What the report says about time and memory: the clock-sampled timeline, the scheduler's phase hook,
queueing time, the KV cache's touched bytes, one time line whose parts add up, and the plot's series."""

from __future__ import annotations

import math
import random
import re
import time

import pytest

from conftest import random_prompts
from engine.config.loading import recipe_from_dict
from engine.core.kv_cache import KVCache
from engine.core.runner import ModelRunner
from engine.core.sequence import Request
from engine.core.stats import EngineStats
from engine.job.report import JobReport, time_parts
from engine.job.report_render import plot_series, render_markdown, rounded_parts, summary_rows
from engine.job.timeline import EXEC_GAP_S, Timeline, intervals, process_started
from engine.spec.decoder import build_engine


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def marks(timeline, clock, schedule, stats=None):
    """schedule: (time, phase) pairs, marked in order."""
    for t, phase in schedule:
        clock.t = timeline.origin + t
        timeline.mark(phase, stats, 0)
    return [(round(p["t"], 6), p["phase"]) for p in timeline.points]


# ------------------------------------------------------------------ the sampler


def test_points_come_on_the_clock_and_at_phase_changes():
    clock = FakeClock()
    timeline = Timeline(clock.t, clock_s=1.0, min_gap_s=0.1, now=clock)
    schedule = [(0.0, "prefill"), (0.4, "prefill"), (0.9, "prefill"), (1.0, "prefill"),  # clock: 1.0
                (1.05, "decode"),  # a change, but 0.05 s after the last point: not on its own
                (1.3, "decode"), (1.9, "decode"), (2.05, "decode"),  # clock: 2.05
                (2.3, "prefill"),  # a change 0.25 s after: recorded
                (2.35, "decode")]  # a change 0.05 s after: not
    assert marks(timeline, clock, schedule) == [(0.0, "prefill"), (1.0, "prefill"), (2.05, "decode"),
                                                (2.3, "prefill")]


def test_a_long_job_keeps_points_spread_over_its_whole_axis_within_the_cap():
    clock = FakeClock()
    timeline = Timeline(clock.t, clock_s=1.0, max_points=50, now=clock)
    stats = EngineStats()
    for step in range(1000):  # 1000 s of rounds, 0.5 s each
        clock.t = timeline.origin + step * 0.5
        stats.decode_tokens += 10
        stats.decode_s += 0.5
        timeline.mark("decode", stats, step)
    points = timeline.points
    assert len(points) <= 50
    assert points[0]["t"] == 0.0 and points[-1]["t"] >= 499.0 - timeline.clock_s
    gaps = [b["t"] - a["t"] for a, b in zip(points, points[1:])]
    assert max(gaps) <= timeline.clock_s + 0.5, "the thinned points still cover the axis evenly"
    # Counters are cumulative, so thinning loses nothing: the rates between kept points are exact.
    assert all(s["decode_tokens_per_s"] == pytest.approx(20.0) for s in intervals(points))


def test_intervals_give_measured_rates_only():
    stats = EngineStats()
    clock = FakeClock()
    timeline = Timeline(clock.t, clock_s=1.0, now=clock)
    timeline.mark("load", None, 0, force=True)
    clock.t += 2.0
    timeline.mark("other", stats, 0, force=True)  # the model loaded: 2 s, nothing decoded
    clock.t += 1.0
    stats.prefill_s, stats.prefill_tokens = 0.75, 300
    timeline.mark("decode", stats, 0)
    clock.t += 1.0
    stats.decode_s, stats.decode_tokens, stats.rounds, stats.gamma_sum = 0.5, 40, 10, 30
    stats.draft_tokens, stats.accepted_tokens = 120, 90
    timeline.mark("decode", stats, 4)
    clock.t += 1.0
    timeline.mark("end", stats, 4, force=True)  # writing the output: no decode, no drafts
    spans = intervals(timeline.points)
    assert [s["phase"] for s in spans] == ["load", "other", "decode", "decode"]
    assert spans[0]["decode_tokens_per_s"] is None and spans[0]["prefill_share"] == 0.0
    assert spans[1]["prefill_share"] == pytest.approx(0.75)
    assert spans[2]["decode_tokens_per_s"] == pytest.approx(80.0) and spans[2]["decode_share"] == pytest.approx(0.5)
    assert spans[2]["acceptance"] == pytest.approx(0.75) and spans[2]["gamma"] == pytest.approx(3.0)
    assert spans[3]["decode_tokens_per_s"] is None, "no decode time: no rate, never a made-up 0"
    assert spans[3]["acceptance"] is None and spans[3]["gamma"] is None


def test_process_start_is_before_now_and_after_boot():
    started = process_started()
    assert started <= time.time()
    assert time.time() - started < 10 * 24 * 3600


def test_a_process_that_became_magicdec_by_exec_long_after_its_fork_starts_at_the_import():
    # `sh -c "scripts/setup && magicdec run ..."` execs magicdec in the shell's process: its fork
    # time is then the shell's, and the set-up's minutes must not count as magicdec's start-up.
    forked = process_started()
    assert process_started(forked + EXEC_GAP_S + 5) == forked + EXEC_GAP_S + 5
    assert process_started(forked + 1.0) == pytest.approx(forked, abs=0.05), "a normal start keeps the fork time"


# ------------------------------------------------------------------ the engine's hooks


def engine_recipe(**over):
    raw = {"model": "tiny", "draft": {"method": "none"},
           "batch": {"size": 1, "prefill_chunk": 16, "prefix_reuse": False}, "sampling": {"max_new_tokens": 6}}
    for key, value in over.items():
        section, _, leaf = key.partition("__")
        raw.setdefault(section, {})[leaf] = value
    return recipe_from_dict(raw)


def requests(prompts, max_new):
    for i, prompt in enumerate(prompts):
        yield Request(i, i, prompt, max_new, enqueued_at=time.perf_counter())


@pytest.mark.parametrize("method", ["none", "streamingllm"])
def test_scheduler_calls_the_observer_before_every_prefill_chunk_and_round(tiny, method, monkeypatch):
    loaded, _ = tiny
    recipe = engine_recipe(batch__size=2, draft__method=method, draft__budget=16, draft__sink=4, spec__gamma=2)
    forwards = []  # every packed prefill forward (a wave's prompts share 16-token chunks)
    original = ModelRunner.prefill
    monkeypatch.setattr(ModelRunner, "prefill", lambda self, tokens, batch: forwards.append(len(tokens))
                        or original(self, tokens, batch))
    rounds = []
    engine = build_engine(recipe, loaded, on_round=rounds.append)
    phases = []
    engine.on_phase = phases.append
    prompts = random_prompts(4, 20, 50)
    results = list(engine.run(requests(prompts, 6)))
    assert len(results) == 4
    assert sum(forwards) == sum(len(p) for p in prompts) and max(forwards) <= 16
    assert len(forwards) >= math.ceil(sum(len(p) for p in prompts) / 16)
    assert phases.count("prefill") == len(forwards), "one call before each prefill chunk"
    assert phases.count("decode") == len(rounds) == engine.stats.rounds, "one call before each round"
    assert phases[0] == "prefill" and set(phases) == {"prefill", "decode"}


def test_queueing_and_touched_kv_follow_the_rows(tiny):
    """One slot: each row waits for the one before it, and the cache's high-water mark is the longest row."""
    loaded, _ = tiny
    engine = build_engine(engine_recipe(), loaded)
    prompts = random_prompts(3, 20, 50)
    results = list(engine.run(requests(prompts, 6)))  # admitted longest prompt first
    for before, after in zip(results, results[1:]):
        assert after.queue_s >= before.latency_s, "a row queues at least while the row ahead of it runs"
    cache = engine.target.cache
    committed = max(r.prompt_tokens + r.output_tokens - 1 for r in results)  # the last token is never cached
    assert cache.touched_bytes == committed * cache.bytes_per_token
    assert cache.bytes_per_token == KVCache.bytes_needed(layers=cache.layers, slots=1, kv_heads=cache.kv_heads,
                                                         head_dim=cache.head_dim, capacity=1, dtype=cache.k.dtype)
    assert cache.touched_bytes < cache.nbytes


# ------------------------------------------------------------------ one time line


def report_with(*, load_s=4.0, prefill=6.25, decode=3.5, rows=3):
    """A job whose process started 20 s ago and began loading its model 2.5 s after that."""
    process = time.time() - 20.0
    load_started = process + 2.5
    report = JobReport(recipe="code", model="m", input="in.jsonl", output="out.jsonl", method="none", budget=0,
                       device="cpu", started=load_started + load_s, load_s=load_s, load_started=load_started,
                       process_started=process, rows_ok=rows, latencies=[1.0, 2.0, 3.0], queue=[0.0, 1.0, 2.0])
    stats = EngineStats(prefill_s=prefill, decode_s=decode, prefill_tokens=500, decode_tokens=90)
    return report, stats


def test_time_parts_add_up_to_the_total_from_process_start():
    report, stats = report_with()
    parts = report.time_parts(stats, now=report.process_started + 20.0)
    assert parts["total_s"] == pytest.approx(20.0)
    assert (parts["startup_s"], parts["load_s"], parts["prefill_s"], parts["decode_s"]) == (2.5, 4.0, 6.25, 3.5)
    assert parts["other_s"] == pytest.approx(3.75)
    assert sum(parts[f"{n}_s"] for n in ("startup", "load", "prefill", "decode", "other")) == pytest.approx(20.0)


def test_shown_parts_add_up_to_the_shown_total():
    rng = random.Random(0)
    for _ in range(2000):
        parts = [rng.uniform(0, 50) * rng.choice([0, 1, 1, 1]) for _ in range(5)]
        total = sum(parts)
        shown = rounded_parts(total, parts)
        assert round(sum(shown), 6) == round(round(total / 0.1) * 0.1, 6)
        assert all(abs(s - p) < 0.1 + 1e-9 for s, p in zip(shown, parts))


def time_row_numbers(text: str) -> tuple[float, list[float]]:
    match = re.search(r"([\d.]+) s from process start = startup ([\d.]+) \+ load ([\d.]+) \+ prefill ([\d.]+) "
                      r"\+ decode ([\d.]+) \+ other ([\d.]+) s", text)
    assert match, text
    values = [float(x) for x in match.groups()]
    return values[0], values[1:]


def test_the_table_and_the_markdown_state_one_time_line_latency_from_admission_and_two_memories():
    report, stats = report_with()
    summary = report.to_dict(stats)
    rows = dict(summary_rows(summary))
    total, parts = time_row_numbers(rows["time"])
    assert sum(parts) == pytest.approx(total, abs=1e-6)
    assert total == pytest.approx(summary["time"]["total_s"], abs=0.05)
    markdown = render_markdown(summary)
    total_md, parts_md = time_row_numbers(markdown)
    assert (total_md, parts_md) == (total, parts)
    assert "row latency p50/p90/p99 from admission" in rows and "queueing p50/p90/p99 (read to admission)" in rows
    assert rows["peak resident"].endswith("GiB (whole process, ru_maxrss)")
    assert summary["memory"]["peak_kind"] == "whole process, ru_maxrss"
    # The old keys keep their meaning: wall_s is the job after its model loaded.
    assert summary["job"]["wall_s"] == pytest.approx(summary["time"]["total_s"] - 6.5, abs=0.05)
    assert summary["job"]["load_s"] == 4.0 and summary["job"]["total_s"] == summary["time"]["total_s"]


def test_merged_data_parallel_time_line_takes_the_slowest_group():
    from engine.job import shards

    parts = []
    for decode in (3.0, 9.0):
        report, stats = report_with(decode=decode)
        summary = report.to_dict(stats)
        summary["time"] = time_parts(total=30.0 + decode, startup=2.5, load=4.0, prefill=6.25, decode=decode)
        parts.append((summary, report, stats))
    merged, _ = shards.merge_reports(parts, __import__("pathlib").Path("out.jsonl"), shards.Settled(rows=0, failed=0), [])
    times = merged["time"]
    assert times["decode_s"] == 9.0 and "dp1" in times["note"]
    assert sum(times[f"{n}_s"] for n in ("startup", "load", "prefill", "decode", "other")) == \
        pytest.approx(times["total_s"])


# ------------------------------------------------------------------ the plot


def test_the_plot_covers_the_job_and_draws_no_made_up_points(tmp_path):
    clock = FakeClock()
    timeline = Timeline(clock.t - 3.0, clock_s=1.0, now=clock)  # the process started 3 s before loading
    stats = EngineStats()
    timeline.mark("load", None, 0, force=True)
    clock.t += 2.0
    timeline.mark("other", stats, 0, force=True)
    for step in range(6):
        clock.t += 1.0
        stats.decode_s += 0.8
        stats.decode_tokens += 16
        timeline.mark("decode", stats, step)
    clock.t += 1.5
    timeline.mark("end", stats, 6, force=True)
    report, _ = report_with()
    summary = report.to_dict(stats)
    summary["timeline"] = timeline.points
    summary["time"]["total_s"] = clock.t - timeline.origin + 0.1
    series = plot_series(summary)
    assert series["xlim"] == (0.0, pytest.approx(summary["time"]["total_s"]))
    assert series["loaded_at"] == pytest.approx(5.0), "grey up to the end of the model load"
    tps = series["decode_tokens_per_s"]
    assert all(math.isnan(v) for v in tps[:1]), "no tokens/s while loading"
    assert tps[1:7] == [pytest.approx(20.0)] * 6
    assert math.isnan(tps[-2]), "the last interval wrote output and decoded nothing: a gap, not a drop to 0"
    from engine.job.report_render import plot_timeline

    assert plot_timeline(summary, tmp_path / "plot.png") and (tmp_path / "plot.png").stat().st_size > 0
