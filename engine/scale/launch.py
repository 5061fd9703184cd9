"""Starting a multi-process job on one machine: `magicdec run --tp N --dp M` without a launcher.

`launch` checks everything checkable (so a bad job is one line and nothing starts), then starts the
`N * M` workers with the environment torchrun and DeepSpeed's launcher would set, running the command
it is handed (the CLI passes its own argv), and supervises them: when one fails the others are
stopped, and SIGINT / SIGTERM are forwarded. Workers die with it (`die_with_launcher`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from engine.job.options import JobOptions, check_outputs, claim_output, prepare
from engine.scale.topology import check_tensor_parallel, world_size

STOP_GRACE_S = 5.0  # after a failure or a signal, how long the workers get before SIGKILL
LAUNCHER_PID_ENV = "MAGICDEC_LAUNCHER_PID"


class WorkersFailed(Exception):
    """The launched workers stopped early; `exit_code` is what magicdec exits with."""

    def __init__(self, message: str | None, exit_code: int):
        super().__init__(message or "")
        self.message = message
        self.exit_code = exit_code


def needs_launch(tp: int, dp: int | None) -> bool:
    """True when more than one process is wanted and none was started by a launcher."""
    return tp * (dp or 1) > 1 and "WORLD_SIZE" not in os.environ


def launch(command: list[str], *, tp: int, dp: int | None, options: JobOptions) -> int:
    """Start tp x dp workers running `command` (argv, e.g. `python -m magicdec_cli.main run ...`) on this
    machine; return the job's exit code.

    Everything checkable is checked here first, so a bad job is one line and nothing starts. The
    output's lock is taken here and held until every worker has ended (they know it from
    LAUNCHER_PID_ENV). Raises WorkersFailed when a worker fails (the others are stopped) or on
    SIGINT / SIGTERM.
    """
    dp = dp or 1
    world = tp * dp
    recipe, _, output, _ = prepare(options)
    check_tensor_parallel(recipe, tp, dp, world)
    with claim_output(output):
        check_outputs(options.mode, output)
        return _start(command, world)


def job_lock(options: JobOptions):
    """The output's lock, when this process is the whole job (no launcher around it): a context
    manager. Otherwise a no-op: `launch` or global rank 0 (`engine.scale.run`) takes the lock."""
    if world_size() != 1:
        return contextlib.nullcontext()
    _, _, output, _ = prepare(options)
    return claim_output(output)


def _start(command: list[str], world: int) -> int:
    port = _free_port()
    threads = max(1, _cpu_count() // world)
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


def die_with_launcher() -> None:
    """A worker of `launch` dies with it (Linux), so a killed supervisor leaves no orphans behind."""
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(pid):  # it died before prctl took effect
        os._exit(1)
