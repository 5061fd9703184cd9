"""The output side without a model: input order (external merge), the OpenAI batch line format,
failed writes (disk full) and the output lock. Rows are written the way `run` writes them."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.errors import JobError, OutputError
from engine.job.io import jsonl_lines, ordering, output as output_module, parquet_parts
from engine.job.io.lines import MAGICDEC_LINES, line_format, openai_line
from engine.job.io.lock import OutputLock
from engine.job.io.output import OutputWriter

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = {"recipe": {"name": "generic"}, "model": "m"}


def out_row(i, reason="stop"):
    return {"id": i, "text": f"t{i}", "finish_reason": reason, "prompt_tokens": 3, "output_tokens": 1,
            "error": "bad row" if reason == "error" else None}


def read_ids(path: Path) -> list:
    if path.name.endswith(".parquet"):
        return pq.read_table(path).column("id").to_pylist()
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def staged_rows(path: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in Path(str(path) + ".parts").glob("part-*.jsonl"))


# ------------------------------------------------------------------ input order


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_input_order_rows_are_staged_then_written_in_input_order(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    order = list(range(40))
    random.Random(0).shuffle(order)
    with OutputWriter(out, mode="new", manifest=MANIFEST, order="input", part_rows=7) as writer:
        for i in order[:20]:
            writer.write(out_row(i), i)
        writer.flush()
        assert not out.exists(), "the output appears only once the job completes"
        if fmt == "jsonl":
            assert staged_rows(out) == 20, "every finished row is on disk already, in its part"
        for i in order[20:]:
            writer.write(out_row(i), i)
    assert read_ids(out) == list(range(40))
    assert not Path(str(out) + ".parts").exists() and not Path(str(out) + ".sorting").exists()


def test_jsonl_external_sort_spills_and_merges_in_passes(tmp_path, monkeypatch):
    """Memory stays bounded: with a tiny sort chunk and fan-in the merge goes through spill files and
    several passes, and gives the same order."""
    monkeypatch.setattr(output_module, "SORT_CHUNK_BYTES", 300)
    spilled = []
    real_spiller = jsonl_lines.Spiller.__call__

    def counting(self, items):
        spilled.append(1)
        return real_spiller(self, items)

    monkeypatch.setattr(jsonl_lines.Spiller, "__call__", counting)
    real_merge = ordering.merge_runs
    monkeypatch.setattr(output_module, "merge_runs", lambda runs, spill: real_merge(runs, spill, fan_in=3))
    out = tmp_path / "out.jsonl"
    order = list(range(200))
    random.Random(1).shuffle(order)
    with OutputWriter(out, mode="new", manifest=MANIFEST, order="input") as writer:
        for i in order:
            writer.write(out_row(i), i)
    assert read_ids(out) == list(range(200))
    assert len(spilled) > 20, "the rows were sorted in many chunks, merged in more than one pass"


def test_putting_rows_in_input_order_holds_one_chunk_not_the_output(tmp_path, monkeypatch):
    """8 MB of rows, sorted with a 256 KiB chunk: the merge's memory peak is a small part of it."""
    import tracemalloc

    monkeypatch.setattr(output_module, "SORT_CHUNK_BYTES", 256 << 10)
    out = tmp_path / "out.jsonl"
    order = list(range(4000))
    random.Random(4).shuffle(order)
    writer = OutputWriter(out, mode="new", manifest=MANIFEST, order="input")
    for i in order:
        writer.write({**out_row(i), "text": f"{i:06d}" * 340}, i)  # ~2 KB a row
    tracemalloc.start()
    try:
        writer.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read_ids(out) == list(range(4000))
    assert out.stat().st_size > 8_000_000
    assert peak < 3_000_000, f"the merge held {peak} bytes"


