"""Running a job on many processes: DeepSpeed tensor parallel inside a group, data parallel across groups.

Layout: `tp * dp` ranks. Ranks `[g * tp, (g + 1) * tp)` form data-parallel group g and share one copy
of the model through DeepSpeed AutoTP (`deepspeed.init_inference(..., replace_with_kernel_inject=False)`
splits q/k/v/gate/up by heads and columns and all-reduces after o_proj, down_proj and lm_head; the
engine reads its local head counts from the weight shapes, so KV cache, attention and compressors
work on each rank's own heads). The first rank of a group, its *leader*, reads the input, keeps the
rows with `index % dp == g`, writes them, and hands every request to the other ranks of its group,
which run the same engine loop in lockstep and write nothing; all ranks take the leader's tokens and
gamma (`Group.sync`, `Group.agree`). With `dp > 1` each leader writes its own shard
`<output stem>.dp<g><ext>`; at the end global rank 0 merges the shards into the one output and the
one report. `--resume` first folds every shard a killed run left (with any dp) into the output.

Starting: without a launcher, `magicdec run --tp N --dp M` starts the `N * M` workers itself
(`launch`: the same argv with the environment torchrun and DeepSpeed's launcher set, and a supervisor
that stops them all when one fails). Under an external launcher (`deepspeed`, `torchrun`: WORLD_SIZE
is set) every process calls `run` directly.

Not here: the model code (transformers + engine.attention), scheduling (engine.engine), file formats
(engine.io), printing (magicdec_cli). No process prints: the CLI's console knows its rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from engine.errors import JobError
from engine.job import JobOptions, JobOutcome, load_engine, output_manifest, prepare, run_job

CONTROL_TIMEOUT = datetime.timedelta(days=7)  # job-level waits: one group may finish hours before another
STOP_GRACE_S = 5.0  # after a failure or a signal, how long the workers get before SIGKILL
DIE_AFTER_ROWS_ENV = "MAGICDEC_TEST_DIE_AFTER_ROWS"  # tests: a non-zero rank os._exit(9)s after N rows
LAUNCHER_PID_ENV = "MAGICDEC_LAUNCHER_PID"


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


# ---------------------------------------------------------------------------------------- topology


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits: global rank, and the tp x dp grid (groups of consecutive ranks)."""

    rank: int
    tp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def group(self) -> int:
        return self.rank // self.tp

    @property
    def leader(self) -> int:
        """Global rank of this group's leader (tensor-parallel rank 0)."""
        return self.group * self.tp

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))


def topology(tp: int, dp: int | None) -> Topology:
    """This process's Topology from RANK / WORLD_SIZE; dp None = world size / tp (external launcher)."""
    world = world_size()
    if dp is None:
        if world % tp:
            raise JobError(f"--tp {tp} does not divide the {world} processes the launcher started (WORLD_SIZE)")
        dp = world // tp
    if tp * dp != world:
        raise JobError(f"--tp {tp} x --dp {dp} = {tp * dp} processes, but the launcher started {world} "
                       "(WORLD_SIZE); make them equal")
    return Topology(rank=int(os.environ.get("RANK", "0") or 0), tp=tp, dp=dp)


def local_processes(default: int) -> int:
    """Processes of this job on this machine (the launchers' LOCAL_SIZE / LOCAL_WORLD_SIZE)."""
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return default


# ---------------------------------------------------------------------------------------- checks


def check_tensor_parallel(recipe, tp: int, dp: int, local: int) -> None:
    """One JobError line, before any weights load, if the tp x dp layout cannot work.

    Every rank must hold at least one whole KV head of every model (AutoTP splits by KV heads, also
    unevenly: 3 KV heads on 2 ranks become 2 + 1), and on CUDA each local process needs its own device.
    """
    from engine.models import model_shapes, resolve_device

    models = [("model", recipe.model)]
    if recipe.draft.method != "none" and recipe.draft.model:
        models.append(("draft.model", recipe.draft.model))
    if tp > 1:
        for key, spec in models:
            kv_heads = model_shapes(spec)["kv_heads"]
            if tp > kv_heads:
                raise JobError(f"--tp {tp}: {key} {spec} has {kv_heads} KV heads and tensor parallelism gives "
                               f"every process whole KV heads; use --tp {kv_heads} or less")
    if resolve_device(recipe.device).type == "cuda":
        import torch

        count = torch.cuda.device_count()
        if local > count:
            raise JobError(f"--tp {tp} --dp {dp} puts {local} processes on this machine, one per CUDA device, "
                           f"but it has {count}")


