"""A batch job end to end: recipe + input file -> engine -> output rows + report.

`run_job` checks everything that can be checked before any model is loaded (recipe, input file,
output path, KV-cache memory), then streams input rows through the prompt builder into the engine,
writes every finished row at once (crash-safe, resumable; in the row format and order the recipe
asks for, `engine.job.io.lines` and `engine.job.io.output`), and writes the report. Rows that are
unusable become error records and the job goes on. Progress goes to a `ProgressSink` supplied by the
caller (the CLI draws it with Rich); this module prints nothing and knows nothing about terminals.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import AbstractSet, Any, Callable, Iterator, Protocol

import torch

from engine.config.schema import Recipe
from engine.core import kernels as cpu_kernels
from engine.core.attention import ATTN_NAME, attention_paths  # importing it registers the engine's attention with transformers
from engine.core import host_memory
from engine.core.linear import linear_path
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, Result
from engine.errors import JobError, OutputError
from engine.job.io.common import one_line
from engine.job.io.input import InputReader
from engine.job.io.lines import LineFormat
from engine.job.io.output import OutputWriter
from engine.job.options import (JobOptions, default_output_path, default_report_path,  # noqa: F401
                                open_output, output_manifest, prepare)
from engine.job.memory import check_memory
from engine.job.prompts import PromptBuilder
from engine.job.report import JobReport, prefix_summary
from engine.job.report_render import write_report
from engine.job.requests import row_verdicts
from engine.job.timeline import END, LOAD, OTHER, Timeline
from engine.models.loading import load_model
from engine.spec.decoder import build_engine


class ProgressSink(Protocol):
    def start(self, total: int | None, done: int, *, estimated: bool = False) -> None:
        """total: rows this job will have done at the end (None: unknown; estimated: counted only
        partly, see InputReader.total_estimate); done: rows already in the output."""
    def update(self, report: JobReport, stats) -> None: ...
    def finish(self) -> None: ...


class NoProgress:
    def start(self, total, done, *, estimated=False):
        pass

    def update(self, report, stats):
        pass

    def finish(self):
        pass


@dataclasses.dataclass
class JobOutcome:
    report: dict[str, Any]
    report_path: Path
    output_path: Path
    exit_code: int
    # The counters behind `report`, for merging the reports of data-parallel groups (engine.parallel).
    job_report: JobReport | None = None
    stats: Any = None  # engine.stats.EngineStats


def load_engine(recipe: Recipe, parallel=None) -> Scheduler:
    """Load the target (and a separate draft), shard them under tensor parallelism, build the engine."""
    def load(spec: str):
        return load_model(spec, attn_implementation=ATTN_NAME, dtype=recipe.dtype, device=recipe.device)

    target = load(recipe.model)
    draft = load(recipe.draft.model) if recipe.draft.method != "none" and recipe.draft.model else None
    if target.device.type == "cpu" and target.dtype in (torch.float32, torch.bfloat16):
        cpu_kernels.load()  # compiled once per machine: part of loading, not of the first prefill
    if target.device.type == "cpu":
        host_memory.keep_freed_pages()  # before the first prefill: its activations are reused, not faulted in again
    if parallel is None:
        return build_engine(recipe, target, draft)
    target, draft = parallel.shard(target, draft)
    return build_engine(recipe, target, draft, sync=parallel.sync, agree=parallel.agree)


def run_job(options: JobOptions, progress: ProgressSink | None = None, *, parallel=None) -> JobOutcome:
    """Run one job. `parallel` (an engine.scale.group.Group) shards the model, takes this group's share
    of the rows and hands each request to the other tensor-parallel ranks; None = this process alone."""
    progress = progress or NoProgress()
    recipe, reader, output_path, report_path = prepare(options)
    # From here the model: its memory check reads the config (converting a GGUF once on a first run),
    # then it loads (compiling the CPU kernels once). The time line calls all of it `load`.
    t0 = time.time()
    timeline = Timeline(options.process_started or t0)
    timeline.mark(LOAD, None, 0, force=True)
    memory_needed = check_memory(recipe, tp=options.tp)

    def open_writer() -> OutputWriter:
        return open_output(options, recipe, output_path, reader)

    # An existing output is refused (or checked for --resume) before the model loads; --overwrite
    # deletes the old output only once the model has loaded, so a failed load costs nothing.
    writer = None if options.mode == "overwrite" else open_writer()
    try:
        engine = load_engine(recipe, parallel)
        target = engine.target_model
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    writer = writer or open_writer()
    loaded = time.time()
    report = JobReport(recipe=recipe.name, model=recipe.model, input=str(options.input), output=str(output_path),
                       method=recipe.draft.method, budget=recipe.draft.budget, device=str(target.device),
                       tp=options.tp, dp=parallel.dp if parallel is not None else 1, started=loaded,
                       load_s=loaded - t0, load_started=t0, process_started=options.process_started or t0,
                       timeline=timeline.points)
    timeline.mark(OTHER, engine.stats, 0, force=True)

    def on_phase(phase: str) -> None:  # between two pieces of work: the timeline, and progress when no row finishes
        if timeline.mark(phase, engine.stats, report.rows_done):
            progress.update(report, engine.stats)

    engine.on_phase = on_phase
    decoder = engine.decoder
    if decoder.draft_forward is not None:
        report.draft_gemms = decoder.draft_forward.gemm_dtype
    report.dtype = str(target.dtype).removeprefix("torch.")
    report.attention = attention_paths(target.device, engine.target.cache.k.dtype, engine.target.cache.head_dim)
    report.linear = linear_path(target.device, target.dtype, target.model)
    report.decode_forward = engine.target.decode_path()
    report.host_malloc = host_memory.current()
    report.rows_resumed = len(writer.done_ids)
    report.resumed_failed = writer.done_errors
    report.kv_cache_bytes = engine.target.cache.nbytes + decoder.cache_bytes
    report.memory_check_bytes = memory_needed
    if target.tokenizer is None:
        raise JobError(f"model {recipe.model} has no tokenizer (random weights): time it with `magicdec bench`")
    builder = PromptBuilder(recipe.prompt, target.tokenizer, max_prompt_len=engine.max_len)
    total, estimated = reader.total, False
    if total is None:
        total, estimated = reader.total_estimate, True
    if options.limit is not None:
        total = min(options.limit, total) if total is not None else options.limit
    keep_row, skip_ids = (parallel.keeps_row, parallel.skip_ids) if parallel is not None else (None, frozenset())
    if parallel is not None and total is not None:
        total = parallel.share_of(total)  # this data-parallel group's rows
    with writer:
        try:
            progress.start(total, report.rows_resumed, estimated=estimated and total is not None)
            requests = _requests(reader, recipe, builder, engine.max_len, writer, report, options.limit,
                                 keep_row, skip_ids | writer.done_ids)
            if parallel is not None:
                requests = parallel.publish(requests)  # the other tensor-parallel ranks get each one too
            for result in engine.run(requests):
                _write_result(writer, report, result)
                progress.update(report, engine.stats)
        finally:
            progress.finish()
    timeline.mark(END, engine.stats, report.rows_done, force=True)
    report.kv_touched_bytes = kv_touched_bytes(engine)
    target = engine.decoder.prefill_targets[0]
    report.prefix_reuse = prefix_summary(target.store, target.runner.cache)
    summary = report.to_dict(engine.stats)
    summary["job"]["input_rows_total"] = reader.total
    save_report(summary, report_path)
    return JobOutcome(summary, report_path, output_path, report.exit_code, job_report=report, stats=engine.stats)


def kv_touched_bytes(engine: Scheduler) -> int:
    """How much of the KV allocation rows used: the target's and a separate draft's caches up to each
    slot's most committed positions, plus a compact draft store (counted whole: every slot refreshes it)."""
    decoder = engine.decoder
    total = engine.target.cache.touched_bytes
    if getattr(decoder, "separate_draft", False):
        total += decoder.draft.cache.touched_bytes
    compressor = getattr(decoder, "compressor", None)
    if compressor is not None and compressor.compact is not None:
        total += compressor.compact.nbytes
    return total


