"""engine.io: streamed input, OpenAI batch rows, crash-safe output and resume. No model needed."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.errors import JobError, RowError
from engine.job.io.input import open_input
from engine.job.io.openai_batch import openai_batch_request
from engine.job.io.output import OutputWriter, id_key

MANIFEST = {"recipe": {"name": "docqa", "draft": {"method": "streamingllm"}}, "model": "m",
            "input": "in.jsonl"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def out_row(i, **extra):
    return {"id": i, "text": f"t{i}", "finish_reason": "stop", "prompt_tokens": 3,
            "output_tokens": 1, "error": None, **extra}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def snapshot(*paths):
    return {p: p.read_bytes() for p in paths}


# --------------------------------------------------------------------------------------------
# Input


def test_jsonl_rows_in_order_blank_lines_not_counted(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n\n   \n{"prompt": "y"}\n{"prompt": "z"}')
    reader = open_input(path)
    assert (reader.format, reader.total) == ("jsonl", 3), "counted as iteration counts: blank lines are no rows"
    rows = list(reader)
    assert [r.index for r in rows] == [0, 1, 2]
    assert [r.data["prompt"] for r in rows] == ["x", "y", "z"]
    assert all(r.error is None for r in rows)
    assert [r.index for r in reader] == [0, 1, 2], "a reader can be iterated again"


def test_jsonl_bad_lines_become_error_rows_and_iteration_goes_on(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"p": 1}\n{"p": 2,,}\n[1, 2]\n\n"text"\n\xff\xfe\n{"p": 3}\n')
    rows = list(open_input(path))
    assert [r.index for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[0].data == {"p": 1} and rows[5].data == {"p": 3}
    assert rows[1].data is None and rows[1].error.startswith("line 2: invalid JSON (")
    assert rows[2].error == "line 3: expected a JSON object, got an array"
    assert rows[3].error == "line 5: expected a JSON object, got a string"
    assert rows[4].error == "line 6: not valid UTF-8"
    assert all("\n" not in r.error for r in rows if r.error)


def test_jsonl_gz_and_parquet_inputs(tmp_path):
    rows = [{"id": i, "prompt": f"p{i}"} for i in range(300)]
    gz = tmp_path / "in.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert [r.data for r in open_input(gz)] == rows
    parquet = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=100)
    reader = open_input(parquet)
    assert (reader.format, reader.total) == ("parquet", 300)
    got = list(reader)
    assert [r.data for r in got] == rows and [r.index for r in got] == list(range(300))


def test_jsonl_is_streamed_not_read_whole(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"id": i, "prompt": "lorem ipsum dolor sit amet " * 2}) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        rows = iter(open_input(path))
        first = [next(rows) for _ in range(1000)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first[-1].index == 999
    assert peak < size / 20, f"peak {peak} bytes for a {size}-byte file: read whole?"
    assert sum(1 for _ in rows) == 199_000


def test_parquet_is_streamed_by_row_group(tmp_path):
    path = tmp_path / "big.parquet"
    n = 200_000
    table = pa.table({"id": range(n), "prompt": ["lorem ipsum dolor sit amet " * 4] * n})
    pq.write_table(table, path, row_group_size=5_000)
    before = pa.total_allocated_bytes()
    rows = iter(open_input(path))
    next(rows)
    assert pa.total_allocated_bytes() - before < table.nbytes / 10


@pytest.mark.parametrize("name", ["in.jsonl", "in.parquet", "in.jsonl.gz"])
def test_missing_input(tmp_path, name):
    with pytest.raises(JobError, match=f"not found: .*{name}"):
        open_input(tmp_path / name)


@pytest.mark.parametrize("name", ["in.csv", "in.json", "in.gz", "in.parquet.gz"])
def test_unknown_input_extension(tmp_path, name):
    (tmp_path / name).write_text("{}\n")
    with pytest.raises(JobError, match=f"{name}: unknown input format"):
        open_input(tmp_path / name)


def test_truncated_parquet_refused_at_open(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["x"] * 100}), path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(JobError, match="in.parquet: not a readable Parquet file") as info:
        open_input(path)
    assert "\n" not in str(info.value)


def test_corrupt_parquet_row_group_raises_mid_iteration(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(200)]}), path, row_group_size=100)
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start:start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))
    seen = []
    message = r"in.parquet: unreadable Parquet data after row \d+"
    with pytest.raises(JobError, match=message) as info:
        seen.extend(row.data["prompt"] for row in open_input(path))
    assert seen == [f"row {i}" for i in range(len(seen))] and 0 < len(seen) <= 100
    assert str(info.value).isprintable()


def test_not_gzip_and_truncated_gzip(tmp_path):
    plain = write_jsonl(tmp_path / "in.jsonl.gz", [{"prompt": "x"}])
    with pytest.raises(JobError, match="in.jsonl.gz: not a readable gzip file"):
        open_input(plain)
    truncated = tmp_path / "cut.jsonl.gz"
    data = gzip.compress("".join(json.dumps({"p": "x" * i}) + "\n" for i in range(3000)).encode())
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(JobError, match="cut.jsonl.gz: unreadable after row"):
        list(open_input(truncated))


def test_directory_input(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(JobError, match="d.jsonl: is a directory"):
        open_input(tmp_path / "d.jsonl")


# --------------------------------------------------------------------------------------------
# OpenAI batch rows


def test_openai_completion_row():
    row = {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
           "body": {"model": "x", "prompt": "Hello", "max_tokens": 5, "temperature": 0.5,
                    "top_p": 0.9, "stop": "\n", "seed": 7}}
    assert openai_batch_request(row) == {
        "id": "r1", "prompt": "Hello", "messages": None,
        "overrides": {"max_new_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": ["\n"],
                      "seed": 7}}


def test_openai_chat_row():
    row = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
           "body": {"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 9, "stop": ["x", "y"]}}
    got = openai_batch_request(row)
    assert got["prompt"] is None
    assert got["messages"] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "a\nb"}]
    assert got["overrides"] == {"max_new_tokens": 9, "stop": ["x", "y"]}


@pytest.mark.parametrize("row", [{"prompt": "x"}, {"custom_id": "a"}, {"body": {"prompt": "x"}},
                                 {"id": 1, "messages": []}])
def test_not_an_openai_row(row):
    assert openai_batch_request(row) is None


@pytest.mark.parametrize("body, url, message", [
    ({}, None, "neither prompt nor messages"),
    ({"prompt": "a", "messages": []}, None, "both prompt and messages"),
    ({"prompt": [1, 2, 3]}, None, "token ids is not supported"),
    ({"prompt": ["a", "b"]}, None, "list of 2 prompts"),
    ({"messages": "hi"}, None, "messages must be a non-empty list"),
    ({"messages": [{"content": "hi"}]}, None, r"messages\[0\] must be an object"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, "'image_url'"),
    ({"prompt": "a"}, "/v1/chat/completions", "needs messages"),
    ({"prompt": "a"}, "/v1/embeddings", "not supported"),
    ({"prompt": "a", "max_tokens": 0}, None, "max_tokens must be >= 1"),
    ({"prompt": "a", "temperature": "hot"}, None, "temperature must be a number"),
    ({"prompt": "a", "n": 3}, None, "n must be 1"),
    ("not a body", None, "body must be an object"),
])
def test_invalid_openai_rows(body, url, message):
    row = {"custom_id": "bad", "body": body, **({"url": url} if url else {})}
    with pytest.raises(RowError, match=message) as info:
        openai_batch_request(row)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------
# Output: JSONL


def test_id_key_keeps_types_apart():
    assert id_key(3) != id_key("3")
    assert id_key(3) == id_key(json.loads(json.dumps(3)))


def test_jsonl_writer_new_then_flushed_rows(tmp_path):
    out = tmp_path / "sub" / "out.jsonl"
    writer = OutputWriter(out, mode="new", manifest=MANIFEST)
    writer.write(out_row(0))
    assert read_jsonl(out) == [out_row(0)], "a row is on disk as soon as it is written"
    writer.write(out_row(1, doc={"k": [1, 2]}))
    writer.close()
    assert read_jsonl(out) == [out_row(0), out_row(1, doc={"k": [1, 2]})]
    assert json.loads((tmp_path / "sub" / "out.jsonl.manifest.json").read_text()) == MANIFEST
    assert writer.rows_written == 2


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_new_refuses_existing_output_and_touches_nothing(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    with OutputWriter(out, mode="new", manifest=MANIFEST, part_rows=1) as writer:
        writer.write(out_row(0))
    before = snapshot(out, tmp_path / f"out.{fmt}.manifest.json")
    with pytest.raises(JobError) as info:
        OutputWriter(out, mode="new", manifest={"recipe": "other", "model": "m"})
    assert str(info.value) == (f"{out} exists; use --resume to continue it "
                               "or --overwrite to replace it")
    assert snapshot(*before) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in before)


def test_new_refuses_leftover_parts_or_manifest(tmp_path):
    out = tmp_path / "out.parquet"
    (tmp_path / "out.parquet.parts").mkdir()
    with pytest.raises(JobError, match="out.parquet.parts exists"):
        OutputWriter(out, mode="new", manifest=MANIFEST)


def test_overwrite_replaces(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out, mode="new", manifest=MANIFEST) as writer:
        writer.write(out_row(0))
    with OutputWriter(out, mode="overwrite", manifest={**MANIFEST, "model": "other"}) as writer:
        assert writer.done_ids == set()
        writer.write(out_row(5))
    assert read_jsonl(out) == [out_row(5)]


def test_resume_skips_done_ids_and_appends(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out, mode="resume", manifest=MANIFEST) as writer:  # nothing there: like new
        writer.write(out_row(0))
        writer.write(out_row("0"))
    writer = OutputWriter(out, mode="resume", manifest={**MANIFEST, "input": "moved.jsonl"})
    assert writer.done_ids == {id_key(0), id_key("0")}
    with pytest.raises(ValueError, match="already"):
        writer.write(out_row(0))
    writer.write(out_row(1))
    writer.close()
    assert [r["id"] for r in read_jsonl(out)] == [0, "0", 1]
    assert writer.rows_written == 1


@pytest.mark.parametrize("first_id", [0, "a"])
def test_parquet_resume_after_a_job_stopped_before_its_first_row(tmp_path, first_id):
    """The stopped job leaves an empty Parquet file (default schema, string ids); the resumed job's
    ids, integers or strings, decide the type."""
    out = tmp_path / "out.parquet"
    OutputWriter(out, mode="new", manifest=MANIFEST).close()
    assert out.exists() and pq.read_table(out).num_rows == 0
    with OutputWriter(out, mode="resume", manifest=MANIFEST) as writer:
        writer.write(out_row(first_id))
    assert pq.read_table(out).column("id").to_pylist() == [first_id]


def test_resume_truncates_half_written_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out, mode="new", manifest=MANIFEST) as writer:
        writer.write(out_row(0))
        writer.write(out_row(1))
    complete = out.read_bytes()
    with open(out, "ab") as f:
        f.write(json.dumps(out_row(2)).encode()[:25])  # a SIGKILL mid-line
    writer = OutputWriter(out, mode="resume", manifest=MANIFEST)
    assert writer.done_ids == {id_key(0), id_key(1)}
    assert out.read_bytes() == complete
    writer.write(out_row(2))
    writer.close()
    assert [r["id"] for r in read_jsonl(out)] == [0, 1, 2]


def test_resume_refuses_garbage_in_the_middle(tmp_path):
    out = tmp_path / "out.jsonl"
    OutputWriter(out, mode="new", manifest=MANIFEST).close()
    out.write_text(json.dumps(out_row(0)) + "\n{oops\n" + json.dumps(out_row(1)) + "\n")
    before = out.read_bytes()
    with pytest.raises(JobError, match="out.jsonl: line 2 is not valid JSON"):
        OutputWriter(out, mode="resume", manifest=MANIFEST)
    assert out.read_bytes() == before


@pytest.mark.parametrize("change, message", [
    ({"recipe": {"name": "docqa", "draft": {"method": "snapkv"}}},
     r'different recipe \(draft.method was "streamingllm", now "snapkv"\); rerun with'),
    ({"model": "other"}, 'different model \\(was "m", now "other"\\)'),
])
def test_resume_refuses_a_different_recipe_or_model(tmp_path, change, message):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out, mode="new", manifest=MANIFEST) as writer:
        writer.write(out_row(0))
    with open(out, "ab") as f:
        f.write(b'{"id": 1, "te')
    before = snapshot(out, tmp_path / "out.jsonl.manifest.json")
    with pytest.raises(JobError, match=message):
        OutputWriter(out, mode="resume", manifest={**MANIFEST, **change})
    assert snapshot(*before) == before


def test_resume_refuses_output_without_manifest(tmp_path):
    out = write_jsonl(tmp_path / "out.jsonl", [out_row(0)])
    with pytest.raises(JobError, match="has no manifest"):
        OutputWriter(out, mode="resume", manifest=MANIFEST)


def test_unknown_output_extension(tmp_path):
    with pytest.raises(JobError, match="out.jsonl.gz: unknown output format"):
        OutputWriter(tmp_path / "out.jsonl.gz", mode="new", manifest=MANIFEST)


# --------------------------------------------------------------------------------------------
# Output: Parquet


def parts(out):
    return sorted(p.name for p in (out.parent / (out.name + ".parts")).glob("*"))


def test_parquet_parts_committed_then_merged(tmp_path):
    out = tmp_path / "out.parquet"
    writer = OutputWriter(out, mode="new", manifest=MANIFEST, part_rows=3)
    for i in range(7):
        writer.write(out_row(i, doc={"k": i} if i % 2 else None))
    assert parts(out) == ["part-000001.parquet", "part-000002.parquet"]
    assert pq.read_table(tmp_path / "out.parquet.parts" / "part-000002.parquet").num_rows == 3
    assert not out.exists()
    writer.close()
    assert not (tmp_path / "out.parquet.parts").exists()
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == list(range(7))
    assert table.schema.field("id").type == pa.int64()
    assert table.column("doc").to_pylist()[:2] == [None, {"k": 1}]
    assert (tmp_path / "out.parquet.manifest.json").exists()


def test_parquet_part_seconds_commits(tmp_path):
    out = tmp_path / "out.parquet"
    writer = OutputWriter(out, mode="new", manifest=MANIFEST, part_rows=1000, part_seconds=0.0)
    writer.write(out_row("a"))
    assert parts(out) == ["part-000001.parquet"]
    writer.close()
    assert pq.read_table(out).column("id").to_pylist() == ["a"]


def test_parquet_resume_after_crash(tmp_path):
    out = tmp_path / "out.parquet"
    writer = OutputWriter(out, mode="new", manifest=MANIFEST, part_rows=4)
    for i in range(10):  # parts of 0-3 and 4-7 committed; 8, 9 buffered and lost in the "crash"
        writer.write(out_row(i))
    (tmp_path / "out.parquet.parts" / "part-000003.parquet.tmp").write_bytes(b"half a part")
    del writer
    writer = OutputWriter(out, mode="resume", manifest=MANIFEST, part_rows=4)
    assert writer.done_ids == {id_key(i) for i in range(8)}
    assert parts(out) == ["part-000001.parquet", "part-000002.parquet"]
    for i in range(8, 12):
        writer.write(out_row(i))
    writer.close()
    assert pq.read_table(out).column("id").to_pylist() == list(range(12))


def test_parquet_resume_of_a_finished_job(tmp_path):
    out = tmp_path / "out.parquet"
    with OutputWriter(out, mode="new", manifest=MANIFEST, part_rows=2) as writer:
        for i in range(5):
            writer.write(out_row(f"r{i}"))
    finished = pq.read_table(out)
    writer = OutputWriter(out, mode="resume", manifest=MANIFEST)
    assert writer.done_ids == {id_key(f"r{i}") for i in range(5)}
    writer.close()
    assert pq.read_table(out).equals(finished)
    with OutputWriter(out, mode="resume", manifest=MANIFEST) as writer:  # e.g. after --limit
        writer.write(out_row("r5"))
    assert pq.read_table(out).column("id").to_pylist() == [f"r{i}" for i in range(6)]


def test_parquet_crash_between_merge_and_cleanup_does_not_duplicate(tmp_path):
    out = tmp_path / "out.parquet"
    writer = OutputWriter(out, mode="new", manifest=MANIFEST, part_rows=2)
    for i in range(4):
        writer.write(out_row(i))
    writer._merge()  # the merged file is in place, the parts folder is not yet removed
    with OutputWriter(out, mode="resume", manifest=MANIFEST) as writer:
        assert len(writer.done_ids) == 4
        writer.write(out_row(4))
    assert pq.read_table(out).column("id").to_pylist() == [0, 1, 2, 3, 4]


def test_parquet_duplicate_and_mixed_ids(tmp_path):
    out = tmp_path / "out.parquet"
    writer = OutputWriter(out, mode="new", manifest=MANIFEST)
    writer.write(out_row(1))
    with pytest.raises(ValueError, match="already"):
        writer.write(out_row(1))
    with pytest.raises(JobError, match="row id 'x' is a string but Parquet output ids must all be"):
        writer.write(out_row("x"))
    writer.close()
    assert pq.read_table(out).column("id").to_pylist() == [1]


def test_parquet_columns_without_a_common_type_become_text(tmp_path):
    out = tmp_path / "out.parquet"
    with OutputWriter(out, mode="new", manifest=MANIFEST, part_rows=2) as writer:
        writer.write(out_row(0, extra=1, meta={}))
        writer.write(out_row(1, extra=2, meta={}))
        writer.write(out_row(2, extra="three", meta={"a": 1}))
        writer.write(out_row(3, extra=[4], meta=None, error="boom"))
    table = pq.read_table(out)
    assert table.column("extra").to_pylist() == ["1", "2", "three", "[4]"]
    assert table.column("meta").to_pylist() == ["{}", "{}", '{"a": 1}', None]
    assert table.column("error").to_pylist() == [None, None, None, "boom"]


def test_parquet_empty_output_is_a_valid_file(tmp_path):
    out = tmp_path / "out.parquet"
    OutputWriter(out, mode="new", manifest=MANIFEST).close()
    table = pq.read_table(out)
    assert table.num_rows == 0 and "finish_reason" in table.column_names


def test_failing_job_keeps_finished_parquet_rows_for_resume(tmp_path):
    out = tmp_path / "out.parquet"
    with pytest.raises(RuntimeError):
        with OutputWriter(out, mode="new", manifest=MANIFEST) as writer:
            writer.write(out_row(0))
            raise RuntimeError("job failed")
    assert not out.exists() and parts(out) == ["part-000001.parquet"]
    assert OutputWriter(out, mode="resume", manifest=MANIFEST).done_ids == {id_key(0)}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_resume_counts_error_records_already_written(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    with OutputWriter(out, mode="new", manifest=MANIFEST) as writer:
        writer.write(out_row(0))
        writer.write({**out_row(1), "text": None, "finish_reason": "error", "error": "too long"})
    writer = OutputWriter(out, mode="resume", manifest=MANIFEST)
    assert (len(writer.done_ids), writer.done_errors) == (2, 1)
    writer.close()


def test_parquet_schema_hint_types_all_null_columns_but_never_the_ids(tmp_path):
    out = tmp_path / "out.parquet"
    hint = pa.schema([("id", pa.string()), ("error", pa.string()), ("score", pa.float64())])
    with OutputWriter(out, mode="new", manifest=MANIFEST, schema_hint=hint) as writer:
        writer.write(out_row(7))
    schema = pq.read_schema(out)
    assert schema.field("id").type == pa.int64()
    assert schema.field("error").type == pa.string()
    assert schema.field("score").type == pa.float64()


CHILD = """
import sys, time
from engine.job.io.output import OutputWriter
writer = OutputWriter(sys.argv[1], mode="new", manifest={"recipe": "r", "model": "m"}, part_rows=10)
for i in range(10**6):
    writer.write({"id": i, "text": "x" * 100, "finish_reason": "stop", "prompt_tokens": 1,
                  "output_tokens": 1, "error": None})
    if writer.format == "jsonl" or i % 10 == 9:
        print(i, flush=True)
"""


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_sigkill_keeps_finished_rows_and_resume_continues(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], stdout=subprocess.PIPE,
                             text=True, cwd=root)
    last = -1
    while last < 200:
        last = int(child.stdout.readline())
    child.send_signal(signal.SIGKILL)
    child.wait()
    writer = OutputWriter(out, mode="resume", manifest={"recipe": "r", "model": "m"})
    done = sorted(json.loads(k) for k in writer.done_ids)
    assert done == list(range(len(done))) and len(done) > last, "every reported row survived"
    writer.write(out_row(len(done)))
    writer.close()
    ids = read_jsonl(out) if fmt == "jsonl" else pq.read_table(out).to_pylist()
    assert [r["id"] for r in ids] == list(range(len(done) + 1))