def test_merge_runs_is_a_stable_sort():
    items = [(random.Random(2).randrange(50), n) for n in range(500)]
    chunks = [sorted(items[i:i + 37], key=lambda item: item[0]) for i in range(0, 500, 37)]
    runs = [(lambda c=c: iter(c)) for c in chunks]
    store = []

    def spill(stream):
        kept = list(stream)
        store.append(kept)
        return lambda: iter(kept)

    merged = list(ordering.merge_runs(runs, spill, fan_in=4))
    assert merged == sorted(items, key=lambda item: item[0]) and store, "equal keys keep their order"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_input_order_survives_a_kill_and_resume(tmp_path, fmt):
    """A writer that dies (never closed) keeps its rows in parts; --resume adds the rest; the output is
    in input order with each id once, and a resume of the finished output adds nothing."""
    out = tmp_path / f"out.{fmt}"
    killed = OutputWriter(out, mode="new", manifest=MANIFEST, order="input", part_rows=2)
    for i in (5, 1, 7, 3):
        killed.write(out_row(i), i)
    killed.flush()
    killed._close_file()  # the process is gone: nothing else happens
    if fmt == "jsonl":
        part = next(Path(str(out) + ".parts").glob("part-*.jsonl"))
        with open(part, "ab") as f:
            f.write(b'[6, {"id": 6, "text": "half')  # the line a SIGKILL cut short
    resumed = OutputWriter(out, mode="resume", manifest=MANIFEST, order="input")
    assert sorted(json.loads(k) for k in resumed.done_ids) == [1, 3, 5, 7]
    for i in (0, 6, 2, 4, 8):
        resumed.write(out_row(i), i)
    resumed.close()
    assert read_ids(out) == list(range(9))
    again = OutputWriter(out, mode="resume", manifest=MANIFEST, order="input")
    assert len(again.done_ids) == 9
    again.close()
    assert read_ids(out) == list(range(9))


def test_a_crash_between_rename_and_cleanup_duplicates_nothing(tmp_path):
    out = tmp_path / "out.jsonl"
    writer = OutputWriter(out, mode="new", manifest=MANIFEST, order="input")
    for i in (2, 0, 1):
        writer.write(out_row(i), i)
    writer._close_file()
    writer._merge()  # renamed into place, but the parts were never removed
    assert read_ids(out) == [0, 1, 2] and Path(str(out) + ".parts").exists()
    resumed = OutputWriter(out, mode="resume", manifest=MANIFEST, order="input")
    resumed.write(out_row(3), 3)
    resumed.close()
    assert read_ids(out) == [0, 1, 2, 3]


def test_parquet_merge_in_input_order_goes_through_spill_runs(tmp_path, monkeypatch):
    real_merge = ordering.merge_runs
    monkeypatch.setattr(parquet_parts, "merge_runs", lambda runs, spill: real_merge(runs, spill, fan_in=2))
    out = tmp_path / "out.parquet"
    order = list(range(30))
    random.Random(3).shuffle(order)
    with OutputWriter(out, mode="new", manifest=MANIFEST, order="input", part_rows=3) as writer:
        for i in order:
            writer.write(out_row(i), i)
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == list(range(30))
    assert parquet_parts.INDEX_COLUMN not in table.column_names


def test_an_old_output_resumes_only_in_the_order_it_was_written(tmp_path):
    """A manifest from before output.order existed: its rows were written in finishing order."""
    out = tmp_path / "out.jsonl"
    old = {"recipe": {"output": {"keep_columns": []}}, "model": "m"}
    with OutputWriter(out, mode="new", manifest=old) as writer:
        writer.write(out_row(0))
    legacy = {"recipe": {"output": {"format": "magicdec", "order": "finish"}}}
    new = {"recipe": {"output": {"keep_columns": [], "format": "magicdec", "order": "input"}}, "model": "m"}
    with pytest.raises(JobError, match='output.order was "finish", now "input"'):
        OutputWriter(out, mode="resume", manifest=new, order="input", legacy_manifest=legacy)
    same = {"recipe": {"output": {"keep_columns": [], "format": "magicdec", "order": "finish"}}, "model": "m"}
    OutputWriter(out, mode="resume", manifest=same, legacy_manifest=legacy).close()


