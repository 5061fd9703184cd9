"""The one console of the CLI: Rich on stderr, quiet/JSON modes, rank-aware, progress for jobs.

Only this module writes to the terminal. Under tensor or data parallelism every rank but 0 stays
silent except for errors, so no `print` is ever rebound. Progress is a Rich bar on a terminal and a
plain log line every `LOG_EVERY_S` seconds otherwise (cron, CI, pipes), so logs stay readable. The
engine's one-time steps (`engine.steps`, logged at INFO) and warnings become `magicdec: ...` lines
on stderr through `Out.attach_engine_log`: shown with `--json` (stdout stays the JSON alone),
dropped with `--quiet`.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

LOG_EVERY_S = 30.0


def rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


class Out:
    def __init__(self, *, quiet: bool = False, json_mode: bool = False):
        self.quiet = quiet
        self.json_mode = json_mode
        self.err = Console(stderr=True, highlight=False)
        self.out = Console(highlight=False, soft_wrap=True)
        self.lead = rank() == 0

    @property
    def chatty(self) -> bool:
        return self.lead and not self.quiet and not self.json_mode

    def info(self, message: str) -> None:
        if self.chatty:
            self.err.print(message)

    def step(self, message: str) -> None:
        """A one-time step the engine announces (kept with --json: it goes to stderr)."""
        if self.lead and not self.quiet:
            self.err.print(f"magicdec: {message}", soft_wrap=True, markup=False)

    def warn(self, message: str) -> None:
        if self.lead and not self.quiet:
            from rich.markup import escape

            self.err.print(f"[yellow]magicdec: warning:[/] {escape(message)}", soft_wrap=True)

    def attach_engine_log(self) -> "Out":
        """Route the `engine` logger (steps at INFO, warnings) to this console; replaces an earlier one."""
        logger = logging.getLogger("engine")
        for handler in [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]:
            logger.removeHandler(handler)
        logger.addHandler(_ConsoleHandler(self))
        logger.setLevel(logging.INFO)
        logger.propagate = False
        return self

    def error(self, message: str) -> None:
        # One line whatever the terminal width (scripts grep it); escape the message's own brackets.
        from rich.markup import escape

        self.err.print(f"[bold red]magicdec: error:[/] {escape(message)}", soft_wrap=True, highlight=False)

    def table(self, title: str, rows: list[tuple[str, str]], *, stdout: bool = False) -> None:
        """A two-column table: on stderr beside progress, or on stdout when it is the command's output."""
        if not self.chatty:
            return
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for label, value in rows:
            table.add_row(label, value)
        (self.out if stdout else self.err).print(table)

    def progress(self) -> "JobProgress":
        return JobProgress(self)


class _ConsoleHandler(logging.Handler):
    def __init__(self, out: Out):
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        (self.out.warn if record.levelno >= logging.WARNING else self.out.step)(message)


class JobProgress:
    """The engine's ProgressSink: rows done / total, tokens/s, acceptance, ETA.

    On a terminal a Rich bar; otherwise (cron, CI, a pipe) one line at the start and one every
    LOG_EVERY_S seconds with the percentage and an ETA (the rows still to do at this run's rate).
    """

    def __init__(self, out: Out, *, clock=time.monotonic):
        self.out = out
        self.enabled = out.chatty
        self.live = self.enabled and out.err.is_terminal
        self.clock = clock
        self.bar: Progress | None = None
        self.task = None
        self.total = None
        self.estimated = False
        self.started = self.last_log = clock()
        self.done_at_start = 0

    def start(self, total: int | None, done: int, *, estimated: bool = False) -> None:
        self.total, self.estimated, self.done_at_start = total, estimated, done
        self.started = self.last_log = self.clock()
        if not self.enabled:
            return
        if self.live:
            self.bar = Progress(TextColumn("[bold]rows"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                console=self.out.err, transient=False)
            self.bar.start()
            self.task = self.bar.add_task("rows", total=total, completed=done, stats="")
        else:
            self.out.err.print(f"started: {self._total_text()} rows" + (f", {done} already done" if done else ""),
                               soft_wrap=True)

    def _total_text(self) -> str:
        if self.total is None:
            return "unknown number of"
        return f"~{self.total} (estimated)" if self.estimated else str(self.total)

    def _stats_text(self, report, stats) -> str:
        tps = stats.decode_tokens / stats.decode_s if stats.decode_s else 0.0
        text = f"{tps:6.1f} tok/s"
        if stats.draft_tokens:
            text += f"  acc {stats.acceptance_rate:.2f}"
        if report.rows_failed:
            text += f"  [red]{report.rows_failed} failed[/]"
        if self.estimated:
            text += "  (total estimated)"
        return text

    def update(self, report, stats) -> None:
        if not self.enabled:
            return
        done = report.rows_ok + report.rows_failed + report.rows_resumed
        if self.bar is not None:
            self.bar.update(self.task, completed=done, stats=self._stats_text(report, stats))
        elif self.clock() - self.last_log >= LOG_EVERY_S:
            self.last_log = self.clock()
            self.out.err.print(self.log_line(done, stats), soft_wrap=True)  # one line, whatever the width

    def log_line(self, done: int, stats) -> str:
        """`progress: 25/100 rows (25%), 31.5 decode tok/s, acceptance 0.84, elapsed 1m00s, ETA 3m00s`."""
        line = f"progress: {done}"
        if self.total is not None:
            line += f"/{'~' if self.estimated else ''}{self.total} rows ({100 * done / max(self.total, 1):.0f}%)"
        else:
            line += " rows"
        tps = stats.decode_tokens / stats.decode_s if stats.decode_s else 0.0
        line += f", {tps:.1f} decode tok/s"
        if stats.draft_tokens:
            line += f", acceptance {stats.acceptance_rate:.2f}"
        elapsed = self.clock() - self.started
        line += f", elapsed {duration(elapsed)}"
        finished = done - self.done_at_start
        if self.total is not None and finished > 0:
            line += f", ETA {duration(max(self.total - done, 0) * elapsed / finished)}"
        elif self.total is not None:
            line += ", ETA unknown until a row finishes"
        return line

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def duration(seconds: float) -> str:
    """`45s`, `3m05s`, `2h04m`."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def flush_all() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
