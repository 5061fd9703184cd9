"""The files that make up one output: side files beside it (manifest, parts, lock) and the shards of a
data-parallel run (`<output stem>.dp<g><ext>`). Names only: nothing here reads or writes a file but
listing the output's folder (`existing_shards`)."""

from __future__ import annotations

import re
from pathlib import Path


def side_path(path: Path, suffix: str) -> Path:
    """`out.jsonl` + `.manifest.json` -> `out.jsonl.manifest.json`."""
    return path.with_name(path.name + suffix)


def split_name(output: Path) -> tuple[str, str]:
    """`run.docqa.jsonl` -> (`run.docqa`, `.jsonl`)."""
    for ext in (".jsonl", ".parquet"):
        if output.name.lower().endswith(ext):
            return output.name[: -len(ext)], output.name[-len(ext):]
    return output.name, ""


def shard_path(output: Path, group: int) -> Path:
    """Group g's output while the job runs: `out.jsonl` -> `out.dp<g>.jsonl` (same format)."""
    stem, ext = split_name(output)
    return output.with_name(f"{stem}.dp{group}{ext}")


def existing_shards(output: Path) -> list[Path]:
    """The shards next to `output`, from a run with any dp (their number need not match this run's).

    A shard counts as there if any of its files is: its rows, its manifest, or its parts (a shard
    killed before its first row has only those two).
    """
    stem, ext = split_name(output)
    pattern = re.compile(re.escape(stem) + r"\.dp(\d+)" + re.escape(ext) + r"(\.manifest\.json|\.parts)?$")
    found = {}
    if output.parent.is_dir():
        for path in output.parent.iterdir():
            match = pattern.match(path.name)
            if match:
                found[int(match.group(1))] = shard_path(output, int(match.group(1)))
    return [found[group] for group in sorted(found)]