def check_outputs(mode: str, output: Path) -> None:
    """Without --resume/--overwrite, refuse an existing output or shards a --dp run left. Touches nothing."""
    if mode != "new":
        return
    for path in [output, _side_path(output, ".manifest.json"), _side_path(output, ".parts"), *existing_shards(output)]:
        if path.exists():
            raise JobError(f"{path} exists; use --resume to continue it or --overwrite to replace it")


# ---------------------------------------------------------------------------------------- launching


class WorkersFailed(Exception):
    """The launched workers stopped early; `exit_code` is what magicdec exits with."""

    def __init__(self, message: str | None, exit_code: int):
        super().__init__(message or "")
        self.message = message
        self.exit_code = exit_code


def needs_launch(tp: int, dp: int | None) -> bool:
    """True when more than one process is wanted and none was started by a launcher."""
    return tp * (dp or 1) > 1 and "WORLD_SIZE" not in os.environ


def launch(argv: list[str], *, tp: int, dp: int | None, options: JobOptions) -> int:
    """Start tp x dp workers running `magicdec <argv>` on this machine; return the job's exit code.

    Everything checkable is checked here first, so a bad job is one line and nothing starts.
    Raises WorkersFailed when a worker fails (the others are stopped) or on SIGINT / SIGTERM.
    """
    dp = dp or 1
    world = tp * dp
    recipe, _, output, _ = prepare(options)
    check_tensor_parallel(recipe, tp, dp, world)
    check_outputs(options.mode, output)
    port = _free_port()
    threads = max(1, _cpu_count() // world)
    command = [sys.executable, "-m", "magicdec_cli.main", *argv]
    procs = []
    for rank in range(world):
        env = worker_env(rank, world, port, threads)
        # Own session: a terminal's Ctrl-C reaches only this supervisor, which forwards it once.
        # Only rank 0 may write stdout (--json); the others' stray output goes to stderr.
        procs.append(subprocess.Popen(command, env=env, start_new_session=True,
                                      stdout=None if rank == 0 else _stderr_fd()))
    return supervise(procs)


def worker_env(rank: int, world: int, port: int, threads: int) -> dict[str, str]:
    """What torchrun / DeepSpeed's launcher would set for a single-machine job, plus our thread count."""
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), CROSS_RANK="0", CROSS_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    env.setdefault("MAGICDEC_THREADS", str(threads))  # so world x threads does not oversubscribe the cores
    env.setdefault("OMP_NUM_THREADS", env["MAGICDEC_THREADS"])
    return env


