"""The two kinds of failure magicdec distinguishes.

`JobError`: the job cannot run at all (bad recipe, unreadable input, missing model, ...). The CLI
prints its one-line message and exits 2, having written nothing.
`RowError`: one input row is unusable; it becomes an error record and the job goes on.
`OutputError`: the output cannot be written any more (disk full, I/O error) part-way through a job:
the job stops, every row already written is kept, and `--resume` finishes it once the cause is gone.
This module holds no error *handling*; that belongs to the CLI and the job runner.
"""


class JobError(Exception):
    """A problem with the job as a whole; the message is one line naming the file, row or key."""


class RowError(Exception):
    """A problem with a single row; the message is one line saying what is wrong with it."""


class OutputError(Exception):
    """Writing the output failed mid-job; the message is one line naming the file and the cause."""
