"""Crash safety with a real process: SIGKILL mid-job, then --resume finishes without losing or repeating rows."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

ARGS = ["--set", "batch.size=2", "--set", "batch.max_len=256", "--set", "sampling.max_new_tokens=16",
        "--set", "draft.method=streamingllm", "--set", "draft.budget=32", "--set", "draft.window=8", "--quiet"]


def magicdec(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "magicdec_cli.main", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def write_prompts(tmp_path, count: int = 12):
    """An input file of `count` short prompts with integer ids 0..count-1."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": f"Write one sentence about the number {i}."}) + "\n"
                            for i in range(count)))
    return data


@pytest.mark.slow
@pytest.mark.real_model
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    count = 12
    data = write_prompts(tmp_path, count)
    killed = tmp_path / "killed.jsonl"
    job = magicdec("run", "generic", "--input", data, "--output", killed, *ARGS)
    deadline = time.time() + 240
    while time.time() < deadline and job.poll() is None:
        if killed.exists() and len(read_rows(killed)) >= 3:
            break
        time.sleep(0.05)
    assert job.poll() is None, f"the job ended before it could be killed: {job.communicate()}"
    job.send_signal(signal.SIGKILL)
    job.wait()
    before = read_rows(killed)
    assert 3 <= len(before) < count

    resumed = magicdec("run", "generic", "--input", data, "--output", killed, *ARGS, "--resume")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    after = read_rows(killed)
    ids = [r["id"] for r in after]
    assert sorted(ids) == list(range(count)), "every id exactly once"
    assert after[: len(before)] == before, "rows written before the kill are kept as they were"

    clean = tmp_path / "clean.jsonl"
    full = magicdec("run", "generic", "--input", data, "--output", clean, *ARGS)
    full.communicate(timeout=300)
    assert full.returncode == 0
    as_map = lambda rows: {r["id"]: (r["text"], r["finish_reason"], r["output_tokens"]) for r in rows}
    assert as_map(after) == as_map(read_rows(clean))
    report = json.loads((tmp_path / "killed.jsonl.report.json").read_text())
    assert report["job"]["rows"] == count and report["job"]["rows_resumed"] == len(before)


@pytest.mark.real_model
def test_half_written_last_line_is_tolerated(tmp_path):
    data = write_prompts(tmp_path, 4)
    out = tmp_path / "out.jsonl"
    first = magicdec("run", "generic", "--input", data, "--output", out, *ARGS, "--limit", "2")
    first.communicate(timeout=300)
    assert first.returncode == 0
    with open(out, "a") as handle:  # what a kill in the middle of a write leaves behind
        handle.write('{"id": 2, "text": "half')
    resumed = magicdec("run", "generic", "--input", data, "--output", out, *ARGS, "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert sorted(r["id"] for r in read_rows(out)) == [0, 1, 2, 3]
    assert all(line.endswith("}") for line in out.read_text().splitlines())


@pytest.mark.slow
@pytest.mark.real_model
def test_sigterm_stops_like_ctrl_c_and_resume_finishes(tmp_path):
    """A scheduler's SIGTERM unwinds the job (the Parquet writer commits the rows it buffers) instead
    of killing it outright; --resume then completes every id exactly once."""
    import pyarrow.parquet as pq

    count = 12
    data = write_prompts(tmp_path, count)
    out = tmp_path / "out.parquet"
    job = magicdec("run", "generic", "--input", data, "--output", out, *ARGS)
    deadline = time.time() + 240
    while time.time() < deadline and job.poll() is None and not out.with_name(out.name + ".manifest.json").exists():
        time.sleep(0.05)
    time.sleep(1.0)
    assert job.poll() is None, f"the job ended before it could be stopped: {job.communicate()}"
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 130 and "--resume" in err, (job.returncode, err)

    resumed = magicdec("run", "generic", "--input", data, "--output", out, *ARGS, "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert sorted(pq.read_table(out).column("id").to_pylist()) == list(range(count))
