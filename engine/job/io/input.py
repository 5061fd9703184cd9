"""Reading job input: `.parquet`, `.jsonl` or `.jsonl.gz`, checked up front, streamed row by row.

`open_input` checks the file (exists, readable, the format its name says) without reading it all;
iterating the `InputReader` streams `InputRow`s in file order, a bad JSONL line becoming an error row
instead of stopping the job. `InputReader.total` is the row count: Parquet's metadata, or for JSONL
a streaming count of its rows, done once and only for `COUNT_BUDGET_S` seconds (past that, an
estimate from the bytes read, so a progress bar still has a total). Rows are plain dicts: nothing
here knows recipes, prompts or models.
"""

from __future__ import annotations

import gzip
import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import JobError
from engine.job.io.common import extension, kind, one_line

INPUT_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".jsonl.gz": "jsonl"}
PARQUET_BATCH_ROWS = 64  # input rows decoded at a time; long-context rows are large
_GZIP_MAGIC = b"\x1f\x8b"
COUNT_BUDGET_S = 2.0  # seconds a JSONL row count may take; past it the count is an estimate
COUNT_CHECK_BYTES = 1 << 20  # the clock is looked at after every MiB of lines read
_counts: dict[tuple, tuple[int | None, int | None]] = {}  # (path, size, mtime) -> (total, estimate)


@dataclass
class InputRow:
    index: int  # 0-based row number in the input file (JSONL: blank lines are not rows)
    data: dict | None  # the row's columns; None when the row itself is unreadable
    error: str | None = None  # one line saying why the row is unreadable
    raw: bytes | None = None  # an unreadable JSONL row: its line as read (to salvage its id from)


class InputReader:
    """A checked input file. Iterate it (again and again if needed) for its rows, streamed in order.

    JSONL: blank lines are skipped and get no index, so `index` counts rows while messages cite
    the 1-based line number. A line that is not UTF-8 JSON for an object becomes an error row.
    Parquet: `PARQUET_BATCH_ROWS` rows decoded at a time (Arrow still reads a row group at once).
    Data that turns out unreadable mid-file (corrupt row group, truncated gzip) raises `JobError`.
    """

    def __init__(self, path: Path, format: str, total: int | None):
        self.path = path
        self.format = format  # "parquet" | "jsonl"
        self._counted = (total, total) if total is not None else None  # (exact total, estimate)

    @property
    def total(self) -> int | None:
        """The number of rows: Parquet's metadata; JSONL's rows counted (once, within COUNT_BUDGET_S
        seconds); None when the count did not finish in time."""
        return self._count()[0]

    @property
    def total_estimate(self) -> int | None:
        """`total` when known, else the rows counted scaled by the share of the file read (None if none)."""
        return self._count()[1]

    def _count(self) -> tuple[int | None, int | None]:
        if self._counted is None:
            self._counted = count_jsonl_rows(self.path)
        return self._counted

    def __iter__(self) -> Iterator[InputRow]:
        return self._parquet_rows() if self.format == "parquet" else self._jsonl_rows()

    def _parquet_rows(self) -> Iterator[InputRow]:
        index = 0
        try:
            with pq.ParquetFile(self.path) as pf:
                for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                    for data in batch.to_pylist():
                        yield InputRow(index, data)
                        index += 1
        except (pa.ArrowException, OSError) as exc:
            raise JobError(f"{self.path}: unreadable Parquet data after row {index}: "
                           f"{one_line(exc)}") from None

    def _jsonl_rows(self) -> Iterator[InputRow]:
        opener = gzip.open if self.path.name.lower().endswith(".gz") else open
        index = 0
        try:
            with opener(self.path, "rb") as f:
                for line_no, raw in enumerate(f, 1):
                    if line_no == 1:
                        raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
                    if raw.strip():
                        data, error = _parse_line(raw, line_no)
                        yield InputRow(index, data, error, raw if data is None else None)
                        index += 1
        except (OSError, EOFError, zlib.error) as exc:
            raise JobError(f"{self.path}: unreadable after row {index}: {one_line(exc)}") from None


def count_jsonl_rows(path: Path, budget_s: float | None = None) -> tuple[int | None, int | None]:
    """(rows, estimate) of a .jsonl / .jsonl.gz file, counted as iteration counts them (blank lines are
    not rows). Stops after `budget_s` seconds (default COUNT_BUDGET_S): then rows is None and the
    estimate scales the rows counted by the file's size over the (compressed) bytes read so far.
    An unreadable stretch ends the count the same way; iterating reports it."""
    budget_s = COUNT_BUDGET_S if budget_s is None else budget_s
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, budget_s)
    if key in _counts:
        return _counts[key]
    deadline = time.monotonic() + budget_s
    rows, finished, unchecked = 0, False, 0
    with open(path, "rb") as raw:
        lines = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.lower().endswith(".gz") else raw
        try:
            for line_no, line in enumerate(lines, 1):
                if line_no == 1:
                    line = line.removeprefix(b"\xef\xbb\xbf")
                if line.strip():
                    rows += 1
                unchecked += len(line)
                if unchecked >= COUNT_CHECK_BYTES:
                    unchecked = 0
                    if time.monotonic() > deadline:
                        break
            else:
                finished = True
        except (OSError, EOFError, zlib.error):
            pass
        read = raw.tell()
    if finished:
        result = (rows, rows)
    else:
        result = (None, round(rows * stat.st_size / read) if rows and read else None)
    _counts[key] = result
    return result


def _parse_line(raw: bytes, line_no: int) -> tuple[dict | None, str | None]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, f"line {line_no}: not valid UTF-8"
    except json.JSONDecodeError as exc:
        return None, f"line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return None, f"line {line_no}: JSON nested too deeply"
    if not isinstance(data, dict):
        return None, f"line {line_no}: expected a JSON object, got {kind(data)}"
    return data, None


def open_input(path: str | Path) -> InputReader:
    """Check that `path` exists, is readable and is what its extension says, without reading it."""
    path = Path(path)
    if not path.exists():
        raise JobError(f"input file not found: {path}")
    if path.is_dir():
        raise JobError(f"{path}: is a directory, not an input file")
    ext = extension(path, INPUT_FORMATS)
    if ext is None:
        raise JobError(f"{path}: unknown input format (expected .parquet, .jsonl or .jsonl.gz)")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError as exc:
        raise JobError(f"{path}: cannot read input ({exc.strerror or one_line(exc)})") from None
    total = None
    if ext == ".jsonl.gz":
        try:
            if head != _GZIP_MAGIC:
                raise OSError("no gzip header")
            with gzip.open(path, "rb") as g:
                g.read(1)  # decompresses the first block only
        except (OSError, EOFError, zlib.error) as exc:
            raise JobError(f"{path}: not a readable gzip file ({one_line(exc)})") from None
    elif ext == ".parquet":
        try:
            with pq.ParquetFile(path) as pf:
                total = pf.metadata.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise JobError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
    return InputReader(path, INPUT_FORMATS[ext], total)
