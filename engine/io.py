"""Job input and output files: streamed reading, crash-safe writing, resume.

Input: `open_input` checks a `.parquet`, `.jsonl` or `.jsonl.gz` file up front (exists, readable,
the format its name says) without reading it all; iterating the `InputReader` streams `InputRow`s in
file order, a bad JSONL line becoming an error row instead of stopping the job.
`openai_batch_request` recognises rows in the OpenAI batch format that vLLM's `run-batch` reads.
Output: `OutputWriter` keeps every finished row on disk as it comes (JSONL: one flushed line per
row; Parquet: atomic part files merged at `close()`) and, on resume, says which ids are done.
This module knows nothing about recipes, prompts, tokens or models: rows are plain dicts.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import JobError, RowError

INPUT_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".jsonl.gz": "jsonl"}
OUTPUT_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl"}
PARQUET_BATCH_ROWS = 64  # input rows decoded at a time; long-context rows are large
MANIFEST_KEYS_COMPARED = ("recipe", "model")  # what must match for --resume to continue an output
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
_GZIP_MAGIC = b"\x1f\x8b"
_HALF_WRITTEN = object()  # marks a JSONL output line cut short by a kill
_ARROW_ERRORS = (pa.ArrowException, OSError, TypeError, ValueError, OverflowError)
DEFAULT_OUTPUT_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()),
                                   ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()),
                                   ("output_tokens", pa.int64()), ("error", pa.string())])


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else type(err).__name__
    return "".join(c if c.isprintable() else "?" for c in line)


def _extension(path: Path, formats: dict[str, str]) -> str | None:
    name = path.name.lower()
    return next((ext for ext in sorted(formats, key=len, reverse=True) if name.endswith(ext)), None)


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------------------------
# Input


@dataclass
class InputRow:
    index: int  # 0-based row number in the input file (JSONL: blank lines are not rows)
    data: dict | None  # the row's columns; None when the row itself is unreadable
    error: str | None = None  # one line saying why the row is unreadable


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
        self.total = total  # row count when the file says so cheaply (Parquet), else None

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
                           f"{_one_line(exc)}") from None

    def _jsonl_rows(self) -> Iterator[InputRow]:
        opener = gzip.open if self.path.name.lower().endswith(".gz") else open
        index = 0
        try:
            with opener(self.path, "rb") as f:
                for line_no, raw in enumerate(f, 1):
                    if line_no == 1:
                        raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
                    if raw.strip():
                        yield InputRow(index, *_parse_line(raw, line_no))
                        index += 1
        except (OSError, EOFError, zlib.error) as exc:
            raise JobError(f"{self.path}: unreadable after row {index}: {_one_line(exc)}") from None


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
        return None, f"line {line_no}: expected a JSON object, got {_kind(data)}"
    return data, None


def open_input(path: str | Path) -> InputReader:
    """Check that `path` exists, is readable and is what its extension says, without reading it."""
    path = Path(path)
    if not path.exists():
        raise JobError(f"input file not found: {path}")
    if path.is_dir():
        raise JobError(f"{path}: is a directory, not an input file")
    ext = _extension(path, INPUT_FORMATS)
    if ext is None:
        raise JobError(f"{path}: unknown input format (expected .parquet, .jsonl or .jsonl.gz)")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError as exc:
        raise JobError(f"{path}: cannot read input ({exc.strerror or _one_line(exc)})") from None
    total = None
    if ext == ".jsonl.gz":
        try:
            if head != _GZIP_MAGIC:
                raise OSError("no gzip header")
            with gzip.open(path, "rb") as g:
                g.read(1)  # decompresses the first block only
        except (OSError, EOFError, zlib.error) as exc:
            raise JobError(f"{path}: not a readable gzip file ({_one_line(exc)})") from None
    elif ext == ".parquet":
        try:
            with pq.ParquetFile(path) as pf:
                total = pf.metadata.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise JobError(f"{path}: not a readable Parquet file ({_one_line(exc)})") from None
    return InputReader(path, INPUT_FORMATS[ext], total)


# --------------------------------------------------------------------------------------------
# OpenAI batch rows


def openai_batch_request(data: dict) -> dict | None:
    """Normalise a row in the OpenAI batch format (vLLM `run-batch`); None if it is not one.

    Returns {"id", "prompt" (str | None), "messages" (list | None), "overrides"}, overrides holding
    only the sampling keys the body sets, under recipe names (max_tokens -> max_new_tokens).
    Raises `RowError` when the row has `custom_id` and `body` but is not a request magicdec can run.
    """
    if not isinstance(data, dict) or "custom_id" not in data or "body" not in data:
        return None
    custom_id, body, url = data["custom_id"], data["body"], data.get("url")
    if not isinstance(custom_id, (str, int)) or isinstance(custom_id, bool):
        raise RowError(f"custom_id must be a string, got {_kind(custom_id)}")
    if data.get("method", "POST") != "POST":
        raise RowError(f"method must be POST, got {data['method']!r}")
    if url not in (None, COMPLETIONS_URL, CHAT_URL):
        raise RowError(f"url {url!r} is not supported (only {COMPLETIONS_URL} and {CHAT_URL})")
    if not isinstance(body, dict):
        raise RowError(f"body must be an object, got {_kind(body)}")
    if "prompt" in body and "messages" in body:
        raise RowError("body has both prompt and messages")
    if "prompt" not in body and "messages" not in body:
        raise RowError("body has neither prompt nor messages")
    wanted = "messages" if url == CHAT_URL else "prompt" if url == COMPLETIONS_URL else None
    if wanted is not None and wanted not in body:
        raise RowError(f"body for {url} needs {wanted}")
    prompt = _batch_prompt(body["prompt"]) if "prompt" in body else None
    messages = _batch_messages(body["messages"]) if "messages" in body else None
    return {"id": custom_id, "prompt": prompt, "messages": messages,
            "overrides": _batch_overrides(body)}


def _batch_prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise RowError("prompt as token ids is not supported; give the text")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise RowError(f"a list of {len(prompt)} prompts is not supported; one prompt per row")
    if not isinstance(prompt, str):
        raise RowError(f"prompt must be a string, got {_kind(prompt)}")
    return prompt


def _batch_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RowError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"messages[{i}] must be an object with a string role and content")
        out.append({"role": message["role"], "content": _message_text(message.get("content"), i)})
    return out


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError(f"messages[{i}].content must be a string or a list of text parts, "
                       f"got {_kind(content)}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RowError(f"messages[{i}].content: part of type {kind!r} is not supported "
                           "(text only)")
        texts.append(part["text"])
    return "\n".join(texts)


# body key -> (recipe key, integer?, lowest, highest); the first body key present wins a recipe key
_BATCH_SAMPLING = {"max_completion_tokens": ("max_new_tokens", True, 1, None),
                   "max_tokens": ("max_new_tokens", True, 1, None),
                   "temperature": ("temperature", False, 0, None),
                   "top_p": ("top_p", False, 0, 1),
                   "top_k": ("top_k", True, -1, None),  # vLLM: -1 = off, like our 0
                   "seed": ("seed", True, None, None)}


def _batch_overrides(body: dict) -> dict[str, Any]:
    if body.get("n", 1) not in (1, None):
        raise RowError("body.n must be 1: one completion per row")
    out: dict[str, Any] = {}
    for key, (name, integer, low, high) in _BATCH_SAMPLING.items():
        value = body.get(key)
        if value is None or name in out:
            continue
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise RowError(f"body.{key} must be {'an integer' if integer else 'a number'}, "
                           f"got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise RowError(f"body.{key} must be {bounds}, got {value!r}")
        out[name] = value if integer else float(value)
    if out.get("top_p") == 0:
        raise RowError("body.top_p must be > 0")
    if "top_k" in out:
        out["top_k"] = max(0, out["top_k"])
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RowError("body.stop must be a string or a list of strings")
        out["stop"] = stop
    return out


# --------------------------------------------------------------------------------------------
# Output


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
        ext = _extension(self.path, OUTPUT_FORMATS)
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
            raise JobError(f"{self.path}: cannot write output ({_one_line(exc)})") from None

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
            raise JobError(f"{self.manifest_path}: unreadable manifest ({_one_line(exc)}); "
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
                raise JobError(f"{source}: unreadable output ({_one_line(exc)}); "
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
                self._check_id_type(kind, f"row id {value!r} is {_kind(value)}")
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
        pq.write_table(_rows_to_table(self._pending), tmp)
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
        schema = _unified_schema([pq.read_schema(s) for s in sources], hint)
        tmp = self.path.with_name(self.path.name + ".tmp")
        seen: set[str] = set()  # a crash between rename and rmtree leaves rows in both
        with pq.ParquetWriter(tmp, schema) as out:
            for source in sources:
                with pq.ParquetFile(source) as pf:
                    for batch in pf.iter_batches():
                        table = _conform(pa.Table.from_batches([batch]), schema)
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


def _rows_to_table(rows: list[dict]) -> pa.Table:
    names = list(dict.fromkeys(name for row in rows for name in row))
    columns = {}
    for name in names:
        values = [row.get(name) for row in rows]
        try:
            column = pa.array(values)
        except _ARROW_ERRORS:
            column = None
        writable = column is not None and _writable(column.type)
        columns[name] = column if writable else _as_text(values)
    return pa.table(columns)


def _writable(arrow_type: pa.DataType) -> bool:
    """Parquet cannot store a struct without fields (a column of `{}`)."""
    if pa.types.is_struct(arrow_type):
        return arrow_type.num_fields > 0 and all(_writable(f.type) for f in arrow_type)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return _writable(arrow_type.value_type)
    return True


def _as_text(values: list) -> pa.Array:
    return pa.array([v if v is None or isinstance(v, str) else
                     json.dumps(v, ensure_ascii=False, default=str) for v in values], pa.string())


def _unified_schema(schemas: list[pa.Schema], hint: pa.Schema) -> pa.Schema:
    """One schema for all parts. The data decides a column's type; `hint` only types the columns
    the data leaves untyped (all null, or absent), so it can never change the stored ids."""
    types: dict[str, pa.DataType] = {}
    for schema in schemas:
        for field in schema:
            old = types.get(field.name)
            types[field.name] = field.type if old is None else _common_type(old, field.type)
    for field in hint:
        if pa.types.is_null(types.get(field.name, pa.null())):
            types[field.name] = field.type
    return pa.schema(list(types.items()))


def _common_type(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    if a == b or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_nested(a) or pa.types.is_nested(b):
        return pa.string()
    try:
        pair = [pa.schema([("x", a)]), pa.schema([("x", b)])]
        return pa.unify_schemas(pair, promote_options="permissive").field("x").type
    except _ARROW_ERRORS:
        return pa.string()


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly `schema`'s columns: missing ones null, others cast (or made text)."""
    columns = []
    for field in schema:
        if field.name not in table.column_names:
            columns.append(pa.nulls(len(table), field.type))
            continue
        column = table.column(field.name)
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except _ARROW_ERRORS:
                column = _as_text(column.to_pylist())
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)