# ------------------------------------------------------------------ the OpenAI batch output format


def check_openai_line(line: dict, *, custom_id, chat: bool | None, model: str = "m") -> None:
    """The fields of a line of an OpenAI batch output file (OpenAI Batch API / vLLM run-batch)."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and line["custom_id"] == custom_id
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and response["request_id"].startswith("req_")
    if chat is None:  # a failed row
        assert response["status_code"] == 400 and response["body"] is None
        assert set(line["error"]) == {"code", "message"} and line["error"]["message"]
        return
    assert response["status_code"] == 200 and line["error"] is None
    body = response["body"]
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["id"].startswith("chatcmpl-" if chat else "cmpl-")
    assert body["model"] == model and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str)
    if chat:
        assert choice["message"]["role"] == "assistant" and "text" not in choice
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_openai_lines_for_chat_completion_and_error_rows():
    row = {**out_row("a"), "text": "Hello.", "finish_reason": "length", "prompt_tokens": 7, "output_tokens": 2}
    chat = openai_line(row, "/v1/chat/completions", "m")
    check_openai_line(chat, custom_id="a", chat=True)
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == "Hello."
    assert chat["response"]["body"]["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    completion = openai_line(row, "/v1/completions", "m")
    check_openai_line(completion, custom_id="a", chat=False)
    assert completion["response"]["body"]["choices"][0]["text"] == "Hello."
    failed = openai_line(out_row("b", "error"), "/v1/completions", "m")
    check_openai_line(failed, custom_id="b", chat=None)
    assert failed["error"] == {"code": "invalid_request", "message": "bad row"}
    assert openai_line(row, None, "m")["id"] != chat["id"], "ids are unique"


def test_openai_output_resumes_by_custom_id_and_counts_errors(tmp_path):
    out = tmp_path / "out.jsonl"
    lines = line_format("openai", "m")
    with OutputWriter(out, mode="new", manifest=MANIFEST, lines=lines, order="input") as writer:
        writer.write(lines.encode(out_row("b"), "/v1/completions"), 1)
        writer.write(lines.encode(out_row("a", "error"), "/v1/completions"), 0)
    resumed = OutputWriter(out, mode="resume", manifest=MANIFEST, lines=lines, order="input")
    assert resumed.done_ids == {'"a"', '"b"'} and resumed.done_errors == 1
    with pytest.raises(ValueError, match="already in"):
        resumed.write(lines.encode(out_row("a"), "/v1/completions"), 0)
    resumed.close()
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", "b"]
    assert MAGICDEC_LINES.encode(out_row(1)) == out_row(1)


def test_openai_format_with_a_parquet_output_is_refused(tmp_path):
    from engine.config.loading import load_recipe
    from engine.job.options import row_format

    recipe = load_recipe("generic", ["output.format=openai"])
    with pytest.raises(JobError, match="output.format openai .* JSONL"):
        row_format(recipe, tmp_path / "out.parquet")
    assert row_format(load_recipe("generic"), tmp_path / "out.parquet") == "magicdec"


# ------------------------------------------------------------------ a write that fails


def enospc_after(monkeypatch, rows: int):
    """The output's line writes: a disk that fills up after `rows` lines, mid-line."""
    real_append, written = jsonl_lines.append_all, [0]

    def append_all(fd, data):
        if written[0] >= rows:
            real_append(fd, data[: len(data) // 2])  # part of the line made it to disk
            raise OSError(errno.ENOSPC, "No space left on device")
        written[0] += 1
        real_append(fd, data)

    monkeypatch.setattr(jsonl_lines, "append_all", append_all)


@pytest.mark.parametrize("order", ["finish", "input"])
def test_disk_full_keeps_written_rows_and_resume_finishes(tmp_path, monkeypatch, order):
    out = tmp_path / "out.jsonl"
    enospc_after(monkeypatch, 3)
    with pytest.raises(OutputError, match=r"No space left on device.*3 rows written before it are kept.*--resume"):
        with OutputWriter(out, mode="new", manifest=MANIFEST, order=order) as writer:
            for i in range(6):
                writer.write(out_row(i), i)
    monkeypatch.undo()  # space is back
    resumed = OutputWriter(out, mode="resume", manifest=MANIFEST, order=order)
    assert sorted(json.loads(k) for k in resumed.done_ids) == [0, 1, 2], "no row lost, none half-kept"
    for i in range(3, 6):
        resumed.write(out_row(i), i)
    resumed.close()
    assert sorted(read_ids(out)) == list(range(6)) and len(read_ids(out)) == 6


def test_disk_full_while_committing_a_parquet_part_or_merging(tmp_path, monkeypatch):
    out = tmp_path / "out.parquet"
    real_write_table = pq.write_table
    calls = []

    def full_on_second(table, where, *args, **kwargs):
        calls.append(where)
        if len(calls) == 2:
            Path(where).write_bytes(b"PAR1 partial")  # what a full disk leaves of the part
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_table(table, where, *args, **kwargs)

    monkeypatch.setattr(parquet_parts.pq, "write_table", full_on_second)
    with pytest.raises(OutputError, match="No space left"):
        with OutputWriter(out, mode="new", manifest=MANIFEST, part_rows=2) as writer:
            for i in range(6):
                writer.write(out_row(i), i)
    assert not list(Path(str(out) + ".parts").glob("*.tmp")), "no partial part left behind"
    monkeypatch.undo()
    resumed = OutputWriter(out, mode="resume", manifest=MANIFEST)
    assert sorted(json.loads(k) for k in resumed.done_ids) == [0, 1]
    for i in range(2, 6):
        resumed.write(out_row(i), i)
    real_merge = parquet_parts.merge
    monkeypatch.setattr(output_module.parquet_parts, "merge", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.EIO, "Input/output error")))
    with pytest.raises(OutputError, match="Input/output error"):
        resumed.close()
    assert not out.exists() and len(list(Path(str(out) + ".parts").glob("part-*"))) == 2, "parts kept"
    monkeypatch.setattr(output_module.parquet_parts, "merge", real_merge)
    OutputWriter(out, mode="resume", manifest=MANIFEST).close()
    assert sorted(read_ids(out)) == list(range(6))


