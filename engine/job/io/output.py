"""Writing job output: crash-safe, resumable, one line per finished input row, in input or finish order.

`OutputWriter` keeps every finished row on disk as it comes and, on resume, says which ids are done.
JSONL in finishing order: one line appended (and flushed) per row. JSONL in input order, and all
Parquet: rows are committed to parts beside the output (`<output>.parts/`: staged JSONL lines that
carry the row's input row number, or atomic Parquet part files), and `close()` writes the output
from them in the order asked (an external merge sort, bounded memory) and removes them. A manifest
beside the output records what the output depends on. A write that fails (disk full, I/O error)
raises `OutputError` and leaves every row written before it in place. Lines are plain dicts in a
`LineFormat` (magicdec rows or OpenAI batch lines): nothing here knows recipes or models.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import JobError, OutputError
from engine.job.io import jsonl_lines, parquet_parts
from engine.job.io.common import extension, kind as json_kind, one_line
from engine.job.io.lines import MAGICDEC_LINES, LineFormat
from engine.job.io.manifest import check_manifest, write_manifest
from engine.job.io.ordering import merge_runs, sorted_chunks

OUTPUT_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl"}
ORDERS = ("finish", "input")
SORT_CHUNK_BYTES = 64 << 20  # JSONL rows sorted in memory at a time when putting rows in input order


def id_key(value: Any) -> str:
    """The canonical key of a row id: 3 and "3" differ; a key survives a write/read round trip."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


