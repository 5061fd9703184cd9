"""What a job is before any model: its options, the checks that need no engine, its output's identity.

`prepare` checks the recipe, the input and the output path (one `JobError` line each); `row_format`
decides the output's row format (magicdec's own rows or the OpenAI batch output format);
`output_manifest` is what an output depends on (what `--resume` compares); `open_output` opens the
job's output writer; `check_outputs` refuses an output left by an earlier run; `claim_output` takes
the output's lock. This module imports no
torch and no model code, so these checks (and a second run's refusal) take well under a second.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.config.loading import load_recipe
from engine.config.schema import Recipe
from engine.errors import JobError
from engine.job.io.input import InputReader, open_input
from engine.job.io.lines import line_format
from engine.job.io.lock import OutputLock
from engine.job.io.output import OutputWriter
from engine.job.io.openai_batch import looks_like_openai_batch
from engine.job.io.paths import existing_shards, side_path


@dataclasses.dataclass
class JobOptions:
    recipe: str
    input: str
    output: str | None = None
    report: str | None = None
    overrides: tuple[str, ...] = ()
    mode: str = "new"  # new | resume | overwrite
    limit: int | None = None
    tp: int = 1
    finalize: bool = True  # False: a data-parallel shard, left staged for rank 0 to merge (input order)
    process_started: float | None = None  # time.time() at process start (the CLI's); None: when run_job began


def default_output_path(input_path: Path, recipe: Recipe) -> Path:
    """`<input stem>.<recipe name>.jsonl` next to the input (docs.jsonl.gz -> docs.docqa.jsonl)."""
    name = input_path.name
    for suffix in (".jsonl.gz", ".jsonl", ".parquet"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return input_path.with_name(f"{name}.{recipe.name}.jsonl")


def default_report_path(output: Path) -> Path:
    return Path(str(output) + ".report.json")


def prepare(options: JobOptions) -> tuple[Recipe, InputReader, Path, Path]:
    """Everything checked before loading a model; raises JobError (exit 2) with one line."""
    recipe = load_recipe(options.recipe, options.overrides)
    reader = open_input(options.input)
    output = Path(options.output) if options.output else default_output_path(Path(options.input), recipe)
    report = Path(options.report) if options.report else default_report_path(output)
    if output.resolve() == Path(options.input).resolve():
        raise JobError(f"{output}: the output would overwrite the input")
    first = next(iter(reader), None) if reader.total != 0 else None
    if first is None:
        raise JobError(f"{options.input}: the input has no rows")
    row_format(recipe, output, reader=reader)  # refuses a row format the file cannot hold
    return recipe, reader, output, report


def row_format(recipe: Recipe, output: Path, *, reader: InputReader | None = None) -> str:
    """"magicdec" or "openai": `output.format`, where auto means openai for an OpenAI batch input
    (its first readable row has `custom_id` and `body`) written to JSONL. The OpenAI batch output
    format is JSONL by definition, so asking for it with a Parquet output is refused."""
    wanted = recipe.output.format
    parquet = output.name.lower().endswith(".parquet")
    if wanted == "openai" and parquet:
        raise JobError(f"{output}: output.format openai is the OpenAI batch format, which is JSONL; "
                       "write a .jsonl output or set output.format=magicdec")
    if wanted != "auto":
        return wanted
    if parquet:
        return "magicdec"
    first_row = next((row.data for row in reader if row.data is not None), None) if reader is not None else None
    return "openai" if looks_like_openai_batch(first_row) else "magicdec"


def output_manifest(recipe: Recipe, input_path: str, rows: str) -> dict[str, Any]:
    """What an output depends on: resuming is refused if these differ (batch size, gamma, the draft
    method and the like only change the speed, so they may change between runs). `rows` is the
    resolved row format (`row_format`), so `auto` and the format it chose compare equal."""
    full = recipe.to_dict()
    affects = {k: full[k] for k in ("model", "dtype", "sampling", "prompt", "input", "output")}
    affects["output"] = {**affects["output"], "format": rows}
    return {"recipe": affects, "model": recipe.model, "recipe_name": recipe.name,
            "input": str(Path(input_path).resolve()), "full_recipe": full}


# An output written before output.format / output.order existed: magicdec rows in finishing order.
LEGACY_MANIFEST = {"recipe": {"output": {"format": "magicdec", "order": "finish"}}}


def check_outputs(mode: str, output: Path) -> None:
    """Without --resume/--overwrite, refuse an existing output or shards a --dp run left. Touches nothing."""
    if mode != "new":
        return
    for path in [output, side_path(output, ".manifest.json"), side_path(output, ".parts"),
                 *existing_shards(output)]:
        if path.exists():
            raise JobError(f"{path} exists; use --resume to continue it or --overwrite to replace it")


def open_output(options: JobOptions, recipe: Recipe, output: Path, reader: InputReader, *,
                mode: str | None = None, finalize: bool | None = None) -> OutputWriter:
    """The job's output writer: the row format and order the recipe asks for, its manifest."""
    rows = row_format(recipe, output, reader=reader)
    return OutputWriter(output, mode=mode or options.mode, manifest=output_manifest(recipe, options.input, rows),
                        lines=line_format(rows, recipe.model), order=recipe.output.order,
                        finalize=options.finalize if finalize is None else finalize,
                        legacy_manifest=LEGACY_MANIFEST)


def claim_output(output: Path) -> OutputLock:
    """Take the output's lock (`<output>.lock`) for the whole job, or raise JobError naming the
    process that holds it. Release it with `.release()` or use it as a context manager."""
    return OutputLock.acquire(output)