def supervise(procs: list[subprocess.Popen], *, poll_s: float = 0.1) -> int:
    """Wait for the workers. All end with 0 or 1: return the largest. One ends otherwise (crash,
    kill, exit 2/3): stop the rest at once and raise WorkersFailed. SIGINT / SIGTERM are forwarded."""
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            if received:
                rank0_done = stop_workers(procs, polite=True)
                code = 128 + received[0]
                # Rank 0 says "interrupted; rerun with --resume" itself when it could stop cleanly.
                raise WorkersFailed(None if rank0_done else "interrupted; rerun with --resume to continue", code)
            codes = [p.poll() for p in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code is not None and code not in (0, 1)]
            if failed:
                rank, code = failed[0]
                stop_workers(procs, polite=True)
                if code == 2:  # a JobError: the rank that hit it has said why in one line
                    raise WorkersFailed(None, 2)
                raise WorkersFailed(f"rank {rank} {_describe_exit(code)}; stopped the other ranks. Finished rows "
                                    "are kept: rerun with --resume to continue", code if code > 0 else 128 - code)
            if all(code is not None for code in codes):
                return max(codes)
            time.sleep(poll_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_workers(procs, polite=False)


def stop_workers(procs: list[subprocess.Popen], *, polite: bool) -> bool:
    """Stop every live worker: rank 0 gets SIGINT (it flushes its output and says so), the others
    SIGTERM, which `magicdec run` handles like SIGINT (each group's writer flushes its shard);
    whatever is left after STOP_GRACE_S is SIGKILLed. polite=False: SIGKILL at once.
    Returns True if rank 0 ended by itself (with a code of its own)."""
    live = [p for p in procs if p.poll() is None]
    for rank, proc in enumerate(procs):
        if proc in live:
            proc.send_signal(signal.SIGKILL if not polite else signal.SIGINT if rank == 0 else signal.SIGTERM)
    deadline = time.time() + (STOP_GRACE_S if polite else 0)
    while time.time() < deadline and any(p.poll() is None for p in live):
        time.sleep(0.05)
    rank0_done = procs[0].poll() is not None and procs[0].returncode > 0
    for proc in live:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rank0_done


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stream without a file
        return None


def _die_with_launcher() -> None:
    """A worker of `launch` dies with it (Linux), so a killed supervisor leaves no orphans behind."""
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(pid):  # it died before prctl took effect
        os._exit(1)


# ---------------------------------------------------------------------------------------- the group


class _ParallelUnit:
    """The `mpu` DeepSpeed's InferenceEngine asks for its tensor-parallel group.

    Passing it is how AutoTP shards within *our* group: without it init_inference builds a group of
    global ranks [0, tp), which is wrong for every data-parallel group but the first.
    """

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self.group.topo.tp

    def get_model_parallel_rank(self) -> int:
        return self.group.topo.rank - self.group.topo.leader

    def get_data_parallel_world_size(self) -> int:
        return self.group.topo.dp

    def get_data_parallel_rank(self) -> int:
        return self.group.topo.group


class Group:
    """This process's data-parallel group, and every collective the job needs.

    Given to `engine.job.run_job` (and the Engine) as `parallel`: `shard` the models, `sync` / `agree`
    on the leader's tokens and gamma, `keeps_row` / `share_of` / `skip_ids` pick this group's rows,
    `publish` (leader) and `receive` (the others) move requests through the group.
    """

    def __init__(self, topo: Topology, device):
        import torch.distributed as dist

        self.topo = topo
        self.tp, self.dp = topo.tp, topo.dp
        self.device = device
        self.skip_ids: frozenset[str] = frozenset()
        self.dist = dist
        backend = "nccl" if device.type == "cuda" else "gloo"
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")  # no guessing
        if topo.tp > 1:
            with _deepspeed() as deepspeed:
                deepspeed.init_distributed(dist_backend=backend)
        else:
            dist.init_process_group(backend)
        # new_group is collective over the whole world: every rank creates every group, same order.
        # The control group (gloo, long timeout) carries the job-level messages: the outputs' state
        # at the start, the shards' reports at the end.
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.tp_group = None
        if topo.tp > 1:
            for group in range(topo.dp):
                created = dist.new_group(topo.ranks_of(group))
                if group == topo.group:
                    self.tp_group = created
            _keep_all_reduce_in_group(topo)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    # -- tensor parallel ----------------------------------------------------------------------------

    def shard(self, target, draft):
        """Split each model over the group's ranks (AutoTP); a separate draft is sharded the same way."""
        if self.tp_group is None:
            return target, draft
        return self._shard(target), (self._shard(draft) if draft is not None else None)

    def _shard(self, loaded):
        from engine.runner import attention_shapes

        config = {"tp_size": self.tp, "tp_group": self.tp_group, "mpu": _ParallelUnit(self)}
        with _deepspeed() as deepspeed:
            engine = deepspeed.init_inference(loaded.model, tensor_parallel=config, dtype=loaded.dtype,
                                              replace_with_kernel_inject=False)
        model = engine.module  # the same transformers model, its linear layers replaced in place
        _, heads, kv_heads, _ = attention_shapes(model)
        assert kv_heads >= 1 and heads % kv_heads == 0, \
            f"rank {self.topo.rank}: AutoTP left {heads} query heads for {kv_heads} KV heads"
        return dataclasses.replace(loaded, model=model)

    def sync(self, tensor):
        """Every rank of the group gets the leader's tensor (tokens, accepted lengths)."""
        if self.tp_group is None:
            return tensor
        tensor = tensor.contiguous()
        self.dist.broadcast(tensor, src=self.topo.leader, group=self.tp_group)  # collective: whole group
        return tensor

    def agree(self, value: int) -> int:
        """Every rank of the group gets the leader's int (the gamma it picked from its own timings)."""
        if self.tp_group is None:
            return value
        import torch

        box = torch.tensor([value], dtype=torch.long, device=self.device)
        self.dist.broadcast(box, src=self.topo.leader, group=self.tp_group)  # collective: whole group
        return int(box.item())

    # -- rows and requests ----------------------------------------------------------------------------

    def keeps_row(self, index: int) -> bool:
        return index % self.dp == self.topo.group

    def share_of(self, total: int) -> int:
        """How many of rows 0..total-1 are this group's."""
        return len(range(self.topo.group, total, self.dp))

    def publish(self, requests: Iterable) -> Iterator:
        """Leader: yield each request after handing it to the group's other ranks; then the end mark.

        The engine pulls requests at points that depend only on the requests and the (synced) tokens,
        so every rank pulls in step and each pull here meets one `receive` pull there.
        """
        if self.tp_group is None:
            yield from requests
            return
        for request in requests:
            self._broadcast_request(request)
            yield request
        self._broadcast_request(None)

    def receive(self) -> Iterator:
        """Non-leader: the leader's requests, one per pull, until its end mark."""
        while (request := self._broadcast_request(None)) is not None:
            yield request

    def _broadcast_request(self, request):
        box = [request]
        self.dist.broadcast_object_list(box, src=self.topo.leader, group=self.tp_group)  # collective: group
        return box[0]

    # -- job-level messages ---------------------------------------------------------------------------

    def announce(self, work):
        """Rank 0 runs `work()`; every rank returns its result. If it raised JobError, rank 0 re-raises
        it (one line) and the other ranks exit quietly with the same code."""
        box: list[Any] = [None]
        if self.topo.rank == 0:
            try:
                box = [("ok", work())]
            except JobError as exc:
                box = [("error", exc)]
        self.dist.broadcast_object_list(box, src=0, group=self.control)  # collective: every rank
        status, value = box[0]
        if status == "error":
            if self.topo.rank == 0:
                raise value
            raise SystemExit(2)  # rank 0 reports it
        return value

    def gather(self, value) -> list | None:
        """Every rank's `value`, in rank order, on rank 0 (None elsewhere). Waits for every group."""
        out = [None] * self.topo.world if self.topo.rank == 0 else None
        self.dist.gather_object(value, out, dst=0, group=self.control)  # collective: every rank
        return out


def _keep_all_reduce_in_group(topo: Topology) -> None:
    """DeepSpeed's CPU shared-memory all-reduce (used by the sharded layers when it is built) sums over
    every rank of the world whatever group it is given, and is only set up when all ranks share one
    machine (LOCAL_SIZE == WORLD_SIZE; otherwise it crashes). Keep it only when the tensor-parallel group
    is that whole world; else DeepSpeed falls back to torch.distributed.all_reduce on the group."""
    backend = importlib.import_module("deepspeed.comm.comm").cdb
    whole_machine = topo.tp == topo.world == local_processes(0)
    if getattr(backend, "shm_comm_op", None) is not None and not whole_machine:
        backend.shm_vector_kernel_level = 0  # DeepSpeed reads this before choosing the shm kernel


@contextlib.contextmanager
def _deepspeed():
    """DeepSpeed, imported and called with its prints and INFO logs kept off stdout (--json owns it).

    Its logger writes to the stdout of import time, so it is imported under the redirect; LOCAL_SIZE
    comes from torchrun's LOCAL_WORLD_SIZE when only that is set (DeepSpeed's CPU ops read it).
    """
    if os.environ.get("LOCAL_WORLD_SIZE") and not os.environ.get("LOCAL_SIZE"):
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    debug = os.environ.get("MAGICDEC_DEBUG") == "1"
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed
        from deepspeed.utils import logger

        if not debug:
            logger.setLevel(logging.WARNING)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stderr if debug else devnull):
        yield deepspeed


