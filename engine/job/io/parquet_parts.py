"""Parquet output in parts: committed part files with each row's input row number, merged at the end.

A part (`<output>.parts/part-NNNNNN.parquet`) holds rows sorted by input row number, stored in an
extra `_magicdec_index` column (-1 for rows that have none) that the merged output drops. `merge`
streams the sources (a merged file from an earlier run, then the parts) into one file, either in the
order they were written (`finish`) or in input order (`input`, an external merge of the parts), each
id once. Rows are dicts of JSON-like values; nothing here knows recipes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from engine.job.io.arrow import DEFAULT_OUTPUT_SCHEMA, conform, rows_to_table, unified_schema
from engine.job.io.manifest import fsync_path
from engine.job.io.ordering import Item, Run, merge_runs, sort_key

INDEX_COLUMN = "_magicdec_index"
MERGE_BATCH_ROWS = 64  # rows read at a time from each source while merging


def write_part(rows: list[tuple[int | None, dict]], part: Path, *, fsync: bool) -> None:
    """Commit rows (index, line) as one part, atomically (tmp + rename), sorted by index."""
    rows = sorted(rows, key=lambda item: sort_key(item[0]))
    table = rows_to_table([line for _, line in rows])
    table = table.append_column(INDEX_COLUMN, pa.array([sort_key(i) for i, _ in rows], pa.int64()))
    tmp = part.with_name(part.name + ".tmp")
    try:
        pq.write_table(table, tmp)
        if fsync:
            fsync_path(tmp)
        os.replace(tmp, part)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def entries(source: Path, batch_rows: int = MERGE_BATCH_ROWS) -> Iterator[Item]:
    """(sort key, row) of every row of a part or merged file (merged files' rows sort first)."""
    with pq.ParquetFile(source) as pf:
        for batch in pf.iter_batches(batch_size=batch_rows):
            rows = batch.to_pylist()
            for row in rows:
                yield sort_key(row.pop(INDEX_COLUMN, None)), row


def _schema(sources: list[Path], hint: pa.Schema | None) -> pa.Schema:
    schemas = [pq.read_schema(s) for s in sources]
    schemas = [pa.schema([f for f in s if f.name != INDEX_COLUMN]) for s in schemas]
    return unified_schema(schemas, hint if hint is not None else DEFAULT_OUTPUT_SCHEMA)


def merge(sources: list[Path], path: Path, *, order: str, key_of, hint: pa.Schema | None,
          sorting_dir: Path, fsync: bool) -> None:
    """Stream `sources` (a merged file first, then parts in commit order) into `path` (tmp + rename),
    keeping the first copy of each id (a crash between rename and clean-up leaves rows in both)."""
    # Sources without rows (an output left by a job stopped before its first row) type nothing.
    sources = [s for s in sources if pq.read_metadata(s).num_rows]
    schema = _schema(sources, hint)
    tmp = path.with_name(path.name + ".tmp")
    seen: set[str] = set()
    try:
        with pq.ParquetWriter(tmp, schema) as out:
            if order == "finish":
                for source in sources:
                    with pq.ParquetFile(source) as pf:
                        for batch in pf.iter_batches():
                            table = conform(pa.Table.from_batches([batch]), schema)
                            keep = [_first_time(seen, key_of(value)) for value in table.column("id").to_pylist()]
                            out.write_table(table if all(keep) else table.filter(pa.array(keep)))
            else:
                spill = _Spiller(sorting_dir, schema)
                runs: list[Run] = [(lambda s=s: entries(s)) for s in sources]
                batch: list[dict] = []
                for _, row in merge_runs(runs, spill):
                    if _first_time(seen, key_of(row["id"])):
                        batch.append(row)
                    if len(batch) >= MERGE_BATCH_ROWS:
                        out.write_table(conform(rows_to_table(batch), schema))
                        batch = []
                if batch:
                    out.write_table(conform(rows_to_table(batch), schema))
        if fsync:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _first_time(seen: set[str], key: str) -> bool:
    if key in seen:
        return False
    seen.add(key)
    return True


class _Spiller:
    """Spill files of a multi-pass merge: Parquet runs in the output's schema plus the index."""

    def __init__(self, folder: Path, schema: pa.Schema):
        self.folder, self.count = folder, 0
        self.schema = schema.append(pa.field(INDEX_COLUMN, pa.int64()))

    def __call__(self, items: Iterator[Item]) -> Run:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.count += 1
        path = self.folder / f"run-{self.count:06d}.parquet"
        with pq.ParquetWriter(path, self.schema) as out:
            batch: list[tuple[int, dict[str, Any]]] = []
            for item in items:
                batch.append(item)
                if len(batch) >= MERGE_BATCH_ROWS:
                    out.write_table(self._table(batch))
                    batch = []
            if batch:
                out.write_table(self._table(batch))
        return lambda: entries(path)

    def _table(self, batch: list[tuple[int, dict]]) -> pa.Table:
        rows = [{**row, INDEX_COLUMN: key} for key, row in batch]
        return conform(rows_to_table(rows), self.schema)
