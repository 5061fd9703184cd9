"""Small helpers the input and output modules share: one-line error text, extensions, JSON type names."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def one_line(err: BaseException) -> str:
    """The first line of an error's message, printable characters only (its type when empty)."""
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else type(err).__name__
    return "".join(c if c.isprintable() else "?" for c in line)


def extension(path: Path, formats: dict[str, str]) -> str | None:
    """The longest of `formats`' extensions that `path`'s name ends with (case-insensitive), or None."""
    name = path.name.lower()
    return next((ext for ext in sorted(formats, key=len, reverse=True) if name.endswith(ext)), None)


def kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
