"""An output's manifest (`<output>.manifest.json`): what the output depends on, checked on --resume.

`check_manifest` refuses to continue an output written with a different recipe or model, naming
the first key that differs; keys an older manifest lacks take the values given as `legacy` (what
outputs written before those keys existed were). Also the small atomic-write helpers the output
files share. Nothing here knows recipes; manifests are plain dicts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.errors import JobError
from engine.job.io.common import one_line

MANIFEST_KEYS_COMPARED = ("recipe", "model")  # what must match for --resume to continue an output


def check_manifest(output: Path, manifest_path: Path, manifest: dict, legacy: dict | None = None) -> None:
    again = "rerun with --overwrite or another --output"
    if not manifest_path.exists():
        raise JobError(f"{output} has no manifest ({manifest_path.name}), so it cannot "
                       f"be resumed; {again}")
    try:
        old = json.loads(manifest_path.read_text(encoding="utf-8"))
        assert isinstance(old, dict), "not a JSON object"
    except (OSError, ValueError, AssertionError) as exc:
        raise JobError(f"{manifest_path}: unreadable manifest ({one_line(exc)}); {again}") from None
    old = _with_defaults(old, legacy or {})
    new = json.loads(json.dumps(manifest, default=str))  # tuples -> lists, as stored
    for key in MANIFEST_KEYS_COMPARED:
        if old.get(key) != new.get(key):
            raise JobError(f"{output} was written with a different {key} "
                           f"({_difference(old.get(key), new.get(key))}); {again}")


def _with_defaults(old: dict, defaults: dict) -> dict:
    out = dict(old)
    for key, value in defaults.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _with_defaults(out[key], value)
        elif key not in out:
            out[key] = value
    return out


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


def write_manifest(path: Path, manifest: dict, *, fsync: bool) -> None:
    text = json.dumps(manifest, indent=2, ensure_ascii=False, default=str) + "\n"
    atomic_write(path, text.encode("utf-8"), fsync=fsync)


def atomic_write(path: Path, data: bytes, *, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
