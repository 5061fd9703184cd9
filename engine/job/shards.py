"""One output from many writers: data-parallel shards beside the output, folded and merged.

With `--dp M` each group's leader writes its own shard `<output stem>.dp<g><ext>`; at the end global
rank 0 merges the shards into the one output and the one report (`merge_shards`, `merge_reports`),
and `--resume` first folds every shard a killed run left (with any dp) into the output
(`settle_outputs`). Nothing here starts processes or talks to other ranks.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

from engine.errors import JobError
from engine.job.report import merge_prefix_summaries, time_parts
from engine.job.run import JobOptions, output_manifest


def check_outputs(mode: str, output: Path) -> None:
    """Without --resume/--overwrite, refuse an existing output or shards a --dp run left. Touches nothing."""
    if mode != "new":
        return
    for path in [output, _side_path(output, ".manifest.json"), _side_path(output, ".parts"), *existing_shards(output)]:
        if path.exists():
            raise JobError(f"{path} exists; use --resume to continue it or --overwrite to replace it")

def _side_path(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _split_name(output: Path) -> tuple[str, str]:
    """`run.docqa.jsonl` -> (`run.docqa`, `.jsonl`)."""
    for ext in (".jsonl", ".parquet"):
        if output.name.lower().endswith(ext):
            return output.name[: -len(ext)], output.name[-len(ext):]
    return output.name, ""


def shard_path(output: Path, group: int) -> Path:
    """Group g's output while the job runs: `out.jsonl` -> `out.dp<g>.jsonl` (same format)."""
    stem, ext = _split_name(output)
    return output.with_name(f"{stem}.dp{group}{ext}")


def existing_shards(output: Path) -> list[Path]:
    """The shards next to `output`, from a run with any dp (their number need not match this run's).

    A shard counts as there if any of its files is: its rows, its manifest, or its Parquet parts (a
    Parquet shard killed before its first part has only those two).
    """
    stem, ext = _split_name(output)
    pattern = re.compile(re.escape(stem) + r"\.dp(\d+)" + re.escape(ext) + r"(\.manifest\.json|\.parts)?$")
    found = {}
    if output.parent.is_dir():
        for path in output.parent.iterdir():
            match = pattern.match(path.name)
            if match:
                found[int(match.group(1))] = shard_path(output, int(match.group(1)))
    return [found[group] for group in sorted(found)]


def remove_shard(shard: Path) -> None:
    """A shard with its manifest, Parquet parts and report files."""
    from engine.job.report_render import twin_path
    from engine.job.run import default_report_path

    report = default_report_path(shard)
    for path in (shard, _side_path(shard, ".manifest.json"), report, twin_path(report, ".md"),
                 twin_path(report, ".png")):
        path.unlink(missing_ok=True)
    shutil.rmtree(_side_path(shard, ".parts"), ignore_errors=True)


def shard_rows(shard: Path, manifest: dict) -> Iterator[dict]:
    """The rows of a shard. Opening it for --resume first checks its manifest against this job and
    tidies what a killed writer left (a half-written JSONL line; Parquet parts are merged)."""
    from engine.job.io.input import open_input
    from engine.job.io.output import OutputWriter

    with OutputWriter(shard, mode="resume", manifest=manifest):
        pass
    for row in open_input(shard):
        if row.data is not None:
            yield row.data


@dataclasses.dataclass
class Settled:
    """The final output's state before the groups start (global rank 0 made it so)."""

    done_ids: frozenset[str] = frozenset()
    rows: int = 0  # rows already in the output (from earlier runs)
    failed: int = 0  # of those, error records


def settle_outputs(options: JobOptions, recipe, output: Path, dp: int) -> Settled:
    """Global rank 0, before any group starts: make the final output the one home of finished rows.

    new: refuse an existing output or shards. overwrite: remove them. resume: fold the rows of every
    shard a killed run left into the output (each id once) and remove the shards. With dp > 1 the
    output is opened (created) here and the groups write shards; with dp 1 run_job opens it itself.
    """
    from engine.job.io.output import OutputWriter, id_key

    check_outputs(options.mode, output)
    shards = existing_shards(output)
    if options.mode == "overwrite":
        for shard in shards:
            remove_shard(shard)
        shards = []
    if dp == 1 and not shards:
        return Settled()
    manifest = output_manifest(recipe, options.input)
    with OutputWriter(output, mode=options.mode, manifest=manifest) as writer:
        settled = Settled(rows=len(writer.done_ids), failed=writer.done_errors)
        for shard in shards:
            for row in shard_rows(shard, manifest):
                if id_key(row["id"]) not in writer.done_ids:  # a merge killed half-way leaves both copies
                    writer.write(row)
                    settled.rows += 1
                    settled.failed += row.get("finish_reason") == "error"
        settled.done_ids = frozenset(writer.done_ids)
    for shard in shards:
        remove_shard(shard)
    return settled


def merge_shards(output: Path, manifest: dict, shards: list[Path]) -> list[dict]:
    """Append every shard's rows to the output (each id once) and remove the shards.

    Returns the rows dropped because another group had already written their id (the input had the
    id twice, in rows that went to different groups).
    """
    from engine.job.io.output import OutputWriter, id_key

    dropped = []
    with OutputWriter(output, mode="resume", manifest=manifest) as writer:
        for shard in shards:
            for row in shard_rows(shard, manifest):
                if id_key(row["id"]) in writer.done_ids:
                    dropped.append(row)
                else:
                    writer.write(row)
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
        if row.get("finish_reason") != "error":
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