# ---------------------------------------------------------------------------------------- shards


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
    from engine.job import default_report_path
    from engine.report import twin_path

    report = default_report_path(shard)
    for path in (shard, _side_path(shard, ".manifest.json"), report, twin_path(report, ".md"),
                 twin_path(report, ".png")):
        path.unlink(missing_ok=True)
    shutil.rmtree(_side_path(shard, ".parts"), ignore_errors=True)


def shard_rows(shard: Path, manifest: dict) -> Iterator[dict]:
    """The rows of a shard. Opening it for --resume first checks its manifest against this job and
    tidies what a killed writer left (a half-written JSONL line; Parquet parts are merged)."""
    from engine.io import OutputWriter, open_input

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
    from engine.io import OutputWriter, id_key

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
    from engine.io import OutputWriter, id_key

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
    from engine.stats import EngineStats

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
        first_token=[x for r in reports for x in r.first_token], timeline=[],
        kv_cache_bytes=sum(r.kv_cache_bytes for r in reports), extra={})
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
    summary["data_parallel"] = {
        "groups": [{k: v for k, v in s.items() if k != "timeline"} for s in summaries],
        "rows_per_group": [s["job"]["rows_this_run"] for s in summaries],
    }
    return summary, merged.exit_code


# ---------------------------------------------------------------------------------------- running


