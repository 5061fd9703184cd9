"""`magicdec validate`: check a recipe and every input row without running a model.

Reads the input as a stream (memory stays flat however many rows), and gives each row the verdict
`magicdec run` would (`engine.job.requests`, the same code: malformed lines, bad OpenAI batch
requests, bad per-row sampling values, missing template fields, prompts that cannot fit a slot,
duplicate ids), tokenising with the real tokenizer. Only the tokenizer is loaded.
"""

from __future__ import annotations

from engine.config.loading import load_recipe
from engine.config.schema import slot_capacity
from engine.job.io.input import open_input
from engine.job.prompts import PromptBuilder
from engine.job.requests import row_verdicts
from engine.models.loading import load_tokenizer, model_shapes

MAX_LISTED = 20


def validate_job(recipe_arg: str, input_path: str, overrides: tuple[str, ...] = (), *,
                 limit: int | None = None) -> dict:
    recipe = load_recipe(recipe_arg, overrides)
    reader = open_input(input_path)
    max_len, _ = slot_capacity(recipe, model_shapes(recipe.model)["max_context"])
    builder = PromptBuilder(recipe.prompt, load_tokenizer(recipe.model), max_prompt_len=max_len)
    rows = bad = longest = prompt_tokens = duplicates = 0
    problems: list[dict] = []
    for verdict in row_verdicts(reader, recipe, builder, max_len, limit=limit):
        rows += 1
        error = verdict.error
        if verdict.duplicate:
            duplicates += 1
            error = f"duplicate id {verdict.id!r}"
        if error is not None:
            bad += 1
            if len(problems) < MAX_LISTED:
                problems.append({"row": verdict.index, "id": verdict.id, "error": error})
        elif verdict.request is not None:
            n = len(verdict.request.prompt_ids)
            longest = max(longest, n)
            prompt_tokens += n
    return {"recipe": recipe.name, "model": recipe.model, "rows": rows, "rows_ok": rows - bad, "rows_bad": bad,
            "duplicate_ids": duplicates, "prompt_tokens": prompt_tokens, "longest_prompt": longest,
            "batch.max_len": max_len, "problems": problems}
