"""Writing job output: crash-safe, resumable, one row per finished input row.

`OutputWriter` keeps every finished row on disk as it comes (JSONL: one flushed line per row; Parquet:
atomic part files merged at `close()`) and, on resume, says which ids are done. A manifest beside the
output records what the output depends on. Rows are plain dicts: nothing here knows recipes or models.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import JobError
from engine.job.io.arrow import DEFAULT_OUTPUT_SCHEMA, conform, rows_to_table, unified_schema
from engine.job.io.common import extension, kind as json_kind, one_line

OUTPUT_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl"}
MANIFEST_KEYS_COMPARED = ("recipe", "model")  # what must match for --resume to continue an output
_HALF_WRITTEN = object()  # marks a JSONL output line cut short by a kill


def id_key(value: Any) -> str:
    """The canonical key of a row id: 3 and "3" differ; a key survives a write/read round trip."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


class OutputWriter:
    """Crash-safe output; format by extension (`.jsonl` or `.parquet`). See the module docstring.

    mode "new" refuses an existing output (touching nothing), "overwrite" deletes it, "resume"
    continues it if its manifest has the same recipe and model, filling `done_ids`.
    JSONL: each row is one line, written and flushed at once (`fsync=True` also syncs it to disk).
    Parquet: rows are committed every `part_rows` rows or once the oldest buffered row is
    `part_seconds` old (checked on `write`), as `<path>.parts/part-NNNNNN.parquet` (tmp + rename);
    `close()` streams the parts into `path` (tmp + rename) and removes the parts folder. The `id`
    column keeps the ids' type, so all ids in one Parquet output must be ints or all strings;
    another column whose values share no Arrow type is stored as text (JSON for non-strings).
    `schema_hint` (default: the standard columns) types the columns the rows leave all-null.
    The manifest `<path>.manifest.json` stays beside the output, so a finished job can be resumed.
    """

    def __init__(self, path: str | Path, *, mode: str, manifest: dict,
                 schema_hint: pa.Schema | None = None, part_rows: int = 256,
                 part_seconds: float = 30.0, fsync: bool = False):
        self.path = Path(path)
        ext = extension(self.path, OUTPUT_FORMATS)
        if ext is None:
            raise JobError(f"{self.path}: unknown output format (expected .jsonl or .parquet)")
        assert mode in ("new", "overwrite", "resume"), f"unknown mode {mode!r}"
        self.format = OUTPUT_FORMATS[ext]
        self.parts_dir = self.path.with_name(self.path.name + ".parts")
        self.manifest_path = self.path.with_name(self.path.name + ".manifest.json")
        self.schema_hint, self.part_rows, self.part_seconds = schema_hint, part_rows, part_seconds
        self.fsync = fsync
        self.done_ids: set[str] = set()  # id_key() of every id already in the output
        self.done_errors = 0  # how many of those rows are error records (finish_reason "error")
        self.rows_written = 0  # by this process
        self.id_type: str | None = None  # Parquet: "int" | "str", fixed by the first id
        self._pending: list[dict] = []  # Parquet rows not yet in a part
        self._pending_since = 0.0
        self._next_part = 1
        self._file = None
        self._closed = False
        existing = [p for p in (self.path, self.parts_dir, self.manifest_path) if p.exists()]
        if mode == "new" and existing:
            raise JobError(f"{existing[0]} exists; use --resume to continue it "
                           "or --overwrite to replace it")
        try:
            if mode == "overwrite":
                self._remove_previous()
            elif mode == "resume" and existing:
                self._check_manifest(manifest)
                self._scan_jsonl() if self.format == "jsonl" else self._scan_parts()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(manifest, indent=2, ensure_ascii=False, default=str) + "\n"
            _atomic_write(self.manifest_path, text.encode("utf-8"), fsync=fsync)
            if self.format == "jsonl":
                self._file = open(self.path, "ab")
            else:
                self.parts_dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise JobError(f"{self.path}: cannot write output ({one_line(exc)})") from None

    # -- opening -------------------------------------------------------------------------------

    def _remove_previous(self) -> None:
        for p in (self.path, self.manifest_path):
            p.unlink(missing_ok=True)
        if self.parts_dir.exists():
            shutil.rmtree(self.parts_dir)

    def _check_manifest(self, manifest: dict) -> None:
        again = "rerun with --overwrite or another --output"
        if not self.manifest_path.exists():
            raise JobError(f"{self.path} has no manifest ({self.manifest_path.name}), so it cannot "
                           f"be resumed; {again}")
        try:
            old = json.loads(self.manifest_path.read_text(encoding="utf-8"))
            assert isinstance(old, dict), "not a JSON object"
        except (OSError, ValueError, AssertionError) as exc:
            raise JobError(f"{self.manifest_path}: unreadable manifest ({one_line(exc)}); "
                           f"{again}") from None
        new = json.loads(json.dumps(manifest, default=str))  # tuples -> lists, as stored
        for key in MANIFEST_KEYS_COMPARED:
            if old.get(key) != new.get(key):
                raise JobError(f"{self.path} was written with a different {key} "
                               f"({_difference(old.get(key), new.get(key))}); {again}")

    def _scan_jsonl(self) -> None:
        """Collect the ids already written; cut a half-written last line off the file."""
        if not self.path.exists():
            return
        good_end = 0  # byte offset just past the last complete row
        with open(self.path, "rb") as f:
            lines = enumerate(f, 1)
            for line_no, raw in lines:
                if not raw.strip() and raw.endswith(b"\n"):
                    good_end += len(raw)
                    continue
                try:
                    row = json.loads(raw) if raw.endswith(b"\n") else _HALF_WRITTEN
                except ValueError:
                    row = _HALF_WRITTEN
                if row is _HALF_WRITTEN:  # the line a killed job was writing: only ever the last
                    if next(lines, None) is not None:
                        raise JobError(f"{self.path}: line {line_no} is not valid JSON; fix or "
                                       "remove it, or rerun with --overwrite")
                    break
                if not isinstance(row, dict) or "id" not in row:
                    raise JobError(f"{self.path}: line {line_no} is not an output row (no id); "
                                   "rerun with --overwrite or another --output")
                self.done_ids.add(id_key(row["id"]))
                self.done_errors += row.get("finish_reason") == "error"
                good_end += len(raw)
        if good_end < self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good_end)

    def _scan_parts(self) -> None:
        if self.parts_dir.exists():
            for tmp in self.parts_dir.glob("*.tmp"):  # a part being written when the job died
                tmp.unlink()
        parts = self._part_paths()
        self._next_part = 1 + max((_part_number(p) for p in parts), default=0)
        for source in self._sources():
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
                            reasons = batch.column("finish_reason").to_pylist()
                            self.done_errors += reasons.count("error")
            except (pa.ArrowException, OSError, KeyError) as exc:
                raise JobError(f"{source}: unreadable output ({one_line(exc)}); "
                               "rerun with --overwrite or another --output") from None

    def _part_paths(self) -> list[Path]:
        if not self.parts_dir.exists():
            return []
        return sorted(self.parts_dir.glob("part-*.parquet"), key=_part_number)

    def _sources(self) -> list[Path]:
        """What the Parquet output is made of, in write order: a merged file, then parts."""
        return ([self.path] if self.path.exists() else []) + self._part_paths()

    # -- writing -------------------------------------------------------------------------------

    def write(self, row: dict) -> None:
        """Append one finished row (a dict with an "id"); ValueError if its id is already in."""
        assert not self._closed, "write() after close()"
        key = id_key(row["id"])
        if key in self.done_ids:
            raise ValueError(f"id {key} is already in {self.path}")
        if self.format == "jsonl":
            try:
                line = json.dumps(row, ensure_ascii=False, default=str).encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: keep the file valid UTF-8
                line = json.dumps(row, default=str).encode("ascii")
            self._file.write(line + b"\n")
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        else:
            value = row["id"]
            if value is not None:
                kind = "str" if isinstance(value, str) else "int" if isinstance(value, int) \
                    and not isinstance(value, bool) else None
                self._check_id_type(kind, f"row id {value!r} is {json_kind(value)}")
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(row)
            if (len(self._pending) >= self.part_rows
                    or time.monotonic() - self._pending_since >= self.part_seconds):
                self.flush()
        self.done_ids.add(key)
        self.rows_written += 1

    def _check_id_type(self, kind: str | None, what: str) -> None:
        """Parquet ids must all be ints or all strings. `kind`: "int" | "str" | None (other)."""
        if kind is None or (self.id_type is not None and kind != self.id_type):
            have = {"int": "integers", "str": "strings", None: "integers or strings"}[self.id_type]
            raise JobError(f"{self.path}: {what} but Parquet output ids must all be {have}; "
                           "give every row an id of one type, or write .jsonl")
        self.id_type = kind

    def flush(self) -> None:
        """Parquet: commit the buffered rows as a part file now (JSONL rows are already flushed)."""
        if self.format != "parquet" or not self._pending:
            return
        part = self.parts_dir / f"part-{self._next_part:06d}.parquet"
        tmp = part.with_name(part.name + ".tmp")
        pq.write_table(rows_to_table(self._pending), tmp)
        if self.fsync:
            _fsync_path(tmp)
        os.replace(tmp, part)
        self._next_part += 1
        self._pending = []

    def close(self) -> None:
        """Finish the output. Parquet: commit the last rows, then merge all parts into `path`."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
            return
        self.flush()
        parts = self._part_paths()
        if parts or not self.path.exists():
            self._merge()
        if self.parts_dir.exists():
            shutil.rmtree(self.parts_dir)

    def _merge(self) -> None:
        # Sources without rows (an output left by a job stopped before its first row) type nothing.
        sources = [s for s in self._sources() if pq.read_metadata(s).num_rows]
        hint = self.schema_hint if self.schema_hint is not None else DEFAULT_OUTPUT_SCHEMA
        schema = unified_schema([pq.read_schema(s) for s in sources], hint)
        tmp = self.path.with_name(self.path.name + ".tmp")
        seen: set[str] = set()  # a crash between rename and rmtree leaves rows in both
        with pq.ParquetWriter(tmp, schema) as out:
            for source in sources:
                with pq.ParquetFile(source) as pf:
                    for batch in pf.iter_batches():
                        table = conform(pa.Table.from_batches([batch]), schema)
                        keep = []
                        for value in table.column("id").to_pylist():
                            keep.append(id_key(value) not in seen)
                            seen.add(id_key(value))
                        out.write_table(table if all(keep) else table.filter(pa.array(keep)))
        if self.fsync:
            _fsync_path(tmp)
        os.replace(tmp, self.path)

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Failing job: keep what is finished for --resume, but skip the (possibly long) merge.
        self._closed = True
        if self._file is not None:
            self._file.close()
        else:
            self.flush()


def _part_number(path: Path) -> int:
    return int(path.name.split("-")[1].split(".")[0])


def _atomic_write(path: Path, data: bytes, *, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _difference(old: Any, new: Any, where: str = "") -> str:
    """Where two manifest values first differ, as 'draft.method was "a", now "b"'."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key) != new.get(key):
                return _difference(old.get(key), new.get(key), f"{where}{key}.")

    def short(v: Any) -> str:
        text = json.dumps(v, ensure_ascii=False, default=str)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"{where.rstrip('.') + ' ' if where else ''}was {short(old)}, now {short(new)}"


# Arrow tables from rows of arbitrary JSON values
