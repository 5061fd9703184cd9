"""What a user sees while a job runs: input rows counted for a total, progress lines with percent and
ETA under cron, and the engine's one-time steps as named lines on stderr (kept off stdout)."""

from __future__ import annotations

import gzip
import io
import json
import logging
import random

import pytest
from rich.console import Console

from engine.core.stats import EngineStats
from engine.job.io import input as input_module
from engine.job.io.input import count_jsonl_rows, open_input
from engine.job.report import JobReport
from engine.steps import step
from magicdec_cli.console import JobProgress, Out, duration


def write_rows(path, count, *, blank_every=0):
    rng = random.Random(0)
    lines = []
    for i in range(count):  # text that compresses about as little as real prompts do
        lines.append(json.dumps({"id": i, "prompt": f"row {i} " + " ".join(
            rng.choice(WORDS) for _ in range(rng.randint(3, 15)))}) + "\n")
        if blank_every and i % blank_every == 0:
            lines.append("  \n")
    data = "".join(lines).encode()
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


# ------------------------------------------------------------------ a total for JSONL inputs

WORDS = ["".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(1 + i % 9))
         for i in range(5000)]


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz"])
def test_jsonl_rows_are_counted_as_iteration_counts_them(tmp_path, name):
    path = write_rows(tmp_path / name, 5000, blank_every=7)
    reader = open_input(path)
    assert reader.total == len(list(reader)) == 5000
    assert reader.total_estimate == 5000


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz"])
def test_a_count_out_of_time_gives_an_estimate_not_a_total(tmp_path, name, monkeypatch):
    path = write_rows(tmp_path / name, 200_000)
    total, estimate = count_jsonl_rows(path, budget_s=0.0)  # stops at its first check, after 1 MiB
    assert total is None
    assert estimate is not None and 0.7 * 200_000 < estimate < 1.4 * 200_000, estimate
    monkeypatch.setattr(input_module, "COUNT_BUDGET_S", 0.0)
    reader = open_input(path)
    assert reader.total is None and reader.total_estimate == estimate


def test_a_truncated_gzip_is_not_given_a_total(tmp_path):
    path = write_rows(tmp_path / "in.jsonl.gz", 5000)
    path.write_bytes(path.read_bytes()[:-200])
    total, _ = count_jsonl_rows(path)
    assert total is None


# ------------------------------------------------------------------ progress lines under cron


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def plain_progress():
    out = Out()
    out.err = Console(file=io.StringIO(), width=40)  # not a terminal: plain lines, never wrapped
    clock = Clock()
    return JobProgress(out, clock=clock), out.err.file, clock


def test_plain_progress_lines_show_percent_and_eta():
    progress, text, clock = plain_progress()
    progress.start(100, 0)
    report = JobReport(recipe="r", model="m", input="i", output="o", method="none", budget=0, device="cpu")
    stats = EngineStats(decode_tokens=300, decode_s=10.0)
    clock.t = 10.0
    report.rows_ok = 5
    progress.update(report, stats)  # before LOG_EVERY_S: nothing yet
    clock.t = 60.0
    report.rows_ok = 25
    progress.update(report, stats)
    lines = text.getvalue().splitlines()
    assert lines[0] == "started: 100 rows"
    assert lines[1] == "progress: 25/100 rows (25%), 30.0 decode tok/s, elapsed 1m00s, ETA 3m00s"
    assert len(lines) == 2


def test_plain_progress_with_an_estimated_total_and_resumed_rows():
    progress, text, clock = plain_progress()
    progress.start(1000, 400, estimated=True)
    report = JobReport(recipe="r", model="m", input="i", output="o", method="none", budget=0, device="cpu",
                       rows_resumed=400)
    clock.t = 40.0
    report.rows_ok = 100  # 100 rows in 40 s this run; 500 to go
    progress.update(report, EngineStats())
    lines = text.getvalue().splitlines()
    assert lines[0] == "started: ~1000 (estimated) rows, 400 already done"
    assert lines[1].startswith("progress: 500/~1000 rows (50%)") and lines[1].endswith("ETA 3m20s")


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (4.4, 59.6, 61, 3599, 7440)] == ["4s", "1m00s", "1m01s", "59m59s", "2h04m"]


# ------------------------------------------------------------------ one-time steps


def test_engine_steps_become_named_stderr_lines_and_quiet_drops_them(capsys):
    for quiet, json_mode in [(False, False), (False, True), (True, False)]:
        out = Out(quiet=quiet, json_mode=json_mode).attach_engine_log()
        out.err = Console(file=io.StringIO(), width=200)
        with step("compiling the thing once", "compiled the thing"):
            pass
        logging.getLogger("engine.core.kernels").warning("fell back to %s", "torch")
        lines = out.err.file.getvalue().splitlines()
        if quiet:
            assert lines == []
        else:
            assert lines[0] == "magicdec: compiling the thing once"
            assert lines[1].startswith("magicdec: compiled the thing in ") and lines[1].endswith(" s")
            assert lines[2] == "magicdec: warning: fell back to torch"
    assert capsys.readouterr().out == "", "nothing on stdout"
    # pytest's own capture handlers also sit on non-propagating loggers: count only ours.
    consoles = [h for h in logging.getLogger("engine").handlers if type(h).__name__ == "_ConsoleHandler"]
    assert len(consoles) == 1, "one console at a time"


@pytest.mark.real_model
def test_progress_hears_from_the_job_between_rows_not_only_when_one_finishes(tmp_path, monkeypatch):
    """A long prefill or a batch that finishes all at once still moves the bar and the cron lines:
    each timeline point taken while rows run is also a progress update (here a point at every call,
    so the count is exact whatever this machine's speed)."""
    from engine.job import timeline
    from engine.job.run import JobOptions, run_job

    monkeypatch.setattr(timeline, "CLOCK_S", 0.0)
    monkeypatch.setattr(timeline, "MIN_GAP_S", 0.0)

    class Recorder:
        def __init__(self):
            self.calls = []

        def start(self, total, done, *, estimated=False):
            self.calls.append(("start", total, done, estimated))

        def update(self, report, stats):
            self.calls.append(("update", report.rows_done))

        def finish(self):
            self.calls.append(("finish",))

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": f"Count from {i} to {i + 20}:"}) + "\n" for i in range(2)))
    recorder = Recorder()
    overrides = ("batch.size=2", "batch.max_len=256", "sampling.max_new_tokens=8", "draft.budget=32",
                 "draft.window=8")
    run_job(JobOptions(recipe="generic", input=str(data), output=str(tmp_path / "out.jsonl"), overrides=overrides),
            recorder)
    assert recorder.calls[0] == ("start", 2, 0, False), "a counted JSONL input: an exact total"
    assert recorder.calls[-1] == ("finish",)
    updates = [c for c in recorder.calls if c[0] == "update"]
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    while_running = len(report["timeline"]) - 3  # all but the load start, the load end and the end
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    packs = -(-sum(r["prompt_tokens"] for r in rows) // 512)  # both prompts share packed 512-token forwards
    assert while_running >= packs + report["speculative"]["rounds"], "a point before every chunk and round"
    assert len(updates) == while_running + 2, "one per point taken while rows ran, and one per finished row"
    assert [c[1] for c in updates] == sorted(c[1] for c in updates) and updates[0][1] == 0
