"""Arrow tables from rows of arbitrary JSON values, and one schema for many Parquet parts.

A column whose values share no Arrow type is stored as text (JSON for non-strings); the data decides
a column's type, a hint only types columns the data leaves all-null. Used by the Parquet output.
"""

from __future__ import annotations

import json

import pyarrow as pa

ARROW_ERRORS = (pa.ArrowException, OSError, TypeError, ValueError, OverflowError)
DEFAULT_OUTPUT_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()),
                                   ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()),
                                   ("output_tokens", pa.int64()), ("error", pa.string())])


def rows_to_table(rows: list[dict]) -> pa.Table:
    names = list(dict.fromkeys(name for row in rows for name in row))
    columns = {}
    for name in names:
        values = [row.get(name) for row in rows]
        try:
            column = pa.array(values)
        except ARROW_ERRORS:
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


def unified_schema(schemas: list[pa.Schema], hint: pa.Schema) -> pa.Schema:
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
    except ARROW_ERRORS:
        return pa.string()


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
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
            except ARROW_ERRORS:
                column = _as_text(column.to_pylist())
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)
