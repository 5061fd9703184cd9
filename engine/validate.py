"""`magicdec validate`: check a recipe and every input row without running a model.

Reads the input as a stream (memory stays flat however many rows), builds each row's prompt with the
real tokenizer, and reports the rows that `run` would turn into error records (malformed lines,
missing template fields, prompts that cannot fit a slot). Only the tokenizer is loaded.
"""

from __future__ import annotations

from engine.config import load_recipe
from engine.engine import slot_capacity
from engine.errors import RowError
from engine.io import id_key, open_input, openai_batch_request
from engine.models import load_tokenizer, model_shapes
from engine.prompts import PromptBuilder

MAX_LISTED = 20


def validate_job(recipe_arg: str, input_path: str, overrides: tuple[str, ...] = (), *,
                 limit: int | None = None) -> dict:
    recipe = load_recipe(recipe_arg, overrides)
    reader = open_input(input_path)
    shapes = model_shapes(recipe.model)
    max_len, _ = slot_capacity(recipe, shapes["max_context"])
    tokenizer = load_tokenizer(recipe.model)
    builder = PromptBuilder(recipe.prompt, tokenizer, max_prompt_len=max_len)
    rows = bad = longest = 0
    prompt_tokens = 0
    seen: set[str] = set()
    duplicates = 0
    problems: list[dict] = []
    for row in reader:
        if limit is not None and row.index >= limit:
            break
        rows += 1
        data = row.data or {}
        row_id = data.get(recipe.input.id_field, row.index)
        try:
            if row.error is not None:
                raise RowError(row.error)
            openai = openai_batch_request(data)
            max_new = recipe.sampling.max_new_tokens
            if openai is not None:
                row_id = openai["id"]
                max_new = openai["overrides"].get("max_new_tokens", max_new)
            key = id_key(row_id)
            if key in seen:
                duplicates += 1
                raise RowError(f"duplicate id {row_id!r}")
            seen.add(key)
            if tokenizer is not None:
                n = len(builder.token_ids(data, openai, max_new_tokens=max_new))
                if n + max_new > max_len:
                    raise RowError(f"prompt has {n} tokens; with max_new_tokens {max_new} it needs "
                                   f"{n + max_new} > batch.max_len {max_len}")
                longest = max(longest, n)
                prompt_tokens += n
            elif openai is None:
                builder.text(data)  # no tokenizer (random-shape model): check the template fields
        except RowError as exc:
            bad += 1
            if len(problems) < MAX_LISTED:
                problems.append({"row": row.index, "id": row_id, "error": str(exc)})
    return {"recipe": recipe.name, "model": recipe.model, "rows": rows, "rows_ok": rows - bad, "rows_bad": bad,
            "duplicate_ids": duplicates, "prompt_tokens": prompt_tokens, "longest_prompt": longest,
            "batch.max_len": max_len, "problems": problems}
