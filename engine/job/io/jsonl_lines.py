"""JSONL output files: encoding a line, reading a file back (cutting a half-written last line), and
the staged form `[index, line]` that keeps a row's input row number while rows wait to be put in
input order (with the spill files of that sort). Lines are dicts in, bytes out; nothing here knows
what a row contains.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from engine.errors import JobError
from engine.job.io.ordering import Item, Run


def encode_line(line: dict[str, Any]) -> bytes:
    """One line's JSON (no newline), UTF-8; ASCII escapes when it holds a lone surrogate."""
    try:
        return json.dumps(line, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: keep the file valid UTF-8
        return json.dumps(line, default=str).encode("ascii")


def stage(index: int | None, data: bytes) -> bytes:
    """The staged line of a row: `[<index>, <line>]` (index null for a row that has none)."""
    return b"[" + (b"null" if index is None else str(index).encode()) + b", " + data + b"]\n"


def unstage(raw: bytes) -> tuple[int | None, bytes]:
    """(index, line JSON) of a staged line; ValueError if it is not one (e.g. cut short)."""
    head, sep, rest = raw.partition(b", ")
    if not sep or not head.startswith(b"[") or not raw.endswith(b"]\n"):
        raise ValueError("not a staged line")
    index = None if head == b"[null" else int(head[1:])
    return index, rest[:-2]


def scan(path: Path, decode: Callable[[bytes], Any], check: Callable[[Any], bool]) -> Iterator[Any]:
    """The decoded lines of `path` (blank lines skipped). A last line that is cut short (no newline,
    or `decode` rejects it) is what a killed writer leaves: it is cut off the file. A bad line
    anywhere else, or one `check` refuses, is a JobError."""
    good_end = 0  # byte offset just past the last complete line
    with open(path, "rb") as f:
        lines = enumerate(f, 1)
        for line_no, raw in lines:
            if not raw.strip() and raw.endswith(b"\n"):
                good_end += len(raw)
                continue
            try:
                value = decode(raw) if raw.endswith(b"\n") else None
                ok = raw.endswith(b"\n")
            except (ValueError, UnicodeDecodeError):
                ok = False
            if not ok:  # the line a killed job was writing: only ever the last
                if next(lines, None) is not None:
                    raise JobError(f"{path}: line {line_no} is not valid JSON; fix or remove it, or "
                                   "rerun with --overwrite")
                break
            if not check(value):
                raise JobError(f"{path}: line {line_no} is not an output row; rerun with --overwrite "
                               "or another --output")
            good_end += len(raw)
            yield value
    if good_end < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_end)


def read_lines(path: Path) -> Iterator[bytes]:
    """The complete, non-blank lines of a file scanned before (no newline)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip() and raw.endswith(b"\n"):
                yield raw[:-1]


def staged_items(path: Path) -> Iterator[Item]:
    """(sort key, line JSON) of every staged line of a part."""
    from engine.job.io.ordering import sort_key

    for raw in read_lines(path):
        index, data = unstage(raw + b"\n")
        yield sort_key(index), data


def append_all(fd: int, data: bytes) -> None:
    """Write all of `data` at the end of `fd` (O_APPEND), however many calls it takes."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class Spiller:
    """Spill files of a sort, `<dir>/run-NNNNNN.jsonl`, each a sorted run of staged lines."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.count = 0

    def __call__(self, items: Iterator[Item]) -> Run:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.count += 1
        path = self.folder / f"run-{self.count:06d}.jsonl"
        with open(path, "wb") as f:
            for key, data in items:
                f.write(stage(key, data))
        return lambda: staged_items(path)
