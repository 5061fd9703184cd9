"""One output from many writers: data-parallel shards beside the output, folded and merged.

With `--dp M` each group's leader writes its own shard `<output stem>.dp<g><ext>` (left in its parts,
rows keeping their input row numbers); at the end global rank 0 merges the shards into the one
output, in the order the recipe asks, and the one report (`merge_shards`, `merge_reports`), and
`--resume` first folds every shard a killed run left (with any dp) into the output
(`settle_outputs`). Nothing here starts processes or talks to other ranks.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Iterator

from engine.job.io.input import InputReader, open_input
from engine.job.io.output import id_key
from engine.job.io.paths import existing_shards, shard_path, side_path  # noqa: F401 (shard names live there)
from engine.job.options import JobOptions, check_outputs, open_output  # noqa: F401
from engine.job.report import merge_prefix_summaries, time_parts


def remove_shard(shard: Path) -> None:
    """A shard with its manifest, parts and report files."""
    from engine.job.report_render import twin_path
    from engine.job.options import default_report_path

    report = default_report_path(shard)
    for path in (shard, side_path(shard, ".manifest.json"), report, twin_path(report, ".md"),
                 twin_path(report, ".png")):
        path.unlink(missing_ok=True)
    for folder in (".parts", ".sorting"):
        shutil.rmtree(side_path(shard, folder), ignore_errors=True)


def shard_entries(options: JobOptions, recipe, shard: Path, reader: InputReader) -> Iterator[tuple[int | None, dict]]:
    """(input row number, line) of every row of a shard. Opening it for --resume first checks its
    manifest against this job and tidies what a killed writer left (a half-written last line)."""
    writer = open_output(options, recipe, shard, reader, mode="resume", finalize=False)
    try:
        yield from writer.entries()
    finally:
        writer.close()


@dataclasses.dataclass
class Settled:
    """The final output's state before the groups start (global rank 0 made it so)."""

    done_ids: frozenset[str] = frozenset()
    rows: int = 0  # rows already in the output (from earlier runs)
    failed: int = 0  # of those, error records


def settle_outputs(options: JobOptions, recipe, output: Path, dp: int, reader: InputReader | None = None) -> Settled:
    """Global rank 0, before any group starts: make the final output the one home of finished rows.

    new: refuse an existing output or shards. overwrite: remove them. resume: fold the rows of every
    shard a killed run left into the output (each id once, keeping their input row numbers) and
    remove the shards. With dp > 1 the output is opened (created) here and the groups write shards;
    with dp 1 run_job opens it itself. The output is left unmerged: the job adds to it.
    """
    check_outputs(options.mode, output)
    shards = existing_shards(output)
    if options.mode == "overwrite":
        for shard in shards:
            remove_shard(shard)
        shards = []
    if dp == 1 and not shards:
        return Settled()
    reader = reader or open_input(options.input)
    with open_output(options, recipe, output, reader, finalize=False) as writer:
        settled = Settled(rows=len(writer.done_ids), failed=writer.done_errors)
        for shard in shards:
            for index, line in shard_entries(options, recipe, shard, reader):
                if id_key(writer.lines.key_of(line)) not in writer.done_ids:  # a merge killed half-way leaves both
                    writer.write(line, index)
                    settled.rows += 1
                    settled.failed += writer.lines.is_error(line)
        settled.done_ids = frozenset(writer.done_ids)
    for shard in shards:
        remove_shard(shard)
    return settled


def merge_shards(options: JobOptions, recipe, output: Path, shards: list[Path],
                 reader: InputReader | None = None) -> list[dict]:
    """Add every shard's rows to the output (each id once), finish the output, remove the shards.

    Returns the rows dropped because another group had already written their id (the input had the
    id twice, in rows that went to different groups), as magicdec-style {"id", "error"} summaries.
    """
    dropped = []
    reader = reader or open_input(options.input)
    with open_output(options, recipe, output, reader, mode="resume", finalize=True) as writer:
        for shard in shards:
            for index, line in shard_entries(options, recipe, shard, reader):
                if id_key(writer.lines.key_of(line)) in writer.done_ids:
                    dropped.append({"id": writer.lines.key_of(line), "error": writer.lines.is_error(line)})
                else:
                    writer.write(line, index)
    for shard in shards:
        remove_shard(shard)
    return dropped


