"""From input rows to engine requests: the one path `magicdec run` and `magicdec validate` share.

Each row gets a verdict: a `Request` to generate (with the row's own sampling parameters,
`engine.job.row_sampling`), an error record (unreadable row, bad OpenAI batch request, a bad
sampling value, missing template column, a prompt that cannot fit its slot), or a duplicate (its id was
already queued in this run; the output is keyed by id, so it is not generated twice). Ids come from
`input.id_field`, an OpenAI batch row's `custom_id` (read from the text of a line that is not valid
JSON, when it can be), or the row number; ids made up from row numbers
take the type of the input's own ids, so one output holds one id type (Parquet needs it).
This module neither writes nor runs anything.
"""

from __future__ import annotations

import dataclasses
from typing import AbstractSet, Any, Callable, Iterable, Iterator

from engine.config.schema import Recipe
from engine.core.scheduler import slot_problem
from engine.core.sequence import Request
from engine.errors import RowError
from engine.job.io.input import InputRow
from engine.job.io.lines import endpoint_of
from engine.job.io.openai_batch import openai_batch_request, salvage_custom_id
from engine.job.io.output import id_key
from engine.job.prompts import PromptBuilder
from engine.job.row_sampling import row_sampling


@dataclasses.dataclass
class RowVerdict:
    index: int  # 0-based row number in the input
    id: Any
    data: dict  # the row's columns ({} when unreadable)
    request: Request | None = None  # a good row: what the engine generates (None without a tokenizer)
    error: str | None = None  # the row becomes this error record
    duplicate: bool = False  # its id was already queued in this run
    endpoint: str | None = None  # the OpenAI endpoint it answers (engine.job.io.lines.endpoint_of)


def row_verdicts(rows: Iterable[InputRow], recipe: Recipe, builder: PromptBuilder, max_len: int, *,
                 limit: int | None = None, keep_row: Callable[[int], bool] | None = None,
                 skip_ids: AbstractSet[str] = frozenset()) -> Iterator[RowVerdict]:
    """The verdict on every row (up to `limit`), in input order.

    Rows whose id is in `skip_ids` (already written: --resume) or for which `keep_row(index)` is
    false (another data-parallel group's) get none. Without a tokenizer (a random-weight model) good
    rows have their template checked but no request.
    """
    id_field = recipe.input.id_field
    queued: set[str] = set()
    id_is_str: bool | None = None  # the type of the input's own ids, for ids made up from row numbers
    for row in rows:
        if limit is not None and row.index >= limit:
            return
        data = row.data or {}
        row_id = data.get(id_field, row.index)
        error = row.error
        openai = None
        if row.data is None:
            salvaged = salvage_custom_id(row.raw)
            row_id = row_id if salvaged is None else salvaged
        if error is None:
            try:
                openai = openai_batch_request(data)
            except RowError as exc:
                error = str(exc)
                row_id = data.get("custom_id", row_id)
        if openai is not None:
            row_id = openai["id"]
        if id_field in data or openai is not None:
            id_is_str = isinstance(row_id, str) if id_is_str is None else id_is_str
        elif id_is_str:
            row_id = str(row_id)  # keep one id type per output
        if keep_row is not None and not keep_row(row.index):
            continue  # another data-parallel group's row (the id type is still learnt from it)
        key = id_key(row_id)
        if key in skip_ids:
            continue
        verdict = RowVerdict(row.index, row_id, data, endpoint=endpoint_of(openai, data, recipe.prompt.chat))
        if key in queued:
            verdict.duplicate = True
            yield verdict
            continue
        queued.add(key)
        try:
            if error is not None:
                raise RowError(error)
            sampling = row_sampling(recipe, data, openai)
            max_new = sampling.params.max_new_tokens
            if builder.tokenizer is None:
                if openai is None:
                    builder.text(data)  # the template's columns are there
            else:
                ids = builder.token_ids(data, openai, max_new_tokens=max_new)
                extra = {c: data.get(c) for c in recipe.output.keep_columns}
                verdict.request = Request(row.index, row_id, ids, max_new, extra, meta={"endpoint": verdict.endpoint},
                                          sampling=sampling.params, own_seed=sampling.own_seed)
                problem = slot_problem(verdict.request, max_len)
                if problem:
                    raise RowError(problem)
        except RowError as exc:
            verdict.request, verdict.error = None, str(exc)
        yield verdict
