"""Running a job on many processes: DeepSpeed tensor parallel inside a group, data parallel across groups.

Every process of a job calls `run` (under an external launcher, or as a worker `engine.scale.launch`
started). Global rank 0 first makes the output the one home of finished rows (`settle_outputs`);
each group's leader runs the job on its rows (`index % dp == group`) and hands every request to the
other ranks of its group, which run the same engine loop in lockstep and write nothing; at the end
rank 0 merges the groups' shards and reports. Not here: the model code, scheduling, file formats,
printing (the CLI's console knows its rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from engine.errors import JobError
from engine.job.options import claim_output
from engine.job.run import JobOptions, JobOutcome, load_engine, prepare, run_job, save_report
from engine.job.shards import Settled, existing_shards, merge_reports, merge_shards, settle_outputs, shard_path
from engine.scale.group import Group
from engine.scale.launch import LAUNCHER_PID_ENV, WorkersFailed, die_with_launcher
from engine.scale.topology import Topology, check_tensor_parallel, local_processes, topology, world_size


def run(options: JobOptions, progress, *, tp: int = 1, dp: int | None = None) -> JobOutcome | None:
    """Run this process's part of the job; the outcome on global rank 0, None on every other rank.

    The output's lock is the job's: a single process (or the launcher that started this one) takes
    it before calling here (`claim_output`); under an external launcher global rank 0 takes it."""
    if tp * (dp or 1) == 1 and world_size() == 1:
        recipe, reader, output, _ = prepare(options)
        settle_outputs(options, recipe, output, dp=1, reader=reader)  # folds the shards of a killed --dp run
        return run_job(options, progress)
    topo = topology(tp, dp)
    die_with_launcher()
    with _errors_from_rank0(topo):
        recipe, _, output, report_path = prepare(options)
        check_tensor_parallel(recipe, topo.tp, topo.dp, local_processes(topo.world))
    from engine.models.loading import resolve_device

    device = resolve_device(recipe.device)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0") or 0))
    group = Group(topo, device)
    try:
        with _lost_rank_is_one_line(topo):
            return _run_ranks(options, progress, group, recipe, output, report_path)
    finally:
        group.close()


def _run_ranks(options: JobOptions, progress, group: Group, recipe, output: Path,
               report_path: Path) -> JobOutcome | None:
    """Every rank, once the process groups exist: rank 0 settles the outputs, the groups run, rank 0 merges."""
    topo = group.topo
    lock = None

    def settle() -> Settled:
        nonlocal lock
        if not os.environ.get(LAUNCHER_PID_ENV):  # our own launcher holds the lock for the whole job
            lock = claim_output(output)
        return settle_outputs(options, recipe, output, topo.dp)

    try:
        settled = group.announce(settle)
        if topo.dp == 1:
            return _run_in_group(options, progress, group)
        group.skip_ids = settled.done_ids
        mine = dataclasses.replace(options, output=str(shard_path(output, topo.group)), report=None, mode="new",
                                   finalize=False)
        outcome = _run_in_group(mine, progress, group)
        part = (outcome.report, outcome.job_report, outcome.stats) if outcome is not None else None
        parts = group.gather(part)  # waits for every group to finish
        if topo.rank != 0:
            return None
        return _finish(options, recipe, output, report_path, settled, [p for p in parts if p is not None])
    finally:
        if lock is not None:
            lock.release()


def _run_in_group(options: JobOptions, progress, group: Group) -> JobOutcome | None:
    """The leader runs the job on its rows; the other ranks follow it. The leader's outcome, else None."""
    if group.topo.is_leader:
        return run_job(options, progress, parallel=group)
    from engine.config.loading import load_recipe

    engine = load_engine(load_recipe(options.recipe, options.overrides), group)
    for _ in engine.run(group.receive()):  # the leader's loop, in step with it; the results are the leader's
        pass
    return None


def _finish(options: JobOptions, recipe, output: Path, report_path: Path, settled: Settled,
            parts: list) -> JobOutcome:
    """Global rank 0, once every group is done: one output, one report, no shards."""
    dropped = merge_shards(options, recipe, output, existing_shards(output))
    summary, exit_code = merge_reports(parts, output, settled, dropped)
    save_report(summary, report_path)
    return JobOutcome(summary, report_path, output, exit_code)


@contextlib.contextmanager
def _errors_from_rank0(topo: Topology):
    """Checks every rank makes alike: rank 0 reports a failure, the others exit quietly (no N copies)."""
    try:
        yield
    except JobError:
        if topo.rank == 0:
            raise
        raise SystemExit(2) from None


@contextlib.contextmanager
def _lost_rank_is_one_line(topo: Topology):
    """A collective that fails because another rank died (gloo: its connection closes) ends this rank
    with one line from each group leader and exit 3, instead of a traceback per rank."""
    import torch.distributed as dist

    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if not (isinstance(exc, dist.DistError) or "closed by peer" in text or "reset by peer" in text):
            raise
        detail = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        message = (f"rank {topo.rank}: another rank of the job stopped ({detail[:160]}); finished rows are kept: "
                   "rerun with --resume to continue") if topo.is_leader else None
        raise WorkersFailed(message, 3) from None