def _requests(reader: InputReader, recipe: Recipe, builder: PromptBuilder, max_len: int, writer: OutputWriter,
              report: JobReport, limit: int | None, keep_row: Callable[[int], bool] | None,
              skip_ids: AbstractSet[str]) -> Iterator[Request]:
    """Input rows -> engine requests (`engine.job.requests`); unusable rows are written as error
    records on the way, and duplicate ids are counted as failed and named in `duplicate_ids`."""
    for verdict in row_verdicts(reader, recipe, builder, max_len, limit=limit, keep_row=keep_row,
                                skip_ids=skip_ids):
        if verdict.duplicate:
            report.rows_failed += 1
            report.extra.setdefault("duplicate_ids", []).append(verdict.id)
        elif verdict.error is not None:
            _write_error(writer, report, verdict, recipe)
        else:
            verdict.request.enqueued_at = time.perf_counter()  # read now: queueing starts
            yield verdict.request


def save_report(summary: dict, path: Path) -> None:
    """Write the report files; a failed write (disk full) is an OutputError, like a failed row write."""
    try:
        write_report(summary, path)
    except OSError as exc:
        raise OutputError(f"{path}: writing the report failed ({one_line(exc)}); every row is in the "
                          "output: fix the cause and rerun with --resume to write the report") from None


def _write_error(writer: OutputWriter, report: JobReport, verdict, recipe: Recipe) -> None:
    row = {"id": verdict.id, "text": None, "finish_reason": "error", "prompt_tokens": 0, "output_tokens": 0,
           "error": verdict.error}
    lines: LineFormat = writer.lines
    if lines.name == "magicdec":
        row.update({c: verdict.data.get(c) for c in recipe.output.keep_columns})
    writer.write(lines.encode(row, verdict.endpoint), verdict.index)
    report.rows_failed += 1


def _write_result(writer: OutputWriter, report: JobReport, result: Result) -> None:
    request = result.request
    row = {"id": request.id, "text": result.text, "finish_reason": result.finish_reason,
           "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens, "error": result.error}
    if writer.lines.name == "magicdec":
        row.update(request.extra)
    writer.write(writer.lines.encode(row, request.meta.get("endpoint")), request.index)
    if result.finish_reason == "error":
        report.rows_failed += 1
    else:
        report.rows_ok += 1
        report.latencies.append(result.latency_s)
        report.first_token.append(result.first_token_s)
        report.queue.append(result.queue_s)