# ------------------------------------------------------------------ one job per output


HOLDER = """
import sys, time
from pathlib import Path
from engine.job.io.lock import OutputLock
lock = OutputLock.acquire(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_lock_names_the_holder_and_a_killed_holders_lock_is_stale(tmp_path):
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(JobError, match=rf"out.jsonl is in use by another magicdec run \(pid {holder.pid} on "):
            OutputLock.acquire(out)
    finally:
        holder.kill()  # SIGKILL: no clean-up runs
        holder.wait()
    assert Path(str(out) + ".lock").exists(), "the killed process left its lock file"
    with OutputLock.acquire(out) as lock:  # stale: taken at once
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not Path(str(out) + ".lock").exists(), "released locks leave no file"


def test_lock_is_released_on_an_exception_and_taken_again(tmp_path):
    out = tmp_path / "sub" / "out.jsonl"
    with pytest.raises(RuntimeError):
        with OutputLock.acquire(out):
            with pytest.raises(JobError, match="in use"):
                OutputLock.acquire(out)
            raise RuntimeError("the job failed")
    OutputLock.acquire(out).release()


def test_the_lock_check_imports_no_torch(tmp_path):
    """What a second run does before refusing: no torch, no model code (so it exits at once)."""
    code = ("import sys; from pathlib import Path; from engine.job.options import claim_output, prepare, JobOptions; "
            "o = JobOptions(recipe='generic', input=sys.argv[1]); claim_output(prepare(o)[2]).release(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "x"}\n')
    done = subprocess.run([sys.executable, "-c", code, str(data)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