class OutputWriter:
    """Crash-safe output; format by extension (`.jsonl` or `.parquet`). See the module docstring.

    mode "new" refuses an existing output (touching nothing), "overwrite" deletes it, "resume"
    continues it if its manifest has the same recipe and model, filling `done_ids`.
    `order` "finish" keeps rows in the order they are written, "input" sorts them by the `index`
    given to `write` (rows without one, and rows already merged into the output, come first).
    `finalize=False`: `close()` leaves the rows in their parts (a data-parallel shard, or an output
    more rows will be added to), for a later writer to merge.
    Parquet: rows are committed every `part_rows` rows or once the oldest buffered row is
    `part_seconds` old (checked on `write`). The `id` column keeps the ids' type, so all ids in one
    Parquet output must be ints or all strings; another column whose values share no Arrow type is
    stored as text (JSON for non-strings). `schema_hint` (default: the standard columns) types the
    columns the rows leave all-null. The manifest stays beside the output, so a finished job can be
    resumed; keys an older manifest lacks compare as `legacy_manifest` gives them.
    """

    def __init__(self, path: str | Path, *, mode: str, manifest: dict, lines: LineFormat = MAGICDEC_LINES,
                 order: str = "finish", finalize: bool = True, schema_hint: pa.Schema | None = None,
                 part_rows: int = 256, part_seconds: float = 30.0, fsync: bool = False,
                 legacy_manifest: dict | None = None):
        self.path = Path(path)
        ext = extension(self.path, OUTPUT_FORMATS)
        if ext is None:
            raise JobError(f"{self.path}: unknown output format (expected .jsonl or .parquet)")
        assert mode in ("new", "overwrite", "resume"), f"unknown mode {mode!r}"
        assert order in ORDERS, f"unknown order {order!r}"
        self.format = OUTPUT_FORMATS[ext]
        self.lines, self.order, self.finalize = lines, order, finalize
        self.staged = self.format == "parquet" or order == "input"  # rows go to parts first
        self.parts_dir = self.path.with_name(self.path.name + ".parts")
        self.sorting_dir = self.path.with_name(self.path.name + ".sorting")  # a merge's spill files
        self.manifest_path = self.path.with_name(self.path.name + ".manifest.json")
        self.schema_hint, self.part_rows, self.part_seconds = schema_hint, part_rows, part_seconds
        self.fsync = fsync
        self.done_ids: set[str] = set()  # id_key() of every id already in the output
        self.done_errors = 0  # how many of those rows are error records
        self.rows_written = 0  # by this process
        self.id_type: str | None = None  # Parquet: "int" | "str", fixed by the first id
        self._pending: list[tuple[int | None, dict]] = []  # Parquet rows not yet in a part
        self._pending_since = 0.0
        self._next_part = 1
        self._fd: int | None = None  # JSONL: the file rows are appended to (the output or a part)
        self._size = 0  # its length after the last complete line
        self._closed = False
        self._failed = False
        existing = [p for p in (self.path, self.parts_dir, self.manifest_path) if p.exists()]
        if mode == "new" and existing:
            raise JobError(f"{existing[0]} exists; use --resume to continue it "
                           "or --overwrite to replace it")
        try:
            if mode == "overwrite":
                self._remove_previous()
            elif mode == "resume" and existing:
                check_manifest(self.path, self.manifest_path, manifest, legacy_manifest)
                self._scan()
            shutil.rmtree(self.sorting_dir, ignore_errors=True)  # what a merge killed half-way left
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_manifest(self.manifest_path, manifest, fsync=fsync)
            if self.staged:
                self.parts_dir.mkdir(exist_ok=True)
            else:
                self._open_append(self.path)
        except OSError as exc:
            raise JobError(f"{self.path}: cannot write output ({one_line(exc)})") from None

    # -- opening -------------------------------------------------------------------------------

    def _remove_previous(self) -> None:
        for p in (self.path, self.manifest_path):
            p.unlink(missing_ok=True)
        for folder in (self.parts_dir, self.sorting_dir):
            if folder.exists():
                shutil.rmtree(folder)

    def _part_paths(self) -> list[Path]:
        if not self.parts_dir.exists():
            return []
        suffix = ".parquet" if self.format == "parquet" else ".jsonl"
        return sorted(self.parts_dir.glob(f"part-*{suffix}"), key=_part_number)

    def _scan(self) -> None:
        """Collect the ids already written, tidying what a killed writer left behind."""
        if self.parts_dir.exists():
            for tmp in self.parts_dir.glob("*.tmp"):  # a part being written when the job died
                tmp.unlink()
        parts = self._part_paths()
        self._next_part = 1 + max((_part_number(p) for p in parts), default=0)
        if self.format == "parquet":
            for source in self._sources():
                self._scan_parquet(source)
            return
        if self.path.exists():
            for line in jsonl_lines.scan(self.path, json.loads, self.lines.is_line):
                self._done(line)
        for part in parts:
            for _, line in jsonl_lines.scan(part, _decode_staged, lambda item: self.lines.is_line(item[1])):
                self._done(line)

    def _done(self, line: dict) -> None:
        self.done_ids.add(id_key(self.lines.key_of(line)))
        self.done_errors += self.lines.is_error(line)

    def _scan_parquet(self, source: Path) -> None:
        try:
            with pq.ParquetFile(source) as pf:
                id_type = pf.schema_arrow.field("id").type
                # An empty output (a job stopped before its first row) has the default schema's
                # string ids: only rows decide what type the ids are.
                if pf.metadata.num_rows and not pa.types.is_null(id_type):
                    kind = "int" if pa.types.is_integer(id_type) else \
                        "str" if pa.types.is_string(id_type) else None
                    self._check_id_type(kind, f"{source.name} has ids of type {id_type}")
                columns = [c for c in ("id", "finish_reason") if c in pf.schema_arrow.names]
                for batch in pf.iter_batches(columns=columns):
                    self.done_ids.update(id_key(v) for v in batch.column("id").to_pylist())
                    if "finish_reason" in columns:
                        self.done_errors += batch.column("finish_reason").to_pylist().count("error")
        except (pa.ArrowException, OSError, KeyError) as exc:
            raise JobError(f"{source}: unreadable output ({one_line(exc)}); "
                           "rerun with --overwrite or another --output") from None

    def _sources(self) -> list[Path]:
        """What the output is made of, in write order: a merged file, then parts."""
        return ([self.path] if self.path.exists() else []) + self._part_paths()

    def _open_append(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size

    # -- writing -------------------------------------------------------------------------------

    def write(self, line: dict, index: int | None = None) -> None:
        """Append one finished row's line; `index` is its input row number (for input order).
        ValueError if its id is already in; OutputError if the disk refuses it."""
        assert not self._closed, "write() after close()"
        assert not self._failed, "write() after a failed write"
        key = id_key(self.lines.key_of(line))
        if key in self.done_ids:
            raise ValueError(f"id {key} is already in {self.path}")
        if self.format == "jsonl":
            data = jsonl_lines.encode_line(line)
            if self.staged:
                if self._fd is None:
                    self._open_append(self.parts_dir / f"part-{self._next_part:06d}.jsonl")
                data = jsonl_lines.stage(index, data)
            else:
                data += b"\n"
            self._append(data)
        else:
            value = line["id"]
            if value is not None:
                kind = "str" if isinstance(value, str) else "int" if isinstance(value, int) \
                    and not isinstance(value, bool) else None
                self._check_id_type(kind, f"row id {value!r} is {json_kind(value)}")
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append((index, line))
            if (len(self._pending) >= self.part_rows
                    or time.monotonic() - self._pending_since >= self.part_seconds):
                self.flush()
        self.done_ids.add(key)
        self.done_errors += self.lines.is_error(line)
        self.rows_written += 1

    def _append(self, data: bytes) -> None:
        try:
            jsonl_lines.append_all(self._fd, data)
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            try:  # no half line left behind where it can be helped (resume copes with one anyway)
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            raise self._failure(exc) from None
        self._size += len(data)

    def _failure(self, exc: OSError) -> OutputError:
        self._failed = True
        kept = len(self.done_ids)
        return OutputError(f"{self.path}: writing the output failed ({one_line(exc)}); the {kept} rows "
                           "written before it are kept: fix the cause (e.g. free disk space) and rerun "
                           "with --resume to finish the job")

    def _check_id_type(self, kind: str | None, what: str) -> None:
        """Parquet ids must all be ints or all strings. `kind`: "int" | "str" | None (other)."""
        if kind is None or (self.id_type is not None and kind != self.id_type):
            have = {"int": "integers", "str": "strings", None: "integers or strings"}[self.id_type]
            raise JobError(f"{self.path}: {what} but Parquet output ids must all be {have}; "
                           "give every row an id of one type, or write .jsonl")
        self.id_type = kind

    def flush(self) -> None:
        """Parquet: commit the buffered rows as a part file now (JSONL rows are already written)."""
        if self.format != "parquet" or not self._pending or self._failed:
            return
        part = self.parts_dir / f"part-{self._next_part:06d}.parquet"
        try:
            parquet_parts.write_part(self._pending, part, fsync=self.fsync)
        except OSError as exc:
            self.done_ids.difference_update(id_key(line["id"]) for _, line in self._pending)
            raise self._failure(exc) from None
        self._next_part += 1
        self._pending = []

    def close(self) -> None:
        """Finish the output: commit the last rows, then (staged, finalize) write the output from
        the parts in the order asked and remove them. OutputError if that fails (parts are kept)."""
        if self._closed:
            return
        self._closed = True
        self._close_file()
        self.flush()
        if not self.staged or not self.finalize:
            return
        try:
            if self._part_paths() or not self.path.exists():
                self._merge()
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        except OSError as exc:
            raise self._failure(exc) from None
        finally:
            shutil.rmtree(self.sorting_dir, ignore_errors=True)

    def _close_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _merge(self) -> None:
        if self.format == "parquet":
            parquet_parts.merge(self._sources(), self.path, order=self.order, key_of=id_key,
                                hint=self.schema_hint, sorting_dir=self.sorting_dir, fsync=self.fsync)
            return
        spill = jsonl_lines.Spiller(self.sorting_dir)
        runs = []
        if self.path.exists():
            final = self.path
            runs.append(lambda: ((-1, data) for data in jsonl_lines.read_lines(final)))
        staged = (item for part in self._part_paths() for item in jsonl_lines.staged_items(part))
        runs += sorted_chunks(staged, spill, chunk_bytes=SORT_CHUNK_BYTES, size=len)
        tmp = self.path.with_name(self.path.name + ".tmp")
        seen: set[str] = set()  # a crash between rename and clean-up leaves rows in both
        try:
            with open(tmp, "wb") as out:
                for _, data in merge_runs(runs, spill):
                    key = id_key(self.lines.key_of(json.loads(data)))
                    if key not in seen:
                        seen.add(key)
                        out.write(data + b"\n")
                out.flush()
                if self.fsync:
                    os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # -- reading back --------------------------------------------------------------------------

    def entries(self) -> Iterator[tuple[int | None, dict]]:
        """(input row number or None, line) of every row in the output and its parts, in write
        order: how a data-parallel shard's rows reach the job's output."""
        self.flush()
        if self.format == "parquet":
            for source in self._sources():
                for key, row in parquet_parts.entries(source):
                    yield (None if key < 0 else key), row
            return
        if self.path.exists():
            for data in jsonl_lines.read_lines(self.path):
                yield None, json.loads(data)
        for part in self._part_paths():
            for data in jsonl_lines.read_lines(part):
                yield _decode_staged(data + b"\n")

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Failing job: keep what is finished for --resume, but skip the (possibly long) merge.
        self._closed = True
        self._close_file()
        try:
            self.flush()
        except OutputError:
            pass  # the job is failing already; that error is the one to report


def _decode_staged(raw: bytes) -> tuple[int | None, dict]:
    index, data = jsonl_lines.unstage(raw)
    return (None if index is not None and index < 0 else index), json.loads(data)


def _part_number(path: Path) -> int:
    return int(path.name.split("-")[1].split(".")[0])
