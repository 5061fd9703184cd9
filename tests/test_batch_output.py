"""The output side end to end, through the CLI with the real default model and short prompts: the OpenAI
batch output format, two runs on one output, and a disk that fills up mid-job (the last two through
subprocesses, so marked slow; tests/test_output.py holds the same properties without a model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from magicdec_cli.main import app
from test_output import check_openai_line

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "tests" / "faults"
FAST = ["--set", "batch.size=3", "--set", "batch.max_len=256", "--set", "sampling.max_new_tokens=8",
        "--set", "draft.budget=32", "--set", "draft.window=8", "--quiet"]
PROMPTS = ["The capital of France is", "Write a haiku about rivers.", "def add(a, b):", "Once upon a time,",
           "List three prime numbers:", "The opposite of hot is"]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def magicdec(*args, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "magicdec_cli.main", *map(str, args)], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.real_model
def test_an_openai_batch_file_gives_the_openai_batch_output_format(tmp_path):
    chat = {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6}}
    completion = {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "x", "prompt": "The capital of France is"}}
    no_url = {"custom_id": "chat-2", "body": {"messages": [{"role": "user", "content": "Name a colour."}]}}
    data = write_lines(tmp_path / "batch.jsonl", [
        chat, completion,
        '{"custom_id": "broken-1", "method": "POST", "body": {"prompt": "unterminated',  # unparseable, id readable
        '{"method": "POST", "body": {,,}}',  # unparseable, no custom_id to read
        {"custom_id": "bad-url", "url": "/v1/embeddings", "body": {"input": "x"}},
        no_url])
    out = tmp_path / "out.jsonl"
    result = invoke("run", "generic", "--input", data, "--output", out, *FAST)
    assert result.exit_code == 1, result.output  # the job went on past the bad lines, which are error lines
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == ["chat-1", "cmpl-1", "broken-1", "3", "bad-url", "chat-2"], \
        "input order; a line whose custom_id cannot be read gets its row number"
    kinds = {"chat-1": True, "cmpl-1": False, "chat-2": True}
    for line in lines:
        check_openai_line(line, custom_id=line["custom_id"], chat=kinds.get(line["custom_id"]),
                          model="smollm2-135m-instruct")
    assert "line 3: invalid JSON" in lines[2]["error"]["message"]
    assert "url '/v1/embeddings' is not supported" in lines[4]["error"]["message"]
    body = lines[0]["response"]["body"]
    assert body["usage"]["completion_tokens"] <= 6 and body["choices"][0]["message"]["content"]
    report = json.loads(Path(str(out) + ".report.json").read_text())
    assert (report["job"]["rows_ok"], report["job"]["rows_failed"]) == (3, 3)

    before = out.read_text()
    again = invoke("run", "generic", "--input", data, "--output", out, *FAST, "--resume")
    assert again.exit_code == 1 and out.read_text() == before, "resume by custom_id: nothing redone"
    refused = invoke("run", "generic", "--input", data, "--output", out, *FAST, "--resume", "--output-format",
                     "magicdec")
    assert refused.exit_code == 2 and "output.format" in refused.output, "one output, one format"

    own = tmp_path / "own.jsonl"
    assert invoke("run", "generic", "--input", data, "--output", own, *FAST, "--output-format",
                  "magicdec").exit_code == 1
    rows = {r["id"]: r for r in read_jsonl(own)}
    assert rows["cmpl-1"]["text"] == lines[1]["response"]["body"]["choices"][0]["text"]
    assert rows["chat-1"]["text"] == lines[0]["response"]["body"]["choices"][0]["message"]["content"]


@pytest.mark.real_model
def test_plain_rows_as_openai_output_and_openai_with_parquet_is_refused(tmp_path):
    data = write_lines(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": p} for i, p in enumerate(PROMPTS[:2])])
    out = tmp_path / "out.jsonl"
    assert invoke("run", "generic", "--input", data, "--output", out, *FAST, "--output-format", "openai").exit_code == 0
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == ["r0", "r1"]
    for line in lines:
        check_openai_line(line, custom_id=line["custom_id"], chat=False, model="smollm2-135m-instruct")
    parquet = invoke("run", "generic", "--input", data, "--output", tmp_path / "o.parquet", *FAST,
                     "--output-format", "openai")
    assert parquet.exit_code == 2 and "JSONL" in parquet.output and "Traceback" not in parquet.output
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.slow
@pytest.mark.real_model
def test_two_runs_on_one_output_exactly_one_runs(tmp_path):
    """An hourly cron job overlapping the previous one: both start at once with --resume; one runs,
    the other exits 2 with one line naming it, before the first is done; the output is one run's."""
    data = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out.jsonl"
    args = ["run", "generic", "--input", data, "--output", out, *FAST, "--resume"]
    jobs = [magicdec(*args), magicdec(*args)]
    while all(job.poll() is None for job in jobs):
        time.sleep(0.02)
    first = next(job for job in jobs if job.poll() is not None)
    other = next(job for job in jobs if job is not first)
    assert other.poll() is None, "the refused run ends while the other still runs"
    _, err = first.communicate()
    assert first.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"in use by another magicdec run (pid {other.pid} on " in lines[0], err
    _, err = other.communicate(timeout=300)
    assert other.returncode == 0, err
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == list(range(len(PROMPTS)))
    single = tmp_path / "single.jsonl"
    assert invoke(*args[:4], "--output", single, *FAST).exit_code == 0
    assert rows == read_jsonl(single)
    assert not Path(str(out) + ".lock").exists()


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("order", ["input", "finish"])
def test_disk_full_mid_job_then_resume_loses_and_repeats_nothing(tmp_path, order):
    data = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out.jsonl"
    args = ["run", "generic", "--input", data, "--output", out, *FAST, "--set", f"output.order={order}"]
    full = magicdec(*args, env={"MAGICDEC_TEST_ENOSPC_AFTER_ROWS": "2", "PYTHONPATH": str(FAULTS)})
    _, err = full.communicate(timeout=300)
    assert full.returncode == 3, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "--resume" in lines[0], err
    assert "2 rows written before it are kept" in lines[0]

    resumed = magicdec(*args, "--resume")  # space is back
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    ids = [r["id"] for r in read_jsonl(out)]
    assert sorted(ids) == list(range(len(PROMPTS))), "no row lost or duplicated"
    if order == "input":
        assert ids == list(range(len(PROMPTS)))
    report = json.loads(Path(str(out) + ".report.json").read_text())
    assert report["job"]["rows_resumed"] == 2 and report["job"]["rows"] == len(PROMPTS)