# ---------------------------------------------------------------------------------------- reports


def merge_stats(parts: list):
    """One EngineStats for the job: counts add up; seconds are the longest group's, since the groups
    ran at the same time (so tokens / seconds is the job's aggregate rate)."""
    from engine.core.stats import EngineStats

    merged = EngineStats()
    for field in dataclasses.fields(EngineStats):
        values = [getattr(stats, field.name) for stats in parts]
        if field.name == "gamma_trace":
            continue  # each group picks its own gamma: see data_parallel.groups
        if isinstance(values[0], list):
            width = max(len(v) for v in values)
            setattr(merged, field.name, [sum(v[i] for v in values if i < len(v)) for i in range(width)])
        elif isinstance(values[0], float):
            setattr(merged, field.name, max(values))
        else:
            setattr(merged, field.name, sum(values))
    return merged


def _slowest_group_time(summaries: list[dict], total: float) -> dict:
    """The groups ran at the same time, so their parts cannot add up: the time line shows the parts
    of the group that took longest, and `other` the rest of this process's total (waiting, merging)."""
    index = max(range(len(summaries)), key=lambda i: summaries[i]["time"]["total_s"])
    group = summaries[index]["time"]
    times = time_parts(total=total, startup=group["startup_s"], load=group["load_s"],
                       prefill=group["prefill_s"], decode=group["decode_s"])
    times["note"] = f"data parallel: the parts of the slowest group, dp{index}; the groups ran side by side"
    return times


def merge_reports(parts: list[tuple[dict, Any, Any]], output: Path, settled: Settled,
                  dropped: list[dict]) -> tuple[dict, int]:
    """The job's report from each group's (summary, JobReport, EngineStats); returns (report, exit code).

    Rows and latencies add up over groups; rows already in the output count as resumed; ids that
    two groups both wrote count as failed duplicates, as they would in one process. The groups' own
    summaries are kept under `data_parallel.groups`.
    """
    summaries = [summary for summary, _, _ in parts]
    reports = [report for _, report, _ in parts]
    merged = dataclasses.replace(
        reports[0], output=str(output), started=min(r.started for r in reports),
        load_s=max(r.load_s for r in reports), rows_ok=sum(r.rows_ok for r in reports),
        rows_failed=sum(r.rows_failed for r in reports), rows_resumed=settled.rows,
        resumed_failed=settled.failed, latencies=[x for r in reports for x in r.latencies],
        first_token=[x for r in reports for x in r.first_token], queue=[x for r in reports for x in r.queue],
        timeline=[], kv_cache_bytes=sum(r.kv_cache_bytes for r in reports),
        kv_touched_bytes=sum(r.kv_touched_bytes for r in reports), extra={},
        prefix_reuse=merge_prefix_summaries([r.prefix_reuse for r in reports]))
    duplicates = [d for r in reports for d in r.extra.get("duplicate_ids", [])]
    for row in dropped:
        duplicates.append(row["id"])
        if not row["error"]:
            merged.rows_ok -= 1
            merged.rows_failed += 1
    if duplicates:
        merged.extra["duplicate_ids"] = duplicates
    summary = merged.to_dict(merge_stats([stats for _, _, stats in parts]))
    summary["job"]["input_rows_total"] = summaries[0]["job"].get("input_rows_total")
    summary["memory"]["peak_bytes"] = max(s["memory"]["peak_bytes"] for s in summaries)  # per process
    summary["time"] = _slowest_group_time(summaries, summary["time"]["total_s"])
    summary["data_parallel"] = {
        "groups": [{k: v for k, v in s.items() if k != "timeline"} for s in summaries],
        "rows_per_group": [s["job"]["rows_this_run"] for s in summaries],
    }
    return summary, merged.exit_code
