"""Running a job on one process or many (tensor parallel with DeepSpeed, data parallel groups).

`run` is what the CLI calls in every process; `needs_launch` / `launch` start the worker processes
when the user asked for --tp/--dp without an external launcher. Single-process jobs go straight to
`engine.job.run_job`.
"""

from __future__ import annotations

import os

from engine.errors import JobError
from engine.job import JobOptions, JobOutcome, run_job


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def needs_launch(tp: int, dp: int) -> bool:
    """True when more than one process is wanted and none was started by a launcher."""
    return tp * dp > 1 and world_size() == 1


def launch(argv: list[str], *, tp: int, dp: int, options: JobOptions) -> int:
    raise JobError("--tp/--dp > 1: multi-process runs are not available in this build")


def run(options: JobOptions, progress, *, tp: int = 1, dp: int = 1) -> JobOutcome | None:
    return run_job(options, progress)