def run(options: JobOptions, progress, *, tp: int = 1, dp: int | None = None) -> JobOutcome | None:
    """Run this process's part of the job; the outcome on global rank 0, None on every other rank."""
    if tp * (dp or 1) == 1 and world_size() == 1:
        recipe, _, output, _ = prepare(options)
        settle_outputs(options, recipe, output, dp=1)  # folds the shards of a killed --dp run
        return run_job(options, progress)
    topo = topology(tp, dp)
    _die_with_launcher()
    with _errors_from_rank0(topo):
        recipe, _, output, report_path = prepare(options)
        check_tensor_parallel(recipe, topo.tp, topo.dp, local_processes(topo.world))
    from engine.models import resolve_device

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
    settled = group.announce(lambda: settle_outputs(options, recipe, output, topo.dp))
    if topo.dp == 1:
        return _run_in_group(options, progress, group)
    group.skip_ids = settled.done_ids
    mine = dataclasses.replace(options, output=str(shard_path(output, topo.group)), report=None, mode="new")
    outcome = _run_in_group(mine, progress, group)
    part = (outcome.report, outcome.job_report, outcome.stats) if outcome is not None else None
    parts = group.gather(part)  # waits for every group to finish
    if topo.rank != 0:
        return None
    return _finish(options, recipe, output, report_path, settled, [p for p in parts if p is not None])


def _run_in_group(options: JobOptions, progress, group: Group) -> JobOutcome | None:
    """The leader runs the job on its rows; the other ranks follow it. The leader's outcome, else None."""
    die_after = int(os.environ.get(DIE_AFTER_ROWS_ENV, "0") or 0) if group.topo.rank != 0 else 0
    if group.topo.is_leader:
        return run_job(options, _DieAfterRows(progress, die_after) if die_after else progress, parallel=group)
    from engine.config import load_recipe

    engine = load_engine(load_recipe(options.recipe, options.overrides), group)
    finished = 0

    def requests():
        for request in group.receive():
            yield request
            # Test hook: die at the first pull after N rows; the leader has written them by then.
            if die_after and finished >= die_after:
                os._exit(9)

    for _ in engine.run(requests()):  # the leader's loop, in step with it; the results are the leader's to write
        finished += 1
    return None


def _finish(options: JobOptions, recipe, output: Path, report_path: Path, settled: Settled,
            parts: list) -> JobOutcome:
    """Global rank 0, once every group is done: one output, one report, no shards."""
    from engine.report import write_report

    manifest = output_manifest(recipe, options.input)
    dropped = merge_shards(output, manifest, existing_shards(output))
    summary, exit_code = merge_reports(parts, output, settled, dropped)
    write_report(summary, report_path)
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


class _DieAfterRows:
    """Test hook (MAGICDEC_TEST_DIE_AFTER_ROWS): a ProgressSink that kills this rank after N rows."""

    def __init__(self, inner, rows: int):
        self.inner, self.rows = inner, rows

    def start(self, total, done):
        self.inner.start(total, done)

    def update(self, report, stats):
        self.inner.update(report, stats)
        if report.rows_ok + report.rows_failed >= self.rows:
            os._exit(9)

    def finish(self):
        self.inner.finish()
